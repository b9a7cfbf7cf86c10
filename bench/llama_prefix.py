"""Prompt-processing time on a real llama.cpp server: ctxproxy vs a sliding-window client, one long agent run.

Why: the proxy's claim is that eliding rarely and deep keeps the upstream's prefix cache alive, so a run that
overflows the window costs less through ctxproxy than through the usual fallback, a client that drops its oldest
messages on every request (which changes the prompt's start each time, so the server reprocesses all of it).

The run is scripted (the agent's tool calls and results are fixed; the model's answers are discarded, ``max_tokens``
is 1), so both modes send the same history. Each mode gets a fresh server (cold cache): SmolLM2-135M via
llama-cpp-python, ``n_ctx`` 2048, one thread, prepared by ``scripts/real-model``. Raw, the run ends far over the
window (the server refuses it: counted too). Time per request is the wall time of the request, which with one
output token is the server's prompt processing plus a few milliseconds.

Run: ``.venv/bin/python bench/llama_prefix.py --rounds 24 --markdown``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ctxproxy.config import load_settings
from ctxproxy.proxy.core.tokens import MessageCounter
from ctxproxy.proxy.edge.app import create_app
from tests.fakes import serve_in_thread
from tests.real.upstream import agent_history, llama_server

N_CTX = 2048
Send = Callable[[list[dict[str, Any]]], tuple[int, int, float]]


def agent_run(rounds: int) -> list[list[dict[str, Any]]]:
    """The request sequence of one agent run: each request is the whole history so far (what agents send)."""
    history = agent_history(rounds, lines=20)
    return [history[: 2 + 2 * (i + 1)] for i in range(rounds)]


def post(base: str, messages: list[dict[str, Any]]) -> tuple[int, int, float]:
    """(status, prompt_tokens, seconds) of one request with a single output token."""
    started = time.perf_counter()
    answer = httpx.post(base + "/v1/chat/completions", timeout=600,
                        json={"model": "smollm2", "messages": messages, "max_tokens": 1, "temperature": 0})
    seconds = time.perf_counter() - started
    usage = answer.json().get("usage") or {} if answer.status_code == 200 else {}
    return answer.status_code, int(usage.get("prompt_tokens") or 0), seconds


def sliding_window(base: str, budget: int) -> Send:
    """Drop the oldest whole rounds (after the system and task messages) until the estimate fits ``budget``."""
    counter = MessageCounter()

    def send(messages: list[dict[str, Any]]) -> tuple[int, int, float]:
        head, rest = messages[:2], messages[2:]
        while rest and sum(counter.count(m) for m in head + rest) * 1.15 > budget:
            rest = rest[2:]  # one assistant call and its result
        return post(base, head + rest)

    return send


def run_mode(name: str, rounds: int, log_dir: Path) -> dict[str, Any]:
    with llama_server(N_CTX, log_dir / f"{name}.log") as llama:
        if name == "ctxproxy":
            settings = load_settings(env={"CTXPROXY_DATA_DIR": str(log_dir / "data"),
                                          "CTXPROXY_UPSTREAM": llama + "/v1", "CTXPROXY_NULL_CONTENT": "empty"})
            with serve_in_thread(create_app(settings)) as proxy:
                rows = [post(proxy, m) for m in agent_run(rounds)]
        elif name == "raw":
            rows = [post(llama, m) for m in agent_run(rounds)]
        else:
            send = sliding_window(llama, budget=N_CTX - 512)  # the proxy's own reserve at this window
            rows = [send(m) for m in agent_run(rounds)]
    ok = [r for r in rows if r[0] == 200]
    return {"mode": name, "requests": len(rows), "refused": len(rows) - len(ok),
            "total_s": round(sum(r[2] for r in ok), 2), "median_s": round(statistics.median(r[2] for r in ok), 3),
            "max_s": round(max(r[2] for r in ok), 3), "prompt_tokens": sum(r[1] for r in ok), "rows": rows}


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| mode | requests | refused (over n_ctx) | prompt tokens sent | total time of answered (s) | median (s) "
             "| slowest (s) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['requests']} | {r['refused']} | {r['prompt_tokens']} | {r['total_s']} "
                     f"| {r['median_s']} | {r['max_s']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", type=Path, help="also write every request's (status, prompt_tokens, s) here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_mode(name, args.rounds, Path(tmp)) for name in ("raw", "sliding-window", "ctxproxy")]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(markdown(results) if args.markdown else json.dumps([{k: v for k, v in r.items() if k != "rows"}
                                                               for r in results], indent=1))


if __name__ == "__main__":
    main()
