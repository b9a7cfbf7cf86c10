"""The upstream transport: httpx's API on top of aiohttp's connection pool.

Why: on this 2-core machine httpx's own HTTP/1.1 stack (httpcore + h11, pure Python) costs about 1.1 ms per
request; aiohttp's (C parser) about a third of that (bench/latency.py, docs/benchmarks.md). The proxy keeps
httpx as its client API — requests, streaming, timeouts, and ``MockTransport``/``ASGITransport`` in tests — and
only the bytes on the wire go through aiohttp.

Faithfulness: aiohttp is told to add nothing (no default User-Agent, Accept or Accept-Encoding), keep no cookies
(one pool serves every agent) and decompress nothing (bytes are relayed as they came, with their headers).
Its exceptions become httpx's, so ``proxy.upstream.endpoint.send`` maps them to 502/504 like any other transport's.

aiohttp is imported when the first request goes out (or earlier, on the thread ``proxy.engine.state.Warmup`` starts with
the server), not when this module is: it is a third of the proxy's import time (about 0.1 s), and start to ready
does not wait for it (issue #13).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    import aiohttp

__all__ = ["AiohttpTransport"]

_NO_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


def _as_httpx_error(exc: Exception, request: httpx.Request) -> httpx.TransportError:
    """The httpx exception for an aiohttp (or asyncio) failure; the most specific kind wins."""
    import aiohttp

    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(str(exc) or "connect timeout", request=request)
    if isinstance(exc, aiohttp.ServerTimeoutError | TimeoutError):
        return httpx.ReadTimeout(str(exc) or "read timeout", request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(str(exc), request=request)
    if isinstance(exc, aiohttp.ClientPayloadError):
        return httpx.ReadError(str(exc), request=request)
    return httpx.RemoteProtocolError(str(exc) or type(exc).__name__, request=request)


class _Body(httpx.AsyncByteStream):
    """The response body as it arrives, chunk by chunk, with aiohttp's errors translated."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response, self._request = response, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        import aiohttp

        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _as_httpx_error(exc, self._request) from exc

    async def aclose(self) -> None:
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An ``httpx.AsyncBaseTransport`` whose connections are aiohttp's. Used inside one running loop: its session
    (the pool) is made there by the first request."""

    def __init__(self, max_connections: int = 0, keepalive_seconds: float = 60.0) -> None:
        self._limits = (max_connections, keepalive_seconds)
        self._session: aiohttp.ClientSession | None = None
        self._errors: tuple[type[Exception], ...] = (TimeoutError,)

    def _pool(self) -> aiohttp.ClientSession:
        if self._session is None:
            import aiohttp

            connector = aiohttp.TCPConnector(limit=self._limits[0], keepalive_timeout=self._limits[1])
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                                  cookie_jar=aiohttp.DummyCookieJar(),
                                                  skip_auto_headers=_NO_AUTO_HEADERS)
            self._errors = (TimeoutError, aiohttp.ClientError)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        for attempt in range(2):
            try:
                response = await self._send(request)
            except self._errors as exc:
                if attempt == 0 and _replayable(request) and _dropped_unanswered(exc):
                    continue
                raise _as_httpx_error(exc, request) from exc
            return httpx.Response(response.status, headers=response.raw_headers, stream=_Body(response, request),
                                  request=request, extensions={"reason_phrase": (response.reason or "").encode()})
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _send(self, request: httpx.Request) -> aiohttp.ClientResponse:
        import aiohttp

        timeout: dict[str, Any] = request.extensions.get("timeout", {})
        return await self._pool().request(
            request.method, str(request.url), headers=request.headers.multi_items(), data=await _body_of(request),
            allow_redirects=False, compress=None, auto_decompress=False,
            timeout=aiohttp.ClientTimeout(sock_connect=timeout.get("connect"), sock_read=timeout.get("read"),
                                          connect=timeout.get("pool")))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _replayable(request: httpx.Request) -> bool:
    """Whether ``request`` may be sent a second time, on a new connection, when the upstream closed the connection
    before answering. aiohttp does this by itself for idempotent methods only (RFC 9112 §9.3.1); a POST to
    ``/chat/completions`` (or Anthropic's ``/messages``) qualifies too, as its only effect is its answer. Why it
    matters: a pooled keep-alive connection the upstream closes for idleness (uvicorn, vLLM, llama.cpp: after 5 s)
    at the moment the proxy reuses it fails without a byte of answer; under load (bench/load.py) one request in
    about 1,500 met this as a 502."""
    return request.method == "POST" and request.url.path.endswith(("/chat/completions", "/messages"))


def _dropped_unanswered(exc: BaseException) -> bool:
    """The upstream closed or reset the connection before any answer (not: could not connect, timed out)."""
    import aiohttp

    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ServerTimeoutError | TimeoutError):
        return False
    return isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError)


async def _body_of(request: httpx.Request) -> bytes | None:
    body = await request.aread()
    return body or None
