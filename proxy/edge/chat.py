"""``POST /v1/chat/completions``: validate, journal, project, forward, relay, journal the answer.

The order is the contract: the request is journaled before anything else; the session's lock is held from then
until the answer is journaled, whatever happens in between (an upstream failure, a client that disconnects
mid-stream). The projection's decisions and cut bodies are journaled while the request is upstream, before a byte
of its answer goes back (``proxy.engine.planning``). When nothing is rewritten the client's body goes upstream byte
for byte; a streamed answer is relayed chunk by chunk as it arrives.

The rounds upstream (context tools, overflow retries, the streamed relay) are the turn engine's
(``proxy.engine``): this module is the HTTP edge, which admits the request, journals it, locks its session, hands
it to ``proxy.engine.drive`` and renders what fails before an answer has begun.
"""

from __future__ import annotations

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response

from ctxproxy.proxy.core import canonical_json, content_hash, fingerprint
from ctxproxy.proxy.core.pieces import Pieces
from ctxproxy.proxy.core.prefix import Match
from ctxproxy.proxy.edge.body import parse_chat_body, read_chat_body, refuse_unwritable
from ctxproxy.proxy.edge.callers import incognito_requested, requested_session, scoped_fingerprint
from ctxproxy.proxy.engine.context import read_new_session
from ctxproxy.proxy.engine.driver import drive
from ctxproxy.proxy.engine.exchange import Exchange, now
from ctxproxy.proxy.engine.heavy import check_message_count, is_heavy
from ctxproxy.proxy.engine.replies import compact_request
from ctxproxy.proxy.engine.shielded import journaled
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.proxy.errors import ContextTooLarge, CtxError, UpstreamMalformed, envelope, error_response
from ctxproxy.proxy.upstream.endpoint import redact
from ctxproxy.proxy.upstream.loop import refuse_loop
from ctxproxy.proxy.wire import ChatBody
from ctxproxy.store import IncomingRequest, Journal

__all__ = ["chat_completions", "incoming_request"]


async def chat_completions(request: Request) -> Response:
    state: AppState = request.app.state.ctx
    refuse_loop(request.headers, state.upstream.instance)
    incognito = incognito_requested(request) or state.settings.incognito
    # the parse costs what the bytes after the shared ones cost, and those are the only ones copied
    raw, match = await read_chat_body(request, state.settings.max_body_bytes, state.settings.client_body_timeout,
                                      state.hasher.prefixes)
    heavy = is_heavy(raw, match.shared if match else 0)
    body, incoming = await state.offload.run(heavy, _admit, request, raw, state, match)
    writer = state.journal_for(incognito)
    read = read_new_session(body.get("model"), incoming.session_name is not None)
    # once begun, the request's row is written, so its answer row can follow
    recorded, saved = await journaled(writer, Journal.record_request_and_read, incoming, read, True, heavy=heavy)
    exchange = Exchange(state, writer, recorded, request, body, incoming, incognito, saved)
    try:
        await exchange.lock()
        return await drive(exchange, raw, compact_request(body))
    except CtxError as exc:
        with anyio.CancelScope(shield=True):
            await exchange.finish(_outcome_of(exc), exc.status, envelope(exc.message, exc.type, exc.param, exc.code))
        return error_response(exc, headers=exchange.headers)
    except BaseException as exc:
        cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
        with anyio.CancelScope(shield=True):
            await exchange.finish(_outcome_of(exc), 499 if cancelled else 500, None)
        raise


def _admit(request: Request, raw: Pieces, state: AppState, match: Match | None) -> tuple[ChatBody, IncomingRequest]:
    """Parse, validate and hash: sized by the request's new bytes (``match``: the recent body it repeats), so a
    large one's runs on the worker (``proxy.engine.heavy``)."""
    body = parse_chat_body(raw, state.hasher.prefixes, match)
    check_message_count(len(body["messages"]), state.settings.max_messages)
    try:  # serialises the parameters and the new messages: the only parts of the body not written before
        return body, incoming_request(request, raw, body, state)
    except orjson.JSONEncodeError:
        refuse_unwritable(dict(body))


def incoming_request(request: Request, raw: bytes | Pieces, body: ChatBody, state: AppState) -> IncomingRequest:
    """The journal's view of a request: content hashes and canonical bodies, credentials redacted."""
    messages = body["messages"]
    session_name = requested_session(request, state.settings)
    opening = scoped_fingerprint(fingerprint(messages), request, state.settings)
    hashed = state.hasher.hash(session_name or opening, messages)
    params = canonical_json({k: v for k, v in body.items() if k != "messages"})
    return IncomingRequest(
        received_at=now(), path=url_path(request), model=body.get("model"), stream=bool(body.get("stream")),
        session_name=session_name, fingerprint=opening, hashes=hashed.hashes, bodies=hashed.bodies,
        params_hash=content_hash(params), params_body=params, headers=redact(request.headers.raw, state.own_headers),
        body_bytes=len(raw), turn=hashed.hashes[hashed.users[-1]] if hashed.users else "",  # ``turn_of``'s start
    )


def _outcome_of(exc: BaseException) -> str:
    if isinstance(exc, ContextTooLarge):
        return "context_too_large"
    if isinstance(exc, UpstreamMalformed):
        return "upstream_malformed"
    if isinstance(exc, CtxError):
        return {502: "unreachable", 504: "timeout"}.get(exc.status, "error")
    return "client_disconnected" if isinstance(exc, anyio.get_cancelled_exc_class()) else "error"


def url_path(request: Request) -> str:
    """``request.url.path`` without building the URL (parsing its host header and all: 1.7% of a small request):
    the scope's path, escaped as Starlette's ``URL`` escapes it."""
    path: str = request.scope["path"]
    return path.replace("?", "%3F").replace("#", "%23").replace("\\", "%5C")
