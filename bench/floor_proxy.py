"""The floor under ctxproxy's added latency: the cheapest Python proxy hops, measured by ``bench/latency.py``.

Why: to tell the proxy's own cost from the cost of being a Python HTTP hop at all, and to compare upstream
clients. Each mode reads the whole request body and forwards it to ``<upstream>/chat/completions``, then returns
the answer whole; no parsing, no journal, no headers beyond ``content-type``:

- ``raw``: pure ASGI + a minimal keep-alive HTTP/1.1 client on asyncio streams with the ``httptools`` parser;
- ``httpx``: pure ASGI + one ``httpx.AsyncClient`` (httpx on its own HTTP/1.1 stack);
- ``fastapi``: a FastAPI route + ``httpx.AsyncClient`` (the stack ctxproxy started from);
- ``aiohttp``: pure ASGI + one ``aiohttp.ClientSession`` (the wire ctxproxy used under httpx until issue #13);
- ``own``: pure ASGI + ctxproxy's own client (``proxy.upstream.transport.Http1Transport``, asyncio + httptools)
  under httpx's ``Request``/``Response``, as ctxproxy's ``Upstream.send`` drives it.

Run through the benchmark: ``.venv/bin/python bench/latency.py --proxy floor-httpx --markdown``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
import httpx
import uvicorn
from fake_upstream import Receive, Scope, Send, lifespan, read_body, send_bytes
from fastapi import FastAPI, Request, Response

Forward = Callable[[bytes], Awaitable[tuple[int, bytes]]]
MODES = ("raw", "httpx", "fastapi", "aiohttp", "own")


class RawClient:
    """One keep-alive connection, one request at a time (the benchmark's client is sequential)."""

    def __init__(self, host: str, port: int, path: str) -> None:
        self.host, self.port, self.path = host, port, path
        self.lock = asyncio.Lock()
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, body: bytes) -> tuple[int, bytes]:
        async with self.lock:
            if self.streams is None:
                self.streams = await asyncio.open_connection(self.host, self.port)
            reader, writer = self.streams
            writer.write(f"POST {self.path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: "
                         f"application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
            return await _read_response(reader)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    parts: list[bytes] = []
    done: list[bool] = []

    class Events:
        def on_body(self, chunk: bytes) -> None:
            parts.append(chunk)

        def on_message_complete(self) -> None:
            done.append(True)

    parser = httptools.HttpResponseParser(Events())
    while not done:
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("upstream closed the connection")
        parser.feed_data(data)
    return parser.get_status_code(), b"".join(parts)


def _forwarder(mode: str, upstream: str) -> tuple[Forward, Callable[[], Awaitable[None]]]:
    """The function that forwards a body, and the one that closes its client."""
    url = httpx.URL(upstream + "/chat/completions")
    if mode == "raw":
        raw = RawClient(url.host, url.port or 80, url.raw_path.decode())
        return raw.post, _nothing
    if mode == "own":
        return _own_client(url)
    if mode == "aiohttp":
        import aiohttp

        session: dict[str, Any] = {}

        async def post_aiohttp(body: bytes) -> tuple[int, bytes]:
            client = session.setdefault("client", aiohttp.ClientSession())
            async with client.post(str(url), data=body, headers={"content-type": "application/json"}) as r:
                return r.status, await r.read()

        return post_aiohttp, lambda: session["client"].close() if session else _nothing()
    client = httpx.AsyncClient(timeout=30.0)

    async def post_httpx(body: bytes) -> tuple[int, bytes]:
        r = await client.post(url, content=body, headers={"content-type": "application/json"})
        return r.status_code, r.content

    return post_httpx, client.aclose


def _own_client(url: httpx.URL) -> tuple[Forward, Callable[[], Awaitable[None]]]:
    """ctxproxy's upstream transport, imported from the tree on PYTHONPATH (or the installed one)."""
    from ctxproxy.proxy.upstream.transport import Http1Transport

    transport = Http1Transport()
    timeout = {"connect": 30.0, "read": 30.0, "write": 30.0, "pool": 30.0}

    async def post_own(body: bytes) -> tuple[int, bytes]:
        request = httpx.Request("POST", url, headers=[(b"content-type", b"application/json")], content=body,
                                extensions={"timeout": timeout})
        response = await transport.handle_async_request(request)
        try:
            return response.status_code, await response.aread()
        finally:
            await response.aclose()

    return post_own, transport.aclose


async def _nothing() -> None:
    return None


def asgi_app(forward: Forward, close: Callable[[], Awaitable[None]]) -> Callable[[Scope, Receive, Send],
                                                                                 Awaitable[None]]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            await close()
            return
        body = await read_body(receive)
        if scope["path"] == "/healthz":
            await send_bytes(send, 200, b'{"status":"ok"}')
            return
        status, content = await forward(body)
        await send_bytes(send, status, content)

    return app


def fastapi_app(forward: Forward) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    async def chat(request: Request) -> Response:
        status, content = await forward(await request.body())
        return Response(content, status, media_type="application/json")

    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/healthz", healthz, methods=["GET"])
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--upstream", required=True, help="base URL with /v1, on 127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    forward, close = _forwarder(args.mode, args.upstream)
    app = fastapi_app(forward) if args.mode == "fastapi" else asgi_app(forward, close)
    uvicorn.run(app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools", access_log=False,
                log_level="warning", server_header=False, date_header=False)


if __name__ == "__main__":
    main()
