"""A scripted agent run for the inspector's tests: a native tool-calling session at a small window, whose large
results spill and whose old results are elided, driven through the proxy against the scripted fake upstream."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ctxproxy.config import Settings, load_settings

BASH = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
WINDOW = 4096


def small_window(data_dir: Path, **env: str) -> Settings:
    """A 4k window, results over 1500 characters spilled: a run of a few rounds spills and elides."""
    return load_settings(env={"CTXPROXY_DATA_DIR": str(data_dir), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                              "CTXPROXY_CTX_WINDOW": str(WINDOW), "CTXPROXY_SPILL_CHARS": "1500",
                              **{f"CTXPROXY_{k.upper()}": v for k, v in env.items()}})


def result(i: int) -> str:
    """Round ``i``'s tool output: every fourth is a 4 KB log (spilled), the others ~700 characters."""
    if i % 4 == 3:
        return "".join(f"log line {j} of run {i}: test_case_{j} PASSED in 0.{j:02d}s\n" for j in range(80))
    return "".join(f"def f{i}_{j}(x):\n    return x + {j}  # part {i}\n" for j in range(16))


def history(rounds: int, output: Callable[[int], str] = result) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "Please make the test suite pass."}]
    for i in range(rounds):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "bash", "arguments": f'{{"cmd": "cat part{i}.py"}}'}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": output(i)})
    return messages


def run(post: Callable[..., Any], rounds: int, session: str | None = "inspected", start: int = 1,
        output: Callable[[int], str] = result) -> str:
    """Send rounds ``start``..``rounds`` of the scripted run as session ``session`` (None: unnamed, placed by the
    proxy); each must be answered 200. Returns the session's id."""
    headers = {"X-Session-Id": session} if session else {}
    whole = history(rounds, output)
    for n in range(start, rounds + 1):
        answer = post("/v1/chat/completions", json={"model": "fake-model", "messages": whole[:2 + 2 * n],
                                                    "tools": [BASH]}, headers=headers)
        assert answer.status_code == 200, answer.text
    return str(answer.headers["x-ctx-session"])
