"""Where the latency ctxproxy adds goes: a sampling profile of the real proxy process, and a timing of each step.

Why two views: ``py-spy`` samples the proxy process as it serves the benchmark's requests (same fake upstream,
same processes as ``bench/latency.py``), so it sees everything, framework and journal thread included. It pauses
the proxy for each sample (unpaused sampling misattributes stacks), so ms/request run a little high: read the
shares, at a modest rate. Waits (uvloop's epoll, the idle journal thread) are dropped. ``--steps`` times, in this
process, the proxy's own functions on the chat path for one request body (parse, hash, journal...), which says
how much of the added time is the proxy's own work and how much is the HTTP hop and the frameworks.

Run: ``.venv/bin/python bench/profile_proxy.py --workload large`` (needs ``py-spy`` on PATH or
``--py-spy PATH``; ``pip install py-spy``), and ``.venv/bin/python bench/profile_proxy.py --steps``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import subprocess
import sys
import tempfile
import time
import timeit
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import latency_peers
import orjson
from latency import CHAT_PATH, Workload, generated, servers, time_first_byte, time_whole, workloads

NewText = tuple[dict[str, Any], Callable[[int], bytes]]

WORKLOADS = {"small": 0, "large": 1, "stream": 2, "new-small": 0, "new-large": 1}
"""``new-*``: the peers' method (``bench/latency_peers.py``): after the 60-request replay, new text in each body."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="large")
    parser.add_argument("--seconds", type=float, default=15.0, help="how long to sample (15)")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second (250)")
    parser.add_argument("--top", type=int, default=25, help="rows per table (25)")
    parser.add_argument("--py-spy", default=shutil.which("py-spy"), help="the py-spy executable")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()),
                        help="directory for the raw py-spy stacks (default: the temp dir; ~2 MB each)")
    parser.add_argument("--conversation", type=Path, help="the 630 KB history from this file (as bench/latency.py)")
    parser.add_argument("--steps", action="store_true", help="time the proxy's own steps in process instead")
    parser.add_argument("--nonblocking", action="store_true", help="py-spy samples without pausing the proxy: "
                        "less distortion of short Python frames, stacks now and then torn")
    args = parser.parse_args(argv)
    if args.steps:
        print(steps_report(workloads(False, args.conversation)))
        return 0
    if not args.py_spy:
        sys.exit("py-spy not found: `pip install py-spy` (anywhere) and pass --py-spy PATH")
    workload = workloads(False, args.conversation)[WORKLOADS[args.workload]]
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / f"profile-{args.workload}.txt"
    new_text = _new_text(args.workload, args.conversation)
    requests = sample(args.py_spy, workload, args.seconds, args.rate, raw, new_text, args.nonblocking)
    print(spy_report(raw, requests, args.rate, args.top))
    print(f"\nraw py-spy stacks: {raw} ({requests} requests in {args.seconds:g} s)")
    return 0


# --- py-spy -------------------------------------------------------------------------------------------------------
def _new_text(workload: str, conversation: Path | None) -> NewText | None:
    """For ``new-*``: the conversation to replay first, and the body of the i-th request."""
    if not workload.startswith("new-"):
        return None
    chat = orjson.loads(conversation.read_bytes()) if conversation else generated(rounds=60)
    kind = workload.removeprefix("new-")
    return chat, lambda i: latency_peers.nonce_body(chat, kind, i)


def sample(py_spy: str, workload: Workload, seconds: float, rate: int, raw: Path,
           new_text: NewText | None = None, nonblocking: bool = False) -> int:
    """Serve ``workload`` through the proxy, back to back, while py-spy records it; the number of requests.
    With ``new_text``, the conversation is replayed first and each request carries new text."""
    timer = time_first_byte if workload.stream else time_whole
    counter = itertools.count()

    def body() -> bytes:
        return new_text[1](next(counter)) if new_text else workload.body

    with tempfile.TemporaryDirectory(prefix="ctxproxy-profile-") as tmp, servers(Path(tmp), []) as targets, \
            httpx.Client(base_url=targets.proxied, timeout=30.0) as client:
        if new_text:
            latency_peers.replay(targets.proxied, new_text[0])
        for _ in range(20):
            timer(client, CHAT_PATH, body())
        spy = subprocess.Popen([py_spy, "record", *(["--nonblocking"] if nonblocking else []), "--pid",
                                str(targets.proxy_pid), "--rate", str(rate),
                                "--duration", str(int(seconds)), "--format", "raw", "--threads",
                                "--output", str(raw)], stdout=subprocess.DEVNULL)
        try:
            time.sleep(1.0)  # py-spy attaches
            requests, end = 0, time.monotonic() + seconds - 1.5
            while time.monotonic() < end:
                timer(client, CHAT_PATH, body())
                requests += 1
        finally:
            spy.wait()
    return requests


