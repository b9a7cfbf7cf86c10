"""The upstream client's own CPU per request, with many requests in flight: ctxproxy's transport against another's.

Why: ``bench/latency.py`` measures one request at a time through the whole proxy; under load what counts is the
CPU each request costs the proxy's one event loop. Here ``Upstream.send`` (the proxy's own path: httpx's request
and response objects, the transport under them) runs in this process against ``bench/fake_upstream.py`` (its own
process), ``--workers`` tasks at once, each sending ``--requests`` requests and reading every answer to the end;
the CPU time of this process per request is the client's alone. ``--baseline SRC`` times the transport of another
source tree the same way, in the same run (``AiohttpTransport`` before issue #13, ``Http1Transport`` after), three
rounds each, interleaved.

Run: ``.venv/bin/python bench/client_cpu.py --baseline BEFORE`` (a ``git archive`` of an earlier commit)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from latency import free_port

from ctxproxy.proxy.upstream.endpoint import Upstream
from ctxproxy.proxy.upstream.transport import Http1Transport

Make = Callable[[], httpx.AsyncBaseTransport]
BODIES = {
    "small": b'{"model":"fake-model","messages":[{"role":"user","content":"hi"}]}',
    "small, streamed": b'{"model":"fake-model","stream":true,"messages":[{"role":"user","content":"hi"}]}',
    "200 KB": b'{"model":"fake-model","messages":[{"role":"user","content":"' + b"x" * 200_000 + b'"}]}',
}
HEADERS = [(b"content-type", b"application/json"), (b"accept-encoding", b"identity")]


def baseline_transport(src: Path) -> Make:
    """The transport class of the tree under ``src`` (the first ``*Transport`` its transport module exports)."""
    spec = importlib.util.spec_from_file_location("baseline_transport", src / "proxy" / "upstream" / "transport.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, next(name for name in module.__all__ if name.endswith("Transport")))  # type: ignore[no-any-return]


async def _worker(upstream: Upstream, requests: int, body: bytes) -> None:
    for _ in range(requests):
        answer = await upstream.send("POST", "/v1/chat/completions", "", HEADERS, body)
        async for _ in answer.aiter_raw():
            pass
        await answer.aclose()


async def cpu_per_request(url: str, make: Make, workers: int, requests: int, body: bytes) -> float:
    """µs of this process's CPU per request, after a warm-up round."""
    upstream = Upstream(url, make(), 30.0, 30.0)
    await asyncio.gather(*(_worker(upstream, 3, body) for _ in range(workers)))
    started = time.process_time()
    await asyncio.gather(*(_worker(upstream, requests, body) for _ in range(workers)))
    spent = time.process_time() - started
    await upstream.aclose()
    return spent / (workers * requests) * 1e6


async def measure(url: str, makes: dict[str, Make], workers: int, requests: int) -> None:
    print(f"| request ({workers} in flight) | " + " | ".join(f"{name} µs CPU" for name in makes) + " |")
    print("|---|" + "---:|" * len(makes))
    for kind, body in BODIES.items():
        runs: dict[str, list[float]] = {name: [] for name in makes}
        for _ in range(3):
            for name, make in makes.items():
                runs[name].append(await cpu_per_request(url, make, workers, requests, body))
        print(f"| {kind} | " + " | ".join(" / ".join(f"{x:.0f}" for x in runs[name]) for name in makes) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=100, help="requests in flight (100)")
    parser.add_argument("--requests", type=int, default=30, help="requests per worker and round (30)")
    parser.add_argument("--baseline", type=Path, metavar="SRC", help="also time the transport of the tree SRC")
    args = parser.parse_args()
    makes: dict[str, Make] = {"this tree": Http1Transport}
    if args.baseline:
        makes["baseline"] = baseline_transport(args.baseline)
    port = free_port()
    fake = subprocess.Popen([sys.executable, str(Path(__file__).parent / "fake_upstream.py"), "--port", str(port)])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        uvloop.run(measure(f"http://127.0.0.1:{port}/v1", makes, args.workers, args.requests))
    finally:
        fake.terminate()
        fake.wait()


if __name__ == "__main__":
    main()
