"""``POST /v1/responses`` in translated mode: decode, let the chat engine serve it, encode the answer back.

The request is decoded into a chat body (``decode``) and served by the same path as ``/v1/chat/completions``
(``proxy.chat.serve_chat``): journal, session, budget, projection, context tools, the streamed interception
included. The engine's response is then transcoded on its way out (``Transcoded``): a streamed chat answer event
by event (``events.StreamEncoder``), a buffered one whole (``encode``); an error goes out as it is (the Responses
API's error body is the OpenAI envelope the engine already writes).

The session key is the client's: the session header if it sends one, else Codex's ``session-id`` or
``thread-id`` header, else the body's ``prompt_cache_key``. ``previous_response_id`` is expanded from the
responses the proxy keeps (``chains``) before anything else, so the projection sees the whole conversation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from proxy.chat import serve_chat
from proxy.edge import parse_json, read_body
from proxy.errors import BadRequest
from proxy.fronts.responses.decode import decode_request, input_items
from proxy.fronts.responses.encode import Frame, encode_completion
from proxy.fronts.responses.events import StreamEncoder
from proxy.loop import refuse_loop
from proxy.state import AppState

__all__ = ["Transcoded", "responses"]

_SESSION_HEADERS = (b"session-id", b"thread-id")
"""Headers Codex CLI names its conversation with: a ready-made session key."""
Finished = Callable[[dict[str, Any]], Awaitable[None]]


async def responses(request: Request) -> Response:
    state: AppState = request.app.state.ctx
    refuse_loop(request.headers, state.upstream.instance)
    raw = await read_body(request, state.settings.max_body_bytes, state.settings.client_body_timeout)
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object with an `input`.", code="invalid_json")
    chat = decode_request(body, input_items(body))
    inner = chat_request(request, _session_key(request, body), state.settings.session_header)
    served = await serve_chat(inner, orjson.dumps(chat), front_path=request.url.path)
    return Transcoded(served, Frame.of(body))


def _session_key(request: Request, body: dict[str, Any]) -> str | None:
    for name in _SESSION_HEADERS:
        value = next((v for k, v in request.headers.raw if k.lower() == name), None)
        if value:
            return value.decode("utf-8", "replace")
    key = body.get("prompt_cache_key")
    return key if isinstance(key, str) and key else None


def chat_request(request: Request, session: str | None, session_header: str) -> Request:
    """The request as the chat engine sees it: the upstream's chat path beside the client's, the session named."""
    path = request.url.path.removesuffix("/responses") + "/chat/completions"
    own = session_header.lower().encode("latin-1")
    headers = [(k, v) for k, v in request.scope["headers"] if k.lower() != b"content-length"]
    if session is not None and not any(k.lower() == own for k, _ in headers):
        headers.append((own, session.encode("utf-8")))
    return Request({**request.scope, "path": path, "raw_path": path.encode(), "headers": headers}, request.receive)


class Transcoded(Response):
    """Sends ``inner`` (the chat engine's response) as the Responses API's: a 200 is encoded, anything else is
    relayed as it is. ``finished`` gets the final response object before its last byte goes out."""

    def __init__(self, inner: Response, frame: Frame, finished: Finished | None = None) -> None:
        self.inner, self.frame, self.finished = inner, frame, finished
        self.status_code, self.raw_headers, self.background = inner.status_code, inner.raw_headers, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.inner(scope, receive, _Encoding(self.frame, send, self.finished).send)


class _Encoding:
    """The ASGI ``send`` between the engine's response and the client, encoding as it goes."""

    def __init__(self, frame: Frame, send: Send, finished: Finished | None) -> None:
        self.frame, self.downstream, self.finished = frame, send, finished
        self.mode = "relay"
        self.buffer = b""
        self.stream = StreamEncoder(frame)

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            await self.downstream(self._start(message))
        elif message["type"] == "http.response.body" and self.mode != "relay":
            await self._body(message.get("body", b""), bool(message.get("more_body")))
        else:
            await self.downstream(message)

    def _start(self, message: Message) -> Message:
        headers = dict((k.lower(), v) for k, v in message.get("headers", []))
        kind = headers.get(b"content-type", b"")
        if message["status"] == 200:
            self.mode = "stream" if kind.startswith(b"text/event-stream") else "whole"
        if self.mode == "relay":
            return message
        kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in (b"content-length",
                                                                                    b"content-type")]
        media = b"text/event-stream; charset=utf-8" if self.mode == "stream" else b"application/json"
        return {**message, "headers": [*kept, (b"content-type", media)]}

    async def _body(self, chunk: bytes, more: bool) -> None:
        if self.mode == "stream":
            out = self.stream.feed(chunk) if more else self.stream.feed(chunk) + self.stream.close()
            await self._completed(self.stream.response)
            await self.downstream({"type": "http.response.body", "body": out, "more_body": more})
            return
        self.buffer += chunk
        if more:
            return
        response = encode_completion(self.frame, orjson.loads(self.buffer))
        await self._completed(response)
        await self.downstream({"type": "http.response.body", "body": orjson.dumps(response), "more_body": False})

    async def _completed(self, response: dict[str, Any] | None) -> None:
        if response is not None and self.finished is not None:
            finished, self.finished = self.finished, None
            await finished(response)