def _journal_wait() -> str:
    """The idle journal thread's leaf frame: ``store.hops._serve`` at its ``queue.get()``."""
    source = (Path(__file__).resolve().parent.parent / "store" / "hops.py").read_text().splitlines()
    line = next(n for n, text in enumerate(source, 1) if "queue.get()" in text)
    return f"_serve (ctxproxy/store/hops.py:{line})"


# Leaf frames that are waiting, not working: uvloop's epoll (seen with --native) and the idle journal thread (an
# executor's before store.hops).
IDLE_LEAVES = ("Runner.run (asyncio/runners.py", "_worker (concurrent/futures/thread.py:81)", _journal_wait())
LAYERS = {"httpx": "upstream client (httpx, httpcore, h11, anyio)", "httpcore": "upstream client (httpx, httpcore, "
          "h11, anyio)", "h11": "upstream client (httpx, httpcore, h11, anyio)", "anyio": "upstream client (httpx, "
          "httpcore, h11, anyio)", "sniffio": "upstream client (httpx, httpcore, h11, anyio)",
          "uvicorn": "uvicorn server", "fastapi": "FastAPI / Starlette", "starlette": "FastAPI / Starlette",
          "proxy": "ctxproxy (proxy/, store/)", "store": "ctxproxy (proxy/, store/)", "sqlite_utils": "SQLite",
          "asyncio": "asyncio + thread hand-offs", "concurrent": "asyncio + thread hand-offs",
          "threading": "asyncio + thread hand-offs"}


def spy_report(raw: Path, requests: int, rate: int, top: int) -> str:
    stacks = [(f, n) for f, n in _read_stacks(raw) if not f[-1].startswith(IDLE_LEAVES)]
    per_request = 1000.0 / rate / max(requests, 1)
    total = sum(n for _, n in stacks)
    tables: dict[str, Counter[str]] = {k: Counter() for k in ("thread", "layer (self time)", "package (self time)",
                                                              "function (self time)", "ctxproxy function (inclusive)")}
    for frames, count in stacks:
        tables["thread"][frames[0]] += count
        tables["layer (self time)"][LAYERS.get(_group(frames[-1]), "other stdlib (logging, json, contextlib...)")] \
            += count
        tables["package (self time)"][_group(frames[-1])] += count
        tables["function (self time)"][frames[-1]] += count
        for frame in {_no_line(f) for f in frames[1:]}:
            if _group(frame) in ("proxy", "store", "ctxproxy") and not frame.startswith(("main (", "_serve (")):
                tables["ctxproxy function (inclusive)"][frame] += count
    out = [f"py-spy: {total} busy samples (idle waits dropped) at {rate}/s over {requests} requests; "
           f"ms/request = samples x {per_request:.4f}", ""]
    for title, counts in tables.items():
        out += _table(title, counts, total, per_request, top)
    return "\n".join(out)


