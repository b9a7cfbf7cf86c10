"""One error shape for every failure: the OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``.

Our exceptions carry their HTTP status, type and code; one renderer turns any of them (and anything unexpected)
into the envelope, so a client never sees a bare 500 or a traceback. Upstream errors are not ours: they are
relayed with the upstream's own status and body (see ``proxy.edge.chat``).
"""

from __future__ import annotations

import logging

import orjson
from starlette.requests import Request
from starlette.responses import Response

from ctxproxy.store.failures import JournalUnavailable

__all__ = [
    "BadRequest",
    "ContextTooLarge",
    "CtxError",
    "NotFound",
    "PayloadTooLarge",
    "ProxyLoop",
    "RequestTimeout",
    "StorageError",
    "StorageFull",
    "Unauthorized",
    "UpstreamBrokeOff",
    "UpstreamMalformed",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "error_response",
    "render_unexpected",
    "sse_error",
    "storage_error",
]

log = logging.getLogger("ctxproxy")


class CtxError(Exception):
    status = 500
    type = "server_error"
    code: str | None = "internal_error"
    close_connection = False
    """Answer with ``Connection: close``: the rest of the request may still be arriving and is not wanted."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class BadRequest(CtxError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class ContextTooLarge(CtxError):
    """The request cannot fit the model's context even after every cut the rules allow."""

    status, type, code = 400, "invalid_request_error", "context_length_exceeded"


class Unauthorized(CtxError):
    status, type, code = 401, "authentication_error", "invalid_admin_token"


class NotFound(CtxError):
    status, type, code = 404, "not_found_error", "not_found"


class PayloadTooLarge(CtxError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class ProxyLoop(CtxError):
    """The request came back to the proxy that sent it (``proxy.upstream.loop``): 508 Loop Detected, RFC 5842 §7.2."""

    status, type, code = 508, "server_error", "proxy_loop"


class RequestTimeout(CtxError):
    """The client did not send its request in time (``client_body_timeout``); the connection is closed after."""

    status, type, code = 408, "invalid_request_error", "request_timeout"
    close_connection = True


class UpstreamUnreachable(CtxError):
    status, type, code = 502, "upstream_error", "upstream_unreachable"


class UpstreamBrokeOff(UpstreamUnreachable):
    """The upstream took the request, then closed the connection before its first byte (llama-cpp-python does
    this to a streamed prompt longer than its ``n_ctx``): unlike a refused connection, possibly an overflow."""

    code = "upstream_disconnected"


class UpstreamMalformed(CtxError):
    """The upstream answered, but not in the shape ctxproxy reads (``proxy.upstream.answers``): its fault, not
    the client's."""

    status, type, code = 502, "upstream_error", "upstream_malformed"


class UpstreamTimeout(CtxError):
    status, type, code = 504, "upstream_error", "upstream_timeout"


class StorageFull(CtxError):
    """The journal's disk is full: the request was refused before anything was forwarded; the proxy stays up
    and takes requests again once there is room (507 Insufficient Storage, RFC 4918 §11.5)."""

    status, type, code = 507, "server_error", "storage_full"


class StorageError(CtxError):
    """The journal cannot be written or read (read-only, corrupt, I/O error); the message names the file."""

    status, type, code = 503, "server_error", "storage_error"


def storage_error(problem: JournalUnavailable) -> CtxError:
    """What a journal that cannot be used means to a client (``store.JournalWriter`` raises it so): a full disk is
    507, anything else (read-only, corrupt, an I/O error) 503; the message names the file and the fix."""
    return StorageFull(problem.message) if problem.kind == "full" else StorageError(problem.message)


def envelope(message: str, type_: str, param: str | None, code: str | None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def sse_error(exc: CtxError) -> bytes:
    """How a stream whose 200 has left ends when it cannot go on: the error as a ``data:`` event in the envelope
    (OpenAI's own streams fail this way), then ``[DONE]`` so every client's SSE loop ends cleanly."""
    return b"data: " + envelope(exc.message, exc.type, exc.param, exc.code) + b"\n\ndata: [DONE]\n\n"


def error_response(exc: CtxError, headers: dict[str, str] | None = None) -> Response:
    body = envelope(exc.message, exc.type, exc.param, exc.code)
    if exc.close_connection:
        headers = {**(headers or {}), "connection": "close"}
    return Response(body, status_code=exc.status, media_type="application/json", headers=headers)


async def render_ctx_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, CtxError)
    return error_response(exc)


async def render_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 and friends, in our envelope."""
    status = int(getattr(exc, "status_code", 500))
    detail = str(getattr(exc, "detail", "")) or "error"
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return Response(envelope(detail, kind, None, str(status)), status_code=status, media_type="application/json")


async def render_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    body = envelope("ctxproxy hit an internal error; the details are in its log. The request was not completed.",
                    "server_error", None, "internal_error")
    return Response(body, status_code=500, media_type="application/json")
