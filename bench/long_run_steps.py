"""The 600-round run in process, each request's own steps timed: where a slow request of ``long_run.py`` spends it.

Why: ``long_run.py`` says which requests of a long session are slow (a fold pass, the request that turns the
mirror on) and ``profile_proxy.py`` samples a whole process; neither says which of a request's steps took its
time. This replays ``long_run.py``'s requests through the app in this process (``httpx.ASGITransport``, the same
fixed answer as its upstream) and times, per request, the steps ``STEPS`` names (the projection, the mirror's file
and its journal, the forward's journal, the commits...) by wrapping them. The steps that a large request runs on
a worker thread or on the journal's thread run inline here (``_inline``), so each is timed on the thread that
runs it: the times are the work, not the waits. A step's time includes the steps it calls (``fitting`` holds most).

Run: ``.venv/bin/python bench/long_run_steps.py --window 128000 --requests 439,460,478``
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import inspect
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import long_run  # noqa: E402

from ctxproxy.config import load_settings  # noqa: E402
from ctxproxy.proxy.edge.app import create_app  # noqa: E402

STEPS = (
    ("ctxproxy.proxy.engine.forward", "Forwarder.fitting", "fitting"),
    ("ctxproxy.proxy.engine.planning", "_shape", "shape"),
    ("ctxproxy.proxy.engine.planning", "project", "project"),
    ("ctxproxy.proxy.engine.planning", "_upstream_bytes", "upstream bytes"),
    ("ctxproxy.proxy.engine.mirror_file", "_write", "mirror file"),
    ("ctxproxy.proxy.engine.mirror_file", "mirror_document", "mirror rendered whole"),
    ("ctxproxy.proxy.engine.mirror_file", "appended_document", "mirror grown"),
    ("ctxproxy.proxy.engine.mirror_file", "rewrite_in_place", "mirror file written whole"),
    ("ctxproxy.store.journal", "Journal.record_forward", "forward journaled"),
    ("ctxproxy.store.session_state", "_record_shown", "mirror journaled"),
    ("ctxproxy.store.sql", "SqliteConnection._end", "commits"),
    ("ctxproxy.proxy.engine.planning", "_tallied", "tally"),
)
"""(module, attribute, label) of each step timed; a dotted attribute is a class's method."""

CHAT = "/v1/chat/completions"
HEADERS = {"content-type": "application/json"}


class Timings:
    """Per request, the milliseconds each step took (summed over its calls)."""

    def __init__(self) -> None:
        self.current: defaultdict[str, float] = defaultdict(float)
        self.requests: list[dict[str, float]] = []

    def add(self, label: str, started: int) -> None:
        self.current[label] += (time.perf_counter_ns() - started) / 1e6

    def next_request(self, total_ms: float) -> None:
        self.requests.append({**self.current, "total": total_ms})
        self.current.clear()


def _timed(fn: Callable[..., Any], label: str, timings: Timings) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter_ns()
            try:
                return await fn(*args, **kwargs)
            finally:
                timings.add(label, started)
        return timed_async

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            timings.add(label, started)
    return timed


def wrap_steps(timings: Timings) -> None:
    """Each step of ``STEPS`` replaced, where its callers look it up, by itself timed."""
    for module_name, attribute, label in STEPS:
        owner: Any = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, name, _timed(getattr(owner, name), label, timings))


def _never(*args: Any, **kwargs: Any) -> bool:
    return False


def _inline() -> None:
    """The steps a large request runs on a worker or on the journal's thread, run on the loop instead."""
    for module_name, name in (("ctxproxy.proxy.edge.chat", "is_heavy"), ("ctxproxy.proxy.engine.planning", "is_large"),
                              ("ctxproxy.proxy.engine.intercept", "is_large"),
                              ("ctxproxy.proxy.engine.context", "heavy_journaling")):
        setattr(importlib.import_module(module_name), name, _never)


UPSTREAM = {"delay": 0.0, "timings": None, "started": 0}
"""``--upstream-ms`` and where the upstream notes when a request reached it (``to upstream``)."""


async def _upstream(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
    """``long_run.py``'s upstream: its fixed answer, without usage, to every request, after ``--upstream-ms``."""
    timings = UPSTREAM["timings"]
    if isinstance(timings, Timings) and "to upstream" not in timings.current:
        timings.add("to upstream", int(UPSTREAM["started"]))
    while (await receive()).get("more_body"):
        pass
    if UPSTREAM["delay"]:
        await asyncio.sleep(float(UPSTREAM["delay"]))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": long_run.NO_USAGE})


async def replay(window: int, rounds: int, timings: Timings) -> None:
    """``long_run.py``'s requests, one after the other, through the app in this process (a warm-up chat first)."""
    with tempfile.TemporaryDirectory(prefix="ctxproxy-steps-") as data:
        settings = load_settings(env={"CTXPROXY_DATA_DIR": data, "CTXPROXY_UPSTREAM": "http://upstream.test/v1",
                                      "CTXPROXY_CTX_WINDOW": str(window)})
        app = create_app(settings, upstream_transport=httpx.ASGITransport(app=_upstream))
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://proxy.test", timeout=600) as client:
            await client.post(CHAT, content=orjson.dumps(long_run.WARM_UP), headers=HEADERS)
            timings.current.clear()
            for body in long_run.bodies(rounds):
                started = UPSTREAM["started"] = time.perf_counter_ns()
                answer = await client.post(CHAT, content=body, headers=HEADERS)
                if answer.status_code != 200:
                    raise RuntimeError(f"the proxy answered {answer.status_code}: {answer.text[:300]}")
                timings.next_request((time.perf_counter_ns() - started) / 1e6 - 1000 * float(UPSTREAM["delay"]))


def table(timings: Timings, chosen: list[int], last: int) -> str:
    """Markdown: the chosen requests' steps (``total``: the request as the client timed it), then each step's median
    over all requests and over the last ``last``."""
    labels = ["total", "to upstream", *(label for _, _, label in STEPS)]
    rows = [f"| {i} | " + " | ".join(f"{timings.requests[i].get(label, 0):.2f}" for label in labels) + " |"
            for i in chosen]
    for name, part in (("median, all", timings.requests), (f"median, last {last}", timings.requests[-last:])):
        rows.append(f"| {name} | " + " | ".join(f"{statistics.median(r.get(label, 0) for r in part):.2f}"
                                               for label in labels) + " |")
    head = "| request | " + " | ".join(labels) + " |"
    return "\n".join([head, "|" + "---:|" * (len(labels) + 1), *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--window", type=int, default=131072)
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--requests", default="", help="comma-separated request numbers (from 0) to show")
    parser.add_argument("--last", type=int, default=150, help="the last requests' medians too (the mirror's part)")
    parser.add_argument("--slowest", type=int, default=0, help="and the N requests that took longest, in order")
    parser.add_argument("--upstream-ms", type=float, default=0.0, help="the upstream answers after this long (left "
                        "out of total): what the proxy does meanwhile is not waited for")
    args = parser.parse_args(argv)
    timings = Timings()
    UPSTREAM.update(delay=args.upstream_ms / 1000, timings=timings)
    _inline()
    wrap_steps(timings)
    asyncio.run(replay(args.window, args.rounds, timings))
    chosen = [int(n) for n in args.requests.split(",") if n.strip()]
    by_total = sorted(range(len(timings.requests)), key=lambda i: -timings.requests[i]["total"])
    chosen += sorted(set(by_total[: args.slowest]) - set(chosen))
    print(f"{args.rounds} rounds at {args.window} tokens, in process, ms per request (a step includes those it calls)")
    print(table(timings, chosen, min(args.last, len(timings.requests))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
