"""Where a small new-text request's added latency goes: a real server's stages, each timed from the request's arrival.

Why: ``latency.py`` gives the added latency of the peers' small request (a new run of an opening hundreds of runs
share, three messages), and a profile of it is flat: no function above a quarter. What a profile cannot say is
the order and the span of the request's stages on the way to its answer, which is what a change must shorten.
This runs ``ctxproxy serve``'s app under uvicorn as the CLI does (``--serve``, its own process, in front of
``fake_upstream.py``) with ``STAGES`` wrapped: per request, when each began and how long it took, from the moment
the chat route got the request (``serve_directly``) to the answer's last byte handed to the server. The driver
replays the conversation, then sends the new-text requests one at a time, as ``latency_peers`` does, stops the
server and prints the medians. The wrappers cost ~0.3 µs a stage.

Run: ``.venv/bin/python bench/stages.py --requests 2000 [--conversation PEERS/conversation-60.json]``
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

STAGES = (
    ("ctxproxy.proxy.edge.chat", "read_chat_body", "body read"),
    ("ctxproxy.proxy.edge.chat", "_admit", "parsed, validated, hashed"),
    ("ctxproxy.store.sql", "SqliteConnection.begin_if_free", "journal: transaction begun"),
    ("ctxproxy.store.placement", "PlacementMixin._place", "journal: placed"),
    ("ctxproxy.store.journal", "Journal.record_request", "journal: request written"),
    ("ctxproxy.store.sql", "SqliteConnection._end", "journal: committed"),
    ("ctxproxy.proxy.engine.exchange", "Exchange.load_context", "session's context loaded"),
    ("ctxproxy.proxy.engine.forward", "plan_forward", "forward planned"),
    ("ctxproxy.proxy.engine.forward", "Forwarder._open", "upstream: headers back"),
    ("ctxproxy.proxy.engine.buffered", "read_whole", "upstream: answer read"),
    ("ctxproxy.store.journal", "Journal._insert_response", "journal: answer written"),
)
"""(module, attribute, label) of each stage timed; a dotted attribute is a class's method. A stage met twice in a
request (the commits) is told as its first, second... (``journal: committed #2``)."""

SENT = "answer sent"


class Timeline:
    """Per request, each stage's (start, end) in µs after the route was called."""

    def __init__(self) -> None:
        self.requests: list[dict[str, tuple[float, float]]] = []
        self._start: int | None = None

    def arrived(self) -> None:
        self._start = time.perf_counter_ns()
        self.requests.append({})

    def span(self, label: str, began: int) -> None:
        if self._start is None:
            return
        stages = self.requests[-1]
        n = sum(1 for key in stages if key == label or key.startswith(label + " #"))
        stages[label if n == 0 else f"{label} #{n + 1}"] = ((began - self._start) / 1e3,
                                                              (time.perf_counter_ns() - self._start) / 1e3)


def medians(requests: list[dict[str, tuple[float, float]]]) -> list[dict[str, Any]]:
    """Each stage's median start and median span, in order of the median start, with how many requests met it."""
    labels = {label for stages in requests for label in stages}
    rows = [{"stage": label, "requests": len(spans), "starts_us": statistics.median(s for s, _ in spans),
             "takes_us": statistics.median(e - s for s, e in spans)}
            for label in labels for spans in [[r[label] for r in requests if label in r]]]
    return sorted(rows, key=lambda row: row["starts_us"])


def _wrap(owner: Any, name: str, label: str, timeline: Timeline) -> None:
    function = inspect.getattr_static(owner, name)
    if inspect.iscoroutinefunction(function):
        @functools.wraps(function)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter_ns()
            try:
                return await function(*args, **kwargs)
            finally:
                timeline.span(label, began)
        setattr(owner, name, timed_async)
        return

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            timeline.span(label, began)
    setattr(owner, name, timed)


def instrument(timeline: Timeline, stages: tuple[tuple[str, str, str], ...] = STAGES) -> None:
    """``stages`` wrapped, and the chat route's arrival and last byte marked. (The journal's calls are passed to
    its writer by identity, ``store.writer._HERE``: only functions they call are wrapped, never those.)"""
    for module, attribute, label in stages:
        owner: Any = importlib.import_module(module)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        _wrap(owner, name, label, timeline)
    from ctxproxy.proxy.edge import direct
    serve = direct.serve_directly

    async def marked(endpoint: Any, handlers: Any, scope: Any, receive: Any, send: Any) -> None:
        timeline.arrived()
        began = time.perf_counter_ns()

        async def sending(message: dict[str, Any]) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                timeline.span(SENT, began)
        await serve(endpoint, handlers, scope, receive, sending)
    direct.serve_directly = marked


def serve(upstream: str, port: int, data_dir: Path, more: list[str]) -> None:
    """The proxy as ``ctxproxy serve`` runs it, instrumented; ``GET /stages`` gives its timeline so far."""
    import uvicorn

    from ctxproxy.config import load_settings
    from ctxproxy.proxy.edge.app import create_app
    from ctxproxy.proxy.edge.serving import uvicorn_options
    from ctxproxy.proxy.engine.state import one_malloc_arena
    from ctxproxy.proxy.observe.logs import configure_logging

    timeline = Timeline()
    instrument(timeline, STAGES + tuple(_stage(text) for text in more))
    one_malloc_arena()
    settings = load_settings(env={"CTXPROXY_UPSTREAM": upstream, "CTXPROXY_DATA_DIR": str(data_dir)})
    configure_logging(settings)  # each request's log line, as the CLI's server writes it
    uvicorn.run(_with_timeline(create_app(settings), timeline), host="127.0.0.1", port=port, log_level="warning",
                **uvicorn_options(settings))


def _stage(text: str) -> tuple[str, str, str]:
    """``module:attribute`` (``--stage``), labelled by its attribute."""
    module, _, attribute = text.partition(":")
    return module, attribute, attribute


def _with_timeline(app: Any, timeline: Timeline) -> Any:
    """``app``, and ``GET /stages``: the timeline as JSON (uvicorn ends the process by the signal that stopped it,
    so nothing is written on the way out)."""
    async def served(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/stages":
            await app(scope, receive, send)
            return
        body = json.dumps(timeline.requests).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
    return served


def drive(conversation: dict[str, Any], requests: int, tmp: Path,
          more: list[str]) -> list[dict[str, tuple[float, float]]]:
    """The fake upstream and the instrumented proxy; the replay, then ``requests`` small new-text requests; the
    timeline of those."""
    import httpx
    import latency
    import latency_peers

    fake, port = latency.free_port(), latency.free_port()
    upstream = latency._spawn([sys.executable, str(BENCH / "fake_upstream.py"), "--port", str(fake)],
                              tmp / "fake.log", latency._proxy_environ([]))
    proxy = None
    try:
        latency._wait_ready(upstream, f"http://127.0.0.1:{fake}/v1/models", tmp / "fake.log")
        proxy = latency._spawn([sys.executable, __file__, "--serve", f"http://127.0.0.1:{fake}/v1", "--port",
                                str(port), "--data-dir", str(tmp / "data"),
                                *(f"--stage={stage}" for stage in more)], tmp / "proxy.log",
                               latency._proxy_environ([]))
        latency._wait_ready(proxy, f"http://127.0.0.1:{port}/healthz", tmp / "proxy.log")
        latency_peers.replay(f"http://127.0.0.1:{port}", conversation)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            for i in range(requests):
                latency_peers._post(client, latency_peers.nonce_body(conversation, "small", i))
            timeline: list[dict[str, tuple[float, float]]] = client.get("/stages").json()
    finally:
        for process in (proxy, upstream):
            if process is not None:
                latency._stop(process)
    return timeline[-requests:] if requests else []


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| stage (ends) | requests | starts, median (µs) | takes, median (µs) |", "|---|---:|---:|---:|"]
    lines += [f"| {r['stage']} | {r['requests']} | {r['starts_us']:.0f} | {r['takes_us']:.0f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="timed new-text requests (2000)")
    parser.add_argument("--conversation", type=Path, help="the replayed history, e.g. PEERS/conversation-60.json "
                        "(default: generated by tests/workloads.py)")
    parser.add_argument("--stage", action="append", default=[], metavar="MODULE:ATTRIBUTE",
                        help="also time this function (a dotted attribute: a class's method), as where it is called "
                        "looks it up, e.g. ctxproxy.proxy.engine.buffered:parse_completion")
    parser.add_argument("--serve", metavar="UPSTREAM", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port, args.data_dir, args.stage)
        return 0
    from tests.workloads import conversation as generated
    conversation = json.loads(args.conversation.read_text()) if args.conversation else generated(rounds=60)
    with tempfile.TemporaryDirectory(prefix="ctxproxy-stages-") as tmp:
        timeline = drive(conversation, args.requests, Path(tmp), args.stage)
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(markdown(medians(timeline)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
