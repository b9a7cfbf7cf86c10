"""The ASGI app: ``create_app(settings)`` wires routes, error rendering and the lifespan.

The lifespan owns the one upstream transport (connection pool) and the journals (starlette's lifespan pattern);
nothing is built at import time. Starting, it checks the journal (whole, writable) and marks the requests a crash
left in flight ``interrupted`` (``store.failures``, ``store.recovery``). ``upstream_transport`` lets in-process
tests put an ``httpx.MockTransport`` (or ``ASGITransport``) where the network is; by default it is
``proxy.upstream.transport.Http1Transport``.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, cast

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.types import Receive, Scope, Send

from ctxproxy.config import Settings
from ctxproxy.proxy import __version__
from ctxproxy.proxy.edge.callers import bearer_matches, require_admin, require_metrics
from ctxproxy.proxy.edge.direct import CHAT_PATH, ProxyApp
from ctxproxy.proxy.engine.state import AppState, SessionLocks, Warmup, give_back_freed_memory
from ctxproxy.proxy.errors import (
    BadRequest,
    CtxError,
    log,
    render_ctx_error,
    render_http_error,
    render_unexpected,
    storage_error,
)
from ctxproxy.proxy.observe.logs import note_refusal, startup_line
from ctxproxy.store import Journal, JournalWriter, open_journal, session_locks

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI

__all__ = ["create_app"]


def create_app(settings: Settings, upstream_transport: httpx.AsyncBaseTransport | None = None, *,
               journal_checked: bool = False) -> Starlette:
    """The proxy: plain Starlette routes on the hot path (the chat route straight to its endpoint,
    ``proxy.edge.direct``); the operator API, a FastAPI app, mounted at ``/ctx``.

    FastAPI's middleware (telemetry, body limits, exit stacks) and dependency solving cost ~0.2 ms a request;
    the proxied routes need none of it, the operator API gets query validation and an OpenAPI schema from it.
    ``journal_checked``: the caller has just checked the journal whole (``ctxproxy serve``); the lifespan then only
    opens it.
    """
    chat = _engine_route(f"{EDGE}.chat", "chat_completions")
    routes = [
        Route(CHAT_PATH, chat, methods=["POST"]),  # served directly (``proxy.edge.direct``) but under a root path
        Route("/v1/messages", _engine_route(f"{EDGE}.fronts.anthropic.front", "messages"), methods=["POST"]),
        Route("/v1/messages/count_tokens", _engine_route(f"{EDGE}.fronts.anthropic.count", "count_tokens"),
              methods=["POST"]),
        Route("/v1/responses", _engine_route(f"{EDGE}.fronts.responses.front", "responses"), methods=["POST"]),
        Route("/v1/{path:path}", _engine_route(f"{EDGE}.passthrough", "passthrough", counts=False),
              methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]),
        Route("/", home, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Mount("/ctx", app=OperatorApi()),
    ]
    return ProxyApp(chat, routes=routes, exception_handlers=dict(_HANDLERS) | {CtxError: _refused},
                    lifespan=_lifespan(settings, upstream_transport, check=not journal_checked))


_HANDLERS: dict[type[Exception], Callable[[Request, Exception], Awaitable[Response]]] = {
    CtxError: render_ctx_error, HTTPException: render_http_error, Exception: render_unexpected}


async def _refused(request: Request, exc: Exception) -> Response:
    """A proxied request refused before it had a session: logged and counted, then rendered like any error."""
    if isinstance(exc, CtxError) and request.url.path.startswith("/v1/"):
        note_refusal(request.app.state.ctx.metrics, f"{request.method} {request.url.path}", exc.status, exc.code,
                     exc.message)
    return await render_ctx_error(request, exc)


class OperatorApi:
    """The operator API (``proxy.edge.admin``, a FastAPI app) at ``/ctx``, built on its first request.

    FastAPI and pydantic take about 0.2 s and 15 MB to import, and the proxied routes never use them: a server
    nobody asks for ``/ctx`` never loads them, and none waits for them to start (issue #13). The first request
    builds the app on a worker thread, so the proxied requests in flight meanwhile keep being served.
    """

    def __init__(self) -> None:
        self._app: FastAPI | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._app is None:
            built = await asyncio.to_thread(_operator_api)
            self._app = self._app or built  # two first requests at once: both built it, one is kept
        self._app.state.ctx = scope["app"].state.ctx  # the serving app's state, whichever lifespan made it
        await self._app(scope, receive, send)


def _operator_api() -> FastAPI:
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError

    from ctxproxy.proxy.edge.actions import router as actions
    from ctxproxy.proxy.edge.admin import router as journal
    from ctxproxy.proxy.edge.inspect import router as inspect
    from ctxproxy.proxy.edge.ui import router as page

    admin = FastAPI(title="ctxproxy operator API", version=__version__, docs_url=None, redoc_url=None,
                    openapi_url=None)  # served by `_openapi`, behind the admin token like the rest of /ctx
    for router in (journal, actions, inspect, page):
        admin.include_router(router)
    admin.add_route("/openapi.json", _openapi(admin), include_in_schema=False)
    admin.add_exception_handler(RequestValidationError, _render_validation)
    for error, handler in _HANDLERS.items():
        admin.add_exception_handler(error, handler)
    return admin


def _lifespan(settings: Settings, transport: httpx.AsyncBaseTransport | None, check: bool = True
              ) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """``check``: the journal is checked whole and writable before the server takes a request (``open_journal``);
    False when the caller has just checked it (``ctxproxy serve``): ``PRAGMA quick_check`` reads the whole file,
    7.5 ms for a 600-round session's 11 MB, growing with the file: once a start is enough."""
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        journal = JournalWriter(open_journal(settings.journal_location, settings.journal_sync, check=check),
                                storage_error)
        text, fields = startup_line(settings)
        log.info(text, extra={"ctx": fields})
        if not settings.store:  # shared (replicas): others' requests in flight are not interrupted (store.claims)
            marked = await journal.call(Journal.mark_interrupted, datetime.now(UTC).isoformat(timespec="milliseconds"))
            if marked:
                log.warning("%d requests were in flight when ctxproxy last stopped: journaled as interrupted", marked)
        # On a thread, while the server takes connections. Started last: begun with the lifespan, its imports took
        # the GIL from the journal's opening, and a start was ready later by as much (issue #13).
        warmup = Warmup.start(WARM)
        locks = session_locks(settings.store)
        locks.start()  # a shared store's liveness lock, held before this process journals a request
        app.state.ctx = AppState(settings, journal, transport, warmup=warmup, locks=SessionLocks(locks),
                                 own_headers=frozenset({settings.session_header.lower()}))
        try:
            async with asyncio.TaskGroup() as background:
                trimmer = background.create_task(_trim_when_quiet(app.state.ctx))
                try:
                    yield
                finally:
                    trimmer.cancel()
        finally:
            await app.state.ctx.close_upstream()
            app.state.ctx.locks.close()
            journal.close()
            app.state.ctx.close_incognito()

    return lifespan


TRIM_EVERY = 5.0
"""Seconds between two looks at whether the proxy is quiet (``_trim_when_quiet``)."""


async def _trim_when_quiet(state: AppState) -> None:
    """Give the memory that answered requests freed back to the system once no chat is in flight.

    A burst of large concurrent requests (their bodies, parsed and serialised) leaves the C allocator holding
    much freed memory, and glibc returns little of it by itself: after 250 agents of 20 rounds, RSS stayed about
    90 MB above what the process still used (issue #13). Every ``TRIM_EVERY`` seconds, if chats were answered
    since the last look and no session holds its lock now, ``malloc_trim`` runs on a worker thread (a few ms).
    """
    answered = state.metrics.answered_count()
    while True:
        await asyncio.sleep(TRIM_EVERY)
        now = state.metrics.answered_count()
        if now != answered and not len(state.locks):
            answered = now
            try:
                await asyncio.to_thread(give_back_freed_memory)
            except Exception as exc:  # a failure here must not end the lifespan's task group, and the server
                log.warning("could not give freed memory back to the system: %s", exc)


EDGE = "ctxproxy.proxy.edge"
WARM = (f"{EDGE}.passthrough", f"{EDGE}.chat", f"{EDGE}.fronts.anthropic.front", f"{EDGE}.fronts.anthropic.count",
        f"{EDGE}.fronts.responses.front", "anyio._backends._asyncio")
"""What the warm-up thread imports before it loads the tokenizer: the upstream client (``proxy.upstream``, on httpx:
~25 ms) with the route that only relays (``proxy.edge.passthrough``), the request engine (``proxy.edge.chat``,
``proxy.engine``: 70 ms) and the fronts around it, none of which the server needs to take connections, and anyio's
asyncio backend, which the first cancel scope or Starlette route imports on the loop (8 ms of the first chat
in process; on a server, whichever request comes first)."""


def _engine_route(module: str, name: str, *, counts: bool = True) -> Callable[[Request], Awaitable[Response]]:
    """A route in a module the warm-up imports. ``counts``: it counts tokens, so it waits for the warm-up to be done
    (only the first requests after a start wait); else its first request imports the module itself if the warm-up
    has not yet (waiting for the warm-up's own import of it to finish, not importing it twice)."""

    async def route(request: Request) -> Response:
        if counts:
            await request.app.state.ctx.warmup.ready()
        handler = getattr(importlib.import_module(module), name)  # imported by the warm-up: a sys.modules lookup
        return cast(Response, await handler(request))

    route.__name__ = name
    return route


async def metrics(request: Request) -> Response:
    """Prometheus text exposition of the proxy's counters (behind ``metrics_token`` or the admin token if set)."""
    state: AppState = request.app.state.ctx
    require_metrics(request, state.settings)
    return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def home(request: Request) -> Response:
    """``GET /``: to the inspector page (``/ctx/ui``), which asks for the admin token when one is set."""
    return RedirectResponse("/ctx/ui", status_code=307)


async def healthz(request: Request) -> JSONResponse:
    """Liveness for anyone; the version and the upstream's URL only for a caller the admin token admits."""
    settings: Settings = request.app.state.ctx.settings
    if settings.admin_token is not None and not bearer_matches(request, settings.admin_token):
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "ok", "version": __version__, "upstream": settings.upstream})


def _openapi(admin: FastAPI) -> Callable[[Request], Awaitable[Response]]:
    async def openapi(request: Request) -> Response:
        require_admin(request, request.app.state.ctx.settings)
        return JSONResponse(admin.openapi())

    return openapi


async def _render_validation(request: Request, exc: Exception) -> Response:
    from fastapi.exceptions import RequestValidationError

    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return await render_ctx_error(request, BadRequest(f"{param}: {first.get('msg', 'invalid value')}", param=param))
