"""The upstream transport: httpx's transport API on the proxy's own HTTP/1.1 client (asyncio + httptools).

Why: the proxy keeps httpx as its client API — requests, streaming responses, timeouts, and ``MockTransport`` /
``ASGITransport`` in tests — but not httpx's own wire (httpcore + h11, pure Python: ~1.1 ms a request on this
2-core machine) nor aiohttp's (~0.4 ms more than a hand-written client per request, and ~7 MB of the idle
process: its modules and two TLS contexts built at start). Under this class a request is one ``write`` of bytes
built here and its answer is parsed by httptools, the C parser uvicorn already uses (docs/benchmarks.md, "Where
the time goes"). ``proxy.upstream.connection`` is one connection, ``proxy.upstream.pool`` the keep-alive pool.

Faithful, as a proxy must be: the request's headers go out as given, in their order and case (``Host`` is added
only if missing; a body is always sent whole with its ``Content-Length``); nothing else is added (no User-Agent,
Accept, Accept-Encoding), no cookie is kept, no redirect followed, and the answer's bytes are relayed as they
came (nothing decompressed, headers untouched), chunk by chunk as they arrive (an SSE stream is not buffered).

Timeouts come from the request's httpx ``timeout`` extension: ``connect`` (TCP and TLS), ``read`` (between two
bytes of the answer) and ``pool`` (waiting for a free connection at the limit); ``write`` is not applied (the
request is handed to the kernel whole: an upstream that does not read it does not answer either, which the read
timeout catches). Failures are httpx's exceptions, which ``proxy.upstream.endpoint`` maps to 502 and 504.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable

import httpx

from ctxproxy.proxy.upstream.connection import Answer, Connection, Stage, Unanswered
from ctxproxy.proxy.upstream.pool import Origin, Pool

__all__ = ["Http1Transport"]

_DEFAULT_PORTS = {"http": 80, "https": 443}
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
"""RFC 9110 §9.2.2."""
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
"""Methods whose request carries ``Content-Length: 0`` when its body is empty (as httpx sets it)."""


class Http1Transport(httpx.AsyncBaseTransport):
    """An ``httpx.AsyncBaseTransport`` on the proxy's own connections. Used inside one running loop.

    ``max_connections``: at most this many connections at once (0: no limit); ``keepalive_seconds``: how long an
    idle one is kept; ``tls``: builds the context ``https`` connections verify with, on the first of them (by
    default the system's CAs, hostnames checked).
    """

    def __init__(self, max_connections: int = 0, keepalive_seconds: float = 60.0,
                 tls: Callable[[], ssl.SSLContext] = ssl.create_default_context) -> None:
        self.pool = Pool(max_connections, keepalive_seconds, tls)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        head, body, close_after = await _serialised(request)
        timeout: dict[str, float | None] = request.extensions.get("timeout", {})
        origin = _origin(request.url)
        connection = await self.pool.acquire(origin, timeout, request)
        try:
            answer = await self._exchange(connection, request, (head, body, close_after), timeout)
        except Unanswered:
            if connection.exchanges < 2 or not _replayable(request):
                raise
            connection = await self.pool.acquire(origin, timeout, request, fresh=True)
            answer = await self._exchange(connection, request, (head, body, close_after), timeout)
        return self._response(request, connection, answer, timeout.get("read"))

    async def _exchange(self, connection: Connection, request: httpx.Request, wire: tuple[bytes, bytes, bool],
                        timeout: dict[str, float | None]) -> Answer:
        """Send ``request`` on ``connection``; its answer once the head is in. Any failure (a cancelled request
        too: the client went away) closes the connection."""
        try:
            connection.send(request, *wire)
            return await connection.head(timeout.get("read"))
        except BaseException:
            self.pool.discard(connection)
            raise

    def _response(self, request: httpx.Request, connection: Connection, answer: Answer,
                  read_timeout: float | None) -> httpx.Response:
        stream: httpx.AsyncByteStream
        if answer.stage is Stage.DONE:  # the whole answer came with its head: the connection is free at once
            stream = httpx.ByteStream(connection.take() if answer.chunks else b"")
            self.pool.release(connection)
        else:
            stream = _Body(self.pool, connection, read_timeout)
        return httpx.Response(answer.status, headers=answer.headers, stream=stream, request=request,
                              extensions={"http_version": answer.version, "reason_phrase": answer.reason})

    async def aclose(self) -> None:
        await self.pool.aclose()


class _Body(httpx.AsyncByteStream):
    """The answer's body as it arrives; its connection goes back to the pool when it is closed (reused only if
    the body was read to the end)."""

    def __init__(self, pool: Pool, connection: Connection, timeout: float | None) -> None:
        self._pool, self._timeout = pool, timeout
        self._connection: Connection | None = connection

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self._connection
        if connection is None:
            return
        try:
            while chunk := await connection.read(self._timeout):
                yield chunk
        finally:  # the end, or a failure: either way the connection's exchange is over
            await self.aclose()

    async def aclose(self) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            self._pool.release(connection)


async def _serialised(request: httpx.Request) -> tuple[bytes, bytes, bool]:
    """``request`` as it goes on the wire: its head, its body, and whether it asks to close the connection after."""
    # Read whole, a streamed body too (sent with its length: no chunked request). A ``ByteStream`` (what
    # ``Upstream.send`` builds) is read by iterating it: ``aread`` would make an async generator, which asyncio
    # registers and tracks (~2 µs).
    body = request.read() if isinstance(request.stream, httpx.ByteStream) else await request.aread()
    method = request.method.encode("ascii")
    lines = [method + b" " + request.url.raw_path + b" HTTP/1.1"]
    host = length = close = False
    for name, value in request.headers.raw:
        lower = name.lower()
        if lower == b"transfer-encoding":
            continue
        host |= lower == b"host"
        length |= lower == b"content-length"
        close |= lower == b"connection" and b"close" in value.lower()
        lines.append(name + b": " + value)
    if not host:
        lines.insert(1, b"Host: " + request.url.netloc)
    if not length and (body or request.method in _BODY_METHODS):
        lines.append(b"Content-Length: " + str(len(body)).encode("ascii"))
    head = b"\r\n".join(lines) + b"\r\n\r\n"
    if head.count(b"\n") != len(lines) + 1 or head.count(b"\r") != len(lines) + 1:
        raise httpx.LocalProtocolError("a header name or value holds a line break", request=request)
    return head, body, close


def _origin(url: httpx.URL) -> Origin:
    if url.scheme not in _DEFAULT_PORTS:
        raise httpx.UnsupportedProtocol(f"the upstream URL must be http:// or https://, not {url.scheme}://")
    return url.scheme, url.host, url.port or _DEFAULT_PORTS[url.scheme]


def _replayable(request: httpx.Request) -> bool:
    """Whether ``request`` may be sent a second time, on a new connection, when the upstream closed a reused
    connection before answering. RFC 9112 §9.3.1 allows it for idempotent methods (aiohttp, the client before,
    did it for those); a POST to ``/chat/completions`` (or Anthropic's ``/messages``) qualifies too, as its only
    effect is its answer. Why it
    matters: a pooled keep-alive connection the upstream closes for idleness (uvicorn, vLLM, llama.cpp: after 5 s)
    at the moment the proxy reuses it fails without a byte of answer; under load (bench/load.py) one request in
    about 1,500 met this as a 502. Never for a new connection, a timeout, or after any byte of an answer."""
    if request.method in _IDEMPOTENT:
        return True
    return request.method == "POST" and request.url.path.endswith(("/chat/completions", "/messages"))
