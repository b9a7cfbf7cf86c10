"""``POST /v1/responses``: the OpenAI Responses front, a codec around the chat engine (``proxy.edge.fronts.codec``).

The request is decoded into a chat body (``decode``), the engine serves it as it serves a chat
client (journal, session, budget, projection, context tools, streamed interception), and the answer is encoded
back whole (``encode``) or event by event (``events``). Errors keep the OpenAI envelope, which is also the
Responses API's error body.

The session key is the client's: Codex CLI's ``session-id`` (or ``thread-id``) header, else the body's
``prompt_cache_key``; the session header, when the client sends it, wins (``proxy.edge.fronts.codec``).
The model's ``responses_upstream`` setting (a ``[models."…"]`` profile may set it) picks the mode: ``translated``
(the default: the upstream speaks chat completions) or ``native`` (the upstream speaks the Responses API itself:
``proxy.edge.fronts.responses.native`` rebuilds each forward on the client's own body).

``previous_response_id``: every response produced for a request that did not say ``store: false`` is kept in the
journal (``store.kept_responses``) as the whole conversation up to it, and a request naming one is expanded to
that conversation before anything else, so the projection and the journal see the whole history.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from ctxproxy.proxy.edge.callers import incognito_requested
from ctxproxy.proxy.edge.fronts.codec import Decoded, Encoder, json_object, serve
from ctxproxy.proxy.edge.fronts.responses.decode import decode_request, input_items
from ctxproxy.proxy.edge.fronts.responses.encode import Frame, encode_completion
from ctxproxy.proxy.edge.fronts.responses.events import StreamEncoder
from ctxproxy.proxy.edge.fronts.responses.native import ResponsesUpstream
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.proxy.errors import BadRequest, CtxError, UpstreamMalformed, envelope, error_response
from ctxproxy.store import JournalWriter, keep_response, kept_response

__all__ = ["SESSION_HEADERS", "ResponsesFront", "responses"]

SESSION_HEADERS = ("session-id", "thread-id")
"""Headers Codex CLI names its conversation with: a ready-made session key."""
Keep = Callable[[dict[str, Any]], Awaitable[None]]


async def responses(request: Request) -> Response:
    return await serve(request, ResponsesFront())


class ResponsesFront:
    """OpenAI Responses in, OpenAI Responses out; chat completions upstream (translated mode)."""

    async def decode(self, raw: bytes, request: Request) -> Decoded:
        body = _parse(raw)
        state: AppState = request.app.state.ctx
        writer = state.journal_for(incognito_requested(request))
        items = await _expanded(writer, body)
        keep = None if body.get("store") is False else _keeper(writer, items)
        native = state.settings.for_model(_model(body)).responses_upstream == "native"
        upstream = ResponsesUpstream(body, items, request.url.query) if native else None
        return Decoded(decode_request(body, items, native), _session_key(request, body),
                       {"frame": Frame.of(body), "keep": keep}, upstream)

    def encoder(self, decoded: Decoded) -> Encoder:
        return _Encoder(decoded.context["frame"], decoded.context["keep"])

    def error(self, exc: CtxError) -> Response:
        return error_response(exc)


def _model(body: dict[str, Any]) -> str | None:
    return body["model"] if isinstance(body.get("model"), str) else None


def _parse(raw: bytes) -> dict[str, Any]:
    return json_object(raw, "`model` and `input`")


async def _expanded(writer: JournalWriter, body: dict[str, Any]) -> list[Any]:
    """The request's input after the conversation ``previous_response_id`` names (if it names one)."""
    items = input_items(body)
    previous = body.get("previous_response_id")
    if previous is None:
        return items
    kept = await writer.call(kept_response, previous) if isinstance(previous, str) else None
    if kept is None:
        raise BadRequest(f"previous_response_id {previous!r} names no response this ctxproxy kept (it keeps the "
                         "responses it produced, unless the request said `store: false`; an incognito one only in the "
                         "memory of the process, the replica, that made it, until it restarts). Send the whole "
                         "conversation in `input` instead.",
                         param="previous_response_id", code="previous_response_not_found")
    return kept + items


def _keeper(writer: JournalWriter, items: list[Any]) -> Keep:
    async def keep(response: dict[str, Any]) -> None:
        if response.get("status") != "failed":
            created = datetime.now(UTC).isoformat(timespec="milliseconds")
            await writer.call(keep_response, response["id"], items + list(response["output"]), created)

    return keep


def _session_key(request: Request, body: dict[str, Any]) -> str | None:
    for name in SESSION_HEADERS:
        if value := request.headers.get(name):
            return value
    key = body.get("prompt_cache_key")
    return key if isinstance(key, str) and key else None


class _Encoder:
    """One request's answer as the Responses API's; the response is kept before its last byte goes out."""

    def __init__(self, frame: Frame, keep: Keep | None) -> None:
        self.frame, self.keep = frame, keep
        self.stream = StreamEncoder(frame)

    async def whole(self, status: int, content: bytes) -> tuple[int, bytes]:
        if status != 200:
            return status, content  # the engine's and the upstream's errors: already the OpenAI envelope
        try:
            response = encode_completion(self.frame, orjson.loads(content))
        except (orjson.JSONDecodeError, AttributeError, TypeError):
            detail = content[:300].decode("utf-8", "replace")
            failure = UpstreamMalformed(f"The upstream's answer is not a chat completion: {detail}")
            return failure.status, envelope(failure.message, failure.type, failure.param, failure.code)
        await self._keep(response)
        return status, orjson.dumps(response)

    def feed(self, chunk: bytes) -> bytes:
        return self.stream.feed(chunk)

    async def close(self) -> bytes:
        out = self.stream.close()
        await self._keep(self.stream.response)
        return out

    async def _keep(self, response: dict[str, Any] | None) -> None:
        if response is not None and self.keep is not None:
            await self.keep(response)