def _read_stacks(raw: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            thread, _, rest = stack.partition(";")
            frames = [f for f in rest.split(";") if f]
            stacks.append(([thread.split(": ", 1)[-1], *(frames or ["(no Python frame)"])], int(count)))
    return stacks


def _no_line(frame: str) -> str:
    """``f (pkg/mod.py:12)`` → ``f (pkg/mod.py)``: a function's samples over all its lines."""
    name, _, where = frame.rpartition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if name else frame


def _group(frame: str) -> str:
    """``func (pkg/mod.py:12)`` → ``pkg``: which library a frame's time belongs to."""
    where = frame.rpartition(" (")[2].rstrip(")")
    return where.split("/", 1)[0] if "/" in where else where.split(".py")[0]


def _table(title: str, counts: Counter[str], total: int, per_request: float, top: int) -> list[str]:
    total = total or 1
    rows = [f"| {title} | samples | share | ms/request |", "|---|---:|---:|---:|"]
    rows += [f"| `{name[:110]}` | {n} | {100 * n / total:.1f}% | {n * per_request:.3f} |"
             for name, n in counts.most_common(top)]
    return [*rows, ""]


# --- the proxy's own steps, in process ----------------------------------------------------------------------------
def steps_report(chosen: list[Workload]) -> str:
    """One row per step; per workload the best and the median of 7 timed loops, in ms per call."""
    rows = ["| step | " + " | ".join(f"{w.name} best / median" for w in chosen[:2]) + " |", "|---|---:|---:|"]
    timings = [_time_steps(w.body) for w in chosen[:2]]
    for name in timings[0]:
        rows.append(f"| {name} | " + " | ".join(f"{t[name][0]:.3f} / {t[name][1]:.3f}" for t in timings) + " |")
    return "\n".join(rows)


def _time_steps(body: bytes) -> dict[str, tuple[float, float]]:
    from ctxproxy.config import load_settings
    from ctxproxy.proxy.core import canonical_json, content_hash, fingerprint
    from ctxproxy.proxy.edge.body import parse_chat_body
    from ctxproxy.proxy.edge.chat import incoming_request
    from ctxproxy.proxy.engine.hashing import MessageHasher
    from ctxproxy.proxy.upstream.endpoint import client_headers, redact
    from ctxproxy.proxy.upstream.sse import last_usage

    parsed = parse_chat_body(body)
    messages = parsed["messages"]
    bodies = [canonical_json(m) for m in messages]
    request = _fake_request(body)
    state = SimpleNamespace(settings=load_settings(env={}), hasher=MessageHasher(), own_headers=frozenset())
    steps: dict[str, Callable[[], Any]] = {
        "orjson.loads (body)": lambda: orjson.loads(body),
        "parse_chat_body (loads + checks)": lambda: parse_chat_body(body),
        "canonical_json x messages": lambda: [canonical_json(m) for m in messages],
        "sha256 x messages": lambda: [content_hash(b) for b in bodies],
        "fingerprint": lambda: fingerprint(messages),
        "redact + client_headers": lambda: (redact(request.headers.raw), client_headers(request.headers.raw,
                                                                                         frozenset())),
        "incoming_request (hashes reused from the last request)": lambda: incoming_request(request, body, parsed,
                                                                                           state),
        "last_usage (SSE, small)": lambda: last_usage("data: {}\n\ndata: [DONE]\n\n"),
    }
    out = {name: _best_ms(fn) for name, fn in steps.items()}
    return out | _time_journal(incoming_request(request, body, parsed, state))


def _fake_request(body: bytes) -> Any:
    from starlette.requests import Request

    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
               (b"authorization", b"Bearer sk-bench"), (b"content-length", str(len(body)).encode())]
    return Request({"type": "http", "method": "POST", "path": CHAT_PATH, "query_string": b"", "headers": headers,
                    "scheme": "http", "server": ("127.0.0.1", 4141)})


def _time_journal(incoming: Any) -> dict[str, tuple[float, float]]:
    """The two journal writes of a request on a fresh file journal, and the cost of the hop to its thread."""
    from ctxproxy.store import Journal, JournalWriter, ResponseRecord

    with tempfile.TemporaryDirectory(prefix="ctxproxy-steps-") as tmp:
        journal = Journal(Path(tmp) / "journal.db")
        journal.record_request(incoming)  # first time: all message blobs are new; later ones add none
        recorded = journal.record_request(incoming)
        attempts = itertools.count()

        def respond() -> None:
            journal.record_response(ResponseRecord(recorded.request_id, next(attempts), "ok", 200, '{"usage":{}}',
                                                   {"prompt_tokens": 1}, 1.0, 2.0, "2025-01-01T00:00:00.000+00:00"))

        def repeat() -> None:  # answered, as an agent's resend comes: unanswered, each would open a parallel
            # run, and placement would compare the request with all of them (thousands in a timing loop)
            again = journal.record_request(incoming)
            journal.record_response(ResponseRecord(again.request_id, 0, "ok", 200, '{"usage":{}}',
                                                   {"prompt_tokens": 1}, 1.0, 2.0, "2025-01-01T00:00:00.000+00:00"))

        out = {"Journal.record_request + record_response (the body repeated after its answer)": _best_ms(repeat),
               "Journal.record_response": _best_ms(respond)}
        writer = JournalWriter(journal)
        out["JournalWriter.call hop (no-op)"] = _best_ms(lambda: asyncio.run(_hops(writer, 50)), per=50)
        writer.close()
    return out


async def _hops(writer: Any, n: int) -> None:
    for _ in range(n):
        await writer.call(lambda journal: None)


def _best_ms(fn: Callable[[], Any], per: int = 1) -> tuple[float, float]:
    """Best and median of 7 loops (each ~40 ms), in ms per call: allocation and VM noise shows in the gap."""
    number = max(1, timeit.Timer(fn).autorange()[0] // 5)
    runs = sorted(timeit.repeat(fn, number=number, repeat=7))
    return runs[0] / number / per * 1000, runs[3] / number / per * 1000


if __name__ == "__main__":
    sys.exit(main())
