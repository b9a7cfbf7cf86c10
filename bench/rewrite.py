"""The rewrite core's guarantees, measured: budgets kept, pairs whole, text intact, cuts restorable, prefix reuse.

Why: issue #3's "done when" is a set of numbers. This script produces all of them in one run:

1. every recorded trajectory (the directory ``CTXPROXY_TRAJECTORIES`` names; left out, and said so, when it is
   not set) replayed through the proxy's request path (``proxy.commands.replay``) at 4k, 8k and 32k: requests, refused
   (cannot fit even after every cut), invariant violations, the largest request sent, requests over the window;
   the fenced ones likewise, and a generated fenced run whose results no preset knows (``bench/gen_fenced.py``)
   at 4k, 8k and 16k, with the newest rounds' text lost and the cuts not restorable;
2. the 60-round workload of ``tests/workloads.py`` (``--conversation`` takes another, e.g. the peers' shared
   ``conversation-60.json``) and a generated 600-round one, sent
   through the real app to a model server that counts every prompt itself (``tests.fakes.CountingUpstream``,
   cl100k + template cost) and refuses any prompt over its window: requests over the window by the upstream's
   own count, broken pairs and changed text at the upstream, characters sent, prefix reuse, uncached characters;
3. the same against a server that counts 1.3x what tiktoken counts (the calibration must catch up) and one that
   answers llama.cpp's overflow error once (the client must still get its answer);
4. the cost of the rewrite of request 600 against request 60 of the 600-round session (hashing, projection and
   invariant check; JSON decoding aside), median of repeated runs;
5. with ``--gpu-model DIR`` (the peers' ``bench/gpu/``, or ``CTXPROXY_GPU_MODEL``), the GPU seconds of each
   workload sent through the app, from the shared H200 cost model run on its upstream trace (``gpu``): what the
   peers' GPU table gives each peer on the 60-round workload at 32k.

Run: ``.venv/bin/python bench/rewrite.py [--json bench/results/rewrite.json] [--conversation FILE] [--gpu-model
DIR]``. Nothing leaves this process but the cost model's, run on each trace.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402
import orjson  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from gpu_model import GPU_ENV, default_model, gpu_seconds, missing_note  # noqa: E402

from ctxproxy.config import load_settings  # noqa: E402
from ctxproxy.proxy.commands.replay import replay, summarize  # noqa: E402
from ctxproxy.proxy.core import Rules, violations  # noqa: E402
from ctxproxy.proxy.core.project import project  # noqa: E402
from ctxproxy.proxy.core.tokens import MessageCounter  # noqa: E402
from ctxproxy.proxy.edge.app import create_app  # noqa: E402
from ctxproxy.proxy.engine.budgets import budget_for  # noqa: E402
from ctxproxy.proxy.engine.hashing import MessageHasher  # noqa: E402
from tests.fakes import CountingUpstream, Reply  # noqa: E402
from tests.workloads import TRAJECTORIES_ENV, conversation, trajectories_dir  # noqa: E402

WINDOWS = (4096, 8192, 32768)


def load_conversation(path: Path | None) -> dict[str, Any]:
    """The 60-round workload: generated (``tests/workloads.py``), or read from ``path`` when given."""
    if path is None:
        return conversation(rounds=60)
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def trajectories(variant: str = "native") -> list[dict[str, Any]]:
    """Per recorded trajectory of ``variant`` (native or fenced) and window: what the core does with it; none
    when ``CTXPROXY_TRAJECTORIES`` is not set."""
    corpus = trajectories_dir()
    if corpus is None:
        return []
    rows, counter, settings = [], MessageCounter(), load_settings(env={})
    for path in sorted(corpus.glob(f"*.{variant}.json")):
        conversation = json.loads(path.read_text())
        for window in WINDOWS:
            s = summarize(list(replay(conversation, settings, window, counter)))
            rows.append({"file": path.name, "window": window, "requests": s.requests, "refused": s.refused,
                         "violations": s.violations, "max_tokens_sent": s.max_tokens_out, "over_window": s.over_window,
                         "reuse": round(s.reuse, 4)})
    return rows


def unknown_wrapper(rounds: int = 40, seed: int = 11) -> list[dict[str, Any]]:
    """``bench/gen_fenced.py``'s run, whose results use wrappers no preset knows, on the fenced route."""
    from bench.gen_fenced import build

    rows, counter, settings = [], MessageCounter(), load_settings(env={"CTXPROXY_ROUTE": "fenced"})
    for window in (4096, 8192, 16384):
        s = summarize(list(replay(build(rounds, seed), settings, window, counter)))
        rows.append({"window": window, "requests": s.requests, "refused": s.refused, "violations": s.violations,
                     "newest_text_lost": s.newest_lost, "unrestorable": s.unrestorable,
                     "max_tokens_sent": s.max_tokens_out, "over_window": s.over_window, "reuse": round(s.reuse, 4),
                     "uncached_chars": s.uncached})
    return rows


