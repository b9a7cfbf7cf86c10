"""The ASGI app: ``create_app(settings)`` wires routes, error rendering and the lifespan.

The lifespan owns the one ``httpx.AsyncClient`` and the journals (starlette's lifespan pattern); nothing is built
at import time. ``upstream_transport`` lets in-process tests put an ``httpx.MockTransport`` where the network is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from config import Settings
from proxy import __version__
from proxy.admin import router as admin_router
from proxy.chat import chat_completions
from proxy.edge import read_body
from proxy.errors import BadRequest, CtxError, render_ctx_error, render_http_error, render_unexpected
from proxy.responses import FinallyResponse
from proxy.state import AppState
from proxy.upstream import client_headers, response_headers, send, upstream_url
from store import Journal, JournalWriter

__all__ = ["create_app"]


def create_app(settings: Settings, upstream_transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    app = FastAPI(title="ctxproxy", version=__version__, lifespan=_lifespan(settings, upstream_transport),
                  docs_url=None, redoc_url=None, openapi_url="/ctx/openapi.json")
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], include_in_schema=False)
    app.add_api_route("/v1/{path:path}", passthrough, include_in_schema=False,
                      methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.include_router(admin_router)
    app.add_exception_handler(CtxError, render_ctx_error)
    app.add_exception_handler(RequestValidationError, _render_validation)
    app.add_exception_handler(HTTPException, render_http_error)
    app.add_exception_handler(Exception, render_unexpected)
    return app


def _lifespan(settings: Settings, transport: httpx.AsyncBaseTransport | None):  # type: ignore[no-untyped-def]
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(settings.upstream_timeout, connect=settings.upstream_connect_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        journal = JournalWriter(Journal(settings.data_path / "journal.db", settings.journal_sync))
        incognito = JournalWriter(Journal(None))
        async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
            app.state.ctx = AppState(settings, client, journal, incognito,
                                     own_headers=frozenset({settings.session_header.lower()}))
            try:
                yield
            finally:
                journal.close()
                incognito.close()

    return lifespan


async def passthrough(request: Request) -> Response:
    """Every other ``/v1/*`` route (models, embeddings, completions, responses…): relayed as it is."""
    state: AppState = request.app.state.ctx
    body = await read_body(request, state.settings.max_body_bytes)
    outgoing = state.client.build_request(
        request.method, upstream_url(state.settings.upstream, request.url.path, request.url.query),
        headers=client_headers(request.headers.raw, state.own_headers), content=body)
    upstream = await send(state.client, outgoing)
    inner = StreamingResponse(upstream.aiter_raw(), upstream.status_code, headers=response_headers(upstream))
    return FinallyResponse(inner, upstream.aclose)


async def healthz(request: Request) -> JSONResponse:
    settings: Settings = request.app.state.ctx.settings
    return JSONResponse({"status": "ok", "version": __version__, "upstream": settings.upstream})


async def _render_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return await render_ctx_error(request, BadRequest(f"{param}: {first.get('msg', 'invalid value')}", param=param))
