"""The chat route served without Starlette's per-request stack, as that stack would serve it.

Why: ``POST /v1/chat/completions`` is the request the proxy serves more than any other, and Starlette's stack around
it (two exception middlewares, the router matching every route, the route's request/response wrapper: each wraps
``send`` again, and the last two look up the exception handlers again) cost ~18 µs of each (timed in process,
against ~9 µs for the same endpoint and response called directly). ``ProxyApp`` takes that one route (the exact path,
POST, no ``root_path``) straight to its endpoint, and does what the stack does for it: the app in the scope (the
endpoint reads ``request.app.state``); an exception before the response began rendered by the handler of its class
(``CtxError``: ``_refused``, ``HTTPException``, and any other by the ``Exception`` handler, then raised again for the
server's log, as ``ServerErrorMiddleware`` does); nothing rendered once the response has begun. Every other request,
and the lifespan, goes through Starlette as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

__all__ = ["CHAT_PATH", "ProxyApp"]

CHAT_PATH = "/v1/chat/completions"

Endpoint = Callable[[Request], Awaitable[Response]]
Handler = Callable[[Request, Exception], Awaitable[Response]]


class ProxyApp(Starlette):
    """Starlette, but ``POST /v1/chat/completions`` goes straight to ``chat`` (``serve_directly``)."""

    def __init__(self, chat: Endpoint, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._chat = chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == CHAT_PATH and scope["method"] == "POST" \
                and not scope.get("root_path"):
            scope["app"] = self
            await serve_directly(self._chat, self.exception_handlers, scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


async def serve_directly(endpoint: Endpoint, handlers: Mapping[Any, Handler], scope: Scope, receive: Receive,
                         send: Send) -> None:
    """``endpoint``'s response; an exception before it began answered by the handler of its class."""
    request = Request(scope, receive, send)
    began = False

    async def sending(message: Message) -> None:
        nonlocal began
        began = True
        await send(message)

    try:
        response = await endpoint(request)
        await response(scope, receive, sending)
    except Exception as exc:
        handler = handler_for(handlers, exc)
        if handler is None or began:  # what Starlette's ServerErrorMiddleware gets
            error = exc if handler is None else RuntimeError("Caught handled exception, but response already started.")
            await _unexpected(handlers.get(Exception), request, error, None if began else sending)
            if error is exc:
                raise
            raise error from exc
        await (await handler(request, exc))(scope, receive, sending)
        exc.__traceback__ = None  # as Starlette: a reused exception would gather tracebacks across requests


def handler_for(handlers: Mapping[Any, Handler], exc: Exception) -> Handler | None:
    """The handler of the nearest class of ``exc`` that has one, but the ``Exception`` handler's (``_unexpected``)."""
    for cls in type(exc).__mro__:
        if cls is Exception:
            return None
        if cls in handlers:
            return handlers[cls]
    return None


async def _unexpected(handler: Handler | None, request: Request, exc: Exception, send: Send | None) -> None:
    """As ``ServerErrorMiddleware``: the ``Exception`` handler's answer (it logs the error) sent if nothing was yet;
    the caller raises the error again, for the server's log."""
    answer = await handler(request, exc) if handler is not None else Response("Internal Server Error", 500)
    if send is not None:
        await answer(request.scope, request.receive, send)
