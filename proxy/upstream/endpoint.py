"""Talking to the upstream: URLs, which headers cross the proxy, and transport failures as our errors.

Headers we do not own pass both ways untouched (the client's ``Authorization`` included). Dropped: hop-by-hop
headers (RFC 9110 §7.6.1), ``Host`` and ``Content-Length`` (recomputed), and our own (the session header and
``X-Ctx-*``). On the chat route ``Accept-Encoding`` is dropped too, so the answer arrives as plain bytes the proxy
can read for ``usage`` while relaying it (``Accept-Encoding: identity`` is sent instead).
"""

from __future__ import annotations

from collections.abc import Iterable

import httpx
from starlette.responses import Response

from ctxproxy.proxy.errors import UpstreamBrokeOff, UpstreamTimeout, UpstreamUnreachable
from ctxproxy.proxy.upstream.loop import new_instance, onward

__all__ = [
    "HARMLESS", "HARMLESS_PREFIXES", "HOP_BY_HOP", "Upstream", "client_headers", "redact", "response_headers",
    "upstream_url", "with_headers",
]

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})
_SERVER_OWN = frozenset({"date", "server"})
"""Response headers the proxy's own server (uvicorn) writes: the upstream's copies would make each appear twice."""
HARMLESS = frozenset({
    "accept", "accept-encoding", "accept-language", "anthropic-beta", "anthropic-version", "cache-control",
    "connection", "content-length", "content-type", "host", "openai-beta", "user-agent", "x-ctx-incognito",
    "x-request-id",
})
"""Headers journaled with their values: known to say how a client talks, never who it is. Any other header is
journaled by name only (an allowlist: a credential in ``OpenAI-Organization`` or ``X-Custom-Credential`` has no
telltale part in its name)."""
HARMLESS_PREFIXES = ("x-stainless-",)
"""The OpenAI and Anthropic SDKs' platform headers (``x-stainless-lang``, ``-os``, ``-retry-count`` …)."""


_URLS_KEPT = 64
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
"""Distinct (path, query) pairs whose parsed URL is kept; a client varying its query string gets it parsed."""


def upstream_url(base: str, client_path: str, query: str = "") -> str:
    """``/v1/chat/completions`` on the proxy → ``<base>/chat/completions`` (the base carries its own ``/v1``)."""
    suffix = client_path[3:] if client_path.startswith("/v1") else client_path
    return base + suffix + (f"?{query}" if query else "")


def client_headers(headers: Iterable[tuple[bytes, bytes]], own: frozenset[str],
                   drop: frozenset[str] = frozenset()) -> list[tuple[bytes, bytes]]:
    """The client's raw headers minus hop-by-hop, ours (``own``, lower case) and ``drop``; order kept."""
    out = []
    for name, value in headers:
        lower = name.decode("latin-1").lower()
        if lower in HOP_BY_HOP or lower in own or lower in drop or lower.startswith("x-ctx-"):
            continue
        out.append((name, value))
    return out


def response_headers(upstream: httpx.Response) -> list[tuple[bytes, bytes]]:
    """The upstream's response headers minus hop-by-hop ones, repeated headers (Set-Cookie) kept apart."""
    return [(k, v) for k, v in upstream.headers.raw
            if k.decode("latin-1").lower() not in HOP_BY_HOP and k.decode("latin-1").lower() not in _SERVER_OWN]


def with_headers(response: Response, headers: list[tuple[bytes, bytes]]) -> Response:
    """``response`` carrying the upstream's headers too; where both set one (Content-Type), the upstream's wins."""
    theirs = [(k.lower(), v) for k, v in headers]
    names = {k for k, _ in theirs}
    response.raw_headers = [(k, v) for k, v in response.raw_headers if k not in names] + theirs
    return response


def redact(headers: Iterable[tuple[bytes, bytes]], keep: frozenset[str] = frozenset()) -> dict[str, str | None]:
    """Headers as journaled: ``HARMLESS`` ones and ``keep`` (lower case: the session header) with their values,
    every other one by name only; a value is read as UTF-8 where it is (a session id), else as latin-1."""
    out: dict[str, str | None] = {}
    for name, value in headers:
        lower = name.decode("latin-1").lower()
        harmless = lower in HARMLESS or lower in keep or lower.startswith(HARMLESS_PREFIXES)
        out[lower] = _text(value) if harmless else None
    return out


def _text(value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


class Upstream:
    """The upstream endpoint: its base URL and the one transport (connection pool) every request shares.

    Requests go straight to the transport. httpx's client layer (cookies, auth, redirects, default headers) has
    nothing to do for a proxy — it must not follow redirects, add headers or keep cookies — and costs ~0.25 ms.
    """

    def __init__(self, base: str, transport: httpx.AsyncBaseTransport, connect: float, read: float) -> None:
        self.base, self.transport = base, transport
        self.instance = new_instance()
        """This proxy's id in the ``X-Ctx-Via`` chain of every request it sends (``proxy.upstream.loop``)."""
        self._timeout = {"connect": connect, "read": read, "write": read, "pool": connect}
        self._urls: dict[tuple[str, str], tuple[httpx.URL, bytes]] = {}
        """Parsed upstream URLs and their ``Host`` by (client path, query): parsing one costs ~30 µs a request, and
        they repeat."""

    async def send(self, method: str, path: str, query: str, headers: list[tuple[bytes, bytes]],
                   body: bytes, via: str = "") -> httpx.Response:
        """Send; the answer's body streams. Transport failures become 502/504 with a reason and a next step.
        ``via``: the ``X-Ctx-Via`` chain the client's request came with (this instance is added to it)."""
        request = self._request(method, path, query, [*headers, onward(via, self.instance)], body)
        try:
            return await self.transport.handle_async_request(request)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"The upstream at {request.url} did not answer in time ({type(exc).__name__}). "
                                  "Raise upstream_timeout if the model is slow to start.") from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise UpstreamBrokeOff(f"The upstream at {request.url} closed the connection without answering: "
                                   f"{exc or type(exc).__name__}. See the model server's log.") from None
        except httpx.TransportError as exc:
            raise UpstreamUnreachable(f"Cannot reach the upstream at {request.url}: {exc or type(exc).__name__}. "
                                      "Check that the model server is running and --upstream is right.") from None

    def _request(self, method: str, path: str, query: str, headers: list[tuple[bytes, bytes]],
                 body: bytes) -> httpx.Request:
        """The request, with the headers httpx's ``content=`` would add (``Host`` first, ``Content-Length`` last,
        ``0`` only for the methods that carry a body), built from ``stream=``: the ``content=`` path normalises
        every header twice (~8 µs a request)."""
        url, host = self._url(path, query)
        length = [(b"Content-Length", str(len(body)).encode())] if body or method in _BODY_METHODS else []
        return httpx.Request(method, url, headers=[(b"Host", host), *headers, *length],
                             stream=httpx.ByteStream(body), extensions={"timeout": self._timeout})

    def _url(self, path: str, query: str) -> tuple[httpx.URL, bytes]:
        known = self._urls.get((path, query))
        if known is None:
            url = httpx.URL(upstream_url(self.base, path, query))
            known = url, url.netloc
            if len(self._urls) < _URLS_KEPT:
                self._urls[(path, query)] = known
        return known

    async def aclose(self) -> None:
        await self.transport.aclose()
