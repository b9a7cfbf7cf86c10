"""``POST /v1/messages``: the Anthropic Messages front, a codec around the chat engine (``proxy.fronts.codec``).

The session key is Claude Code's ``X-Claude-Code-Session-Id`` header when the client sends no ``session_header``
of its own. A query (Claude Code's ``?beta=true``) is accepted and not forwarded: the translated request goes to
the upstream's ``/chat/completions``.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from proxy.edge import parse_chat_body
from proxy.errors import BadRequest, CtxError
from proxy.fronts.anthropic.decode import to_chat
from proxy.fronts.anthropic.encode import envelope_message, error_body, error_response, message_of
from proxy.fronts.anthropic.stream import AnthropicStream
from proxy.fronts.codec import Decoded, Encoder, serve

__all__ = ["SESSION_HEADER", "AnthropicFront", "messages", "parse_messages_body"]

SESSION_HEADER = "x-claude-code-session-id"
"""Claude Code names its session in this header: a ready-made session key."""


def parse_messages_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (the chat edge's parser, for its limits on depth and integers, comes after)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object with `model`, `messages` and `max_tokens`.",
                         code="invalid_json")
    return body


class AnthropicFront:
    """Anthropic Messages in, Anthropic Messages out; chat completions upstream (translated mode)."""

    async def decode(self, raw: bytes, request: Request) -> Decoded:
        body = parse_messages_body(raw)
        chat = to_chat(body)
        parse_chat_body(orjson.dumps(chat))  # the chat edge's checks, with Anthropic's error shape
        return Decoded(chat, request.headers.get(SESSION_HEADER), {"model": body.get("model")})

    def encoder(self, decoded: Decoded) -> Encoder:
        return _Encoder(decoded.context.get("model"))

    def error(self, exc: CtxError) -> Response:
        return error_response(exc)


class _Encoder:
    def __init__(self, model: str | None) -> None:
        self.model = model
        self.stream = AnthropicStream(model)

    async def whole(self, status: int, content: bytes) -> tuple[int, bytes]:
        if status >= 400:
            return status, error_body(status, envelope_message(content))
        try:
            completion = orjson.loads(content)
        except orjson.JSONDecodeError:
            return 502, error_body(502, "The upstream's answer is not JSON: " + content[:300].decode("utf-8",
                                                                                                   "replace"))
        return status, orjson.dumps(message_of(completion, self.model))

    def feed(self, chunk: bytes) -> bytes:
        return self.stream.feed(chunk)

    async def close(self) -> bytes:
        return self.stream.close()


async def messages(request: Request) -> Response:
    return await serve(request, AnthropicFront())
