"""Every ``/v1/*`` route the proxy does not rewrite (models, embeddings, completions…): relayed as it is.

Its own module, imported by the warm-up thread (``proxy.edge.app.WARM``) or by its first request: it is built on
the upstream client (httpx), which a server's start does not import (issue #13: start to ready).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ctxproxy.proxy.edge.body import read_body
from ctxproxy.proxy.engine.responses import FinallyResponse
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.proxy.errors import log
from ctxproxy.proxy.upstream.endpoint import client_headers, response_headers, with_headers
from ctxproxy.proxy.upstream.loop import VIA_HEADER, refuse_loop

__all__ = ["passthrough"]


async def passthrough(request: Request) -> Response:
    """Every other ``/v1/*`` route (models, embeddings, completions, responses…): relayed as it is."""
    state: AppState = request.app.state.ctx
    refuse_loop(request.headers, state.upstream.instance)
    body = await read_body(request, state.settings.max_body_bytes, state.settings.client_body_timeout)
    path = request.scope.get("raw_path", b"").decode("latin-1") or request.url.path  # keep %2F as the client sent it
    upstream = await state.upstream.send(request.method, path, request.url.query,
                                         client_headers(request.headers.raw, state.own_headers), body,
                                         via=request.headers.get(VIA_HEADER, ""))
    inner = StreamingResponse(_relayed(upstream), upstream.status_code)
    return FinallyResponse(with_headers(inner, response_headers(upstream)), upstream.aclose)


async def _relayed(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The upstream's bytes as they come; a body that breaks off ends the relay (the status is already sent)."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.TransportError as exc:
        log.warning("upstream answer to a passthrough request broke off: %s", exc or type(exc).__name__)