def through_the_app(conversation: dict[str, Any], window: int, ratio: float = 1.0,
                    first_reply: Reply | None = None, **env: str) -> dict[str, Any]:
    """Send the agent's requests (history through each tool result) through the app to a counting upstream."""
    upstream = CountingUpstream(window=window, ratio=ratio)
    if first_reply is not None:
        upstream.enqueue(first_reply)
    messages = conversation["messages"]
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "tool"]
    with tempfile.TemporaryDirectory(prefix="ctxproxy-bench-") as tmp:
        settings = load_settings(env={"CTXPROXY_DATA_DIR": tmp, "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                      "CTXPROXY_CTX_WINDOW": str(window), **env})
        with TestClient(create_app(settings, httpx.ASGITransport(app=upstream))) as client:
            answers = [client.post("/v1/chat/completions", json={
                "model": "m", "tools": conversation["tools"], "messages": messages[:end]}) for end in ends]
            restored = _restorable(client, answers[-1].headers["x-ctx-session"], messages, upstream)
    return _upstream_report(upstream, messages, ends, [a.status_code for a in answers]) | restored


def _restorable(client: TestClient, session: str, messages: list[Any], upstream: CountingUpstream) -> dict[str, int]:
    """Every stub in the last request sent: is its id's body, read back through the API, the original result?"""
    originals = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
    stubs = [(m["tool_call_id"], m["content"][13:77]) for m in upstream.last_chat.json()["messages"]
             if m["role"] == "tool" and m["content"].startswith("[overflow id=")]
    intact = sum(client.get(f"/ctx/sessions/{session}/overflow/{oid}").content == originals[cid].encode()
                 for cid, oid in stubs)
    return {"stubs_in_last_request": len(stubs), "restored_byte_for_byte": intact}


def upstream_trace(bodies: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Each upstream request with messages, in order: its characters (each message's JSON and the tool list) and
    those that repeat the previous request's from its start (the peers' prefix reuse, ``shared/bench/README.md``),
    as the shared GPU cost model reads them (``bench/gpu_model.py``)."""
    out: list[dict[str, int]] = []
    previous: list[bytes] = []
    for body in (b for b in bodies if len(b["messages"]) > 0):
        encoded = [json.dumps(m, ensure_ascii=False).encode() for m in body["messages"]]
        tools = len(json.dumps(body.get("tools"), ensure_ascii=False))
        same = next((i for i, (a, b) in enumerate(zip(previous, encoded, strict=False)) if a != b),
                    min(len(previous), len(encoded)))
        out.append({"chars": sum(map(len, encoded)) + tools,
                    "reused_chars": sum(map(len, encoded[:same])) + (tools if previous else 0)})
        previous = encoded
    return out


def _upstream_report(upstream: CountingUpstream, messages: list[Any], ends: list[int],
                     statuses: list[int]) -> dict[str, Any]:
    sent = [r.json() for r in upstream.chats]
    trace = upstream_trace(sent)
    chars, reused = sum(t["chars"] for t in trace), sum(t["reused_chars"] for t in trace)
    broken = 0
    for body, end in zip(sent[-len(ends):], ends, strict=False):
        own = [m for m in body["messages"] if not str(m.get("content") or "").startswith("[ctxproxy]")]
        broken += len(violations(messages[:end], own))  # the proxy's notices to the model are additions
    return {"requests": len(ends), "answered_200": statuses.count(200), "upstream_calls": len(sent),
            "over_window": upstream.over_window, "over_window_at": [i for i, c in enumerate(upstream.counts)
                                                                    if c > upstream.window],
            "max_prompt_tokens": max(upstream.counts), "invariant_violations": broken, "chars_sent": chars,
            "chars_reused": reused, "reuse": round(reused / chars, 4), "uncached_chars": chars - reused,
            "trace": trace}


def rewrite_cost(conversation: dict[str, Any], requests: tuple[int, int] = (60, 600), repeats: int = 60,
                 window: int = 32768) -> dict[str, Any]:
    """Per request k: median ms to project and check it given the session's state after request k - 1 (the
    rewrite), and, apart, to give its freshly decoded messages their identities (the hash-reuse check). The two
    requests are timed alternately, so the machine's drift hits both alike."""
    counter, settings = MessageCounter(), load_settings(env={})
    rules = Rules(budget_for(settings, window), tools_tokens=counter.count_tools(conversation["tools"]))
    messages = conversation["messages"]
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "tool"]
    decisions: list[Any] = []
    state, hasher, inputs = None, MessageHasher(), {}
    for k, end in enumerate(ends, start=1):
        if k in requests:
            inputs[k] = (messages[:end], list(decisions), state.copy() if state is not None else None)
        hashes = hasher.hash("s", messages[:end]).hashes
        p = project(messages[:end], hashes, decisions, rules, counter, state)
        decisions, state = decisions + list(p.new), p.state
    samples: dict[int, list[tuple[float, float]]] = {k: [] for k in requests}
    for _ in range(repeats):
        for k in requests:
            samples[k].append(_timed_rewrite(*inputs[k], rules, counter))
    out: dict[str, Any] = {}
    for k in requests:
        out[f"request_{k}"] = {"identity_ms": round(statistics.median(s[0] for s in samples[k]), 3),
                               "rewrite_ms": round(statistics.median(s[1] for s in samples[k]), 3),
                               "history_bytes": len(orjson.dumps(inputs[k][0]))}
    first, last = out[f"request_{requests[0]}"], out[f"request_{requests[1]}"]
    out["rewrite_ratio"] = round(last["rewrite_ms"] / first["rewrite_ms"], 2)
    out["identity_ratio"] = round(last["identity_ms"] / first["identity_ms"], 2)
    return out


def _timed_rewrite(request: list[Any], decisions: list[Any], state: Any, rules: Rules,
                   counter: MessageCounter) -> tuple[float, float]:
    """One freshly decoded copy of the request (decoding not timed): ms to hash it, ms to project and check it."""
    hasher = MessageHasher()
    hasher.hash("s", orjson.loads(orjson.dumps(request[:-2])))  # the previous request, already seen
    fresh = orjson.loads(orjson.dumps(request))
    previous = state.copy() if state is not None else None  # project() consumes the state it extends
    started = time.perf_counter()
    hashes = hasher.hash("s", fresh).hashes
    hashed = time.perf_counter()
    p = project(fresh, hashes, decisions, rules, counter, previous)
    violations(fresh, p.messages, start=p.report.reused, pairs=False)
    return (hashed - started) * 1000, (time.perf_counter() - hashed) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "rewrite.json")
    parser.add_argument("--conversation", type=Path, help="the 60-round workload from this file (default: generated "
                        "by tests/workloads.py; the peers' is PEERS/conversation-60.json)")
    parser.add_argument("--gpu-model", type=Path, default=default_model(),
                        help=f"the folder of the shared gpu_seconds.py (or {GPU_ENV}): the workloads' GPU seconds")
    args = parser.parse_args(argv)
    sixty = load_conversation(args.conversation)
    six_hundred = conversation(rounds=600)
    overflow_once = Reply(status=400, body={"error": {"code": 400, "type": "exceed_context_size_error",
                                                      "message": "the request exceeds the available context size",
                                                      "n_prompt_tokens": 40000, "n_ctx": 32768}})
    report = {
        "command": "python bench/rewrite.py" + (f" --conversation {args.conversation}" if args.conversation else ""),
        "conversation_60": str(args.conversation) if args.conversation else "generated: tests/workloads.py, seed 7",
        "trajectories": trajectories(),
        "fenced_trajectories": trajectories("fenced"),
        "unknown_wrapper_generated": unknown_wrapper(),
        "conversation_60_at_32k": through_the_app(sixty, 32768),
        "conversation_600_at_32k": through_the_app(six_hundred, 32768),
        "counts_1_3x_at_8k": through_the_app(sixty, 8192, ratio=1.3),
        # without the reserve's headroom, only the calibration stands between the estimate and the window
        "counts_1_3x_at_8k_no_reserve": through_the_app(sixty, 8192, ratio=1.3, CTXPROXY_CONTEXT_RESERVE="0"),
        "llama_cpp_overflow_once": through_the_app(sixty, 32768, first_reply=overflow_once),
        "rewrite_cost_600_vs_60": rewrite_cost(six_hundred),
        "gpu_note": missing_note(args.gpu_model),
    }
    with_gpu_seconds(report, args.gpu_model)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if "trajectories" not in k}, indent=1))
    _print_trajectories("native", report["trajectories"])
    _print_trajectories("fenced", report["fenced_trajectories"])
    return 0


def with_gpu_seconds(report: dict[str, Any], model_dir: Path | None) -> None:
    """Each workload sent through the app gets the shared cost model's verdict on its upstream trace (``gpu``: None
    without the model), and loses the trace itself."""
    with tempfile.TemporaryDirectory(prefix="ctxproxy-gpu-") as tmp:
        for run in report.values():
            if isinstance(run, dict) and "trace" in run:
                run["gpu"] = gpu_seconds(model_dir, run.pop("trace"), Path(tmp))


def _print_trajectories(variant: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        print(f"{variant} trajectories: none replayed ({TRAJECTORIES_ENV} is not set)")
        return
    for window in WINDOWS:
        chosen = [r for r in rows if r["window"] == window]
        print(f"{variant}, window {window}: {len(chosen)} files, {sum(r['requests'] for r in chosen)} requests, "
              f"{sum(r['refused'] for r in chosen)} refused, {sum(r['violations'] for r in chosen)} violations, "
              f"max sent {max(r['max_tokens_sent'] for r in chosen)} tokens")


if __name__ == "__main__":
    sys.exit(main())
