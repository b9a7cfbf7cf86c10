"""``POST /v1/messages``: the Anthropic Messages front, a codec around the chat engine (``proxy.edge.fronts.codec``).

The model's ``anthropic_upstream`` setting (a ``[models."…"]`` profile may set it) picks the mode:
``translated`` (the default: the upstream speaks only chat completions, as llama.cpp's and vLLM's usual setup)
sends the chat body to the upstream's ``/chat/completions`` and the query (Claude Code's ``?beta=true``) is not
forwarded; ``native`` (``proxy.edge.fronts.anthropic.native``) sends each forward to the upstream's ``/v1/messages``
with the client's query, headers (``anthropic-version``, ``anthropic-beta``) and every field ctxproxy does not own.
The session key, when the client sends no ``session_header`` of its own, is Claude Code's run
(``X-Claude-Code-Session-Id``) and the conversation in it (``claude_code_session``).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from ctxproxy.proxy.core import fingerprint
from ctxproxy.proxy.edge.body import parse_chat_body
from ctxproxy.proxy.edge.fronts.anthropic.decode import to_chat
from ctxproxy.proxy.edge.fronts.anthropic.encode import envelope_message, error_body, error_response, message_of
from ctxproxy.proxy.edge.fronts.anthropic.native import native_chat
from ctxproxy.proxy.edge.fronts.anthropic.stream import AnthropicStream
from ctxproxy.proxy.edge.fronts.anthropic.upstream import AnthropicUpstream
from ctxproxy.proxy.edge.fronts.codec import Decoded, Encoder, json_object, serve
from ctxproxy.proxy.edge.fronts.projected import projected_tokens, session_of
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.proxy.errors import BadRequest, CtxError

__all__ = ["SESSION_HEADER", "AnthropicFront", "claude_code_session", "messages", "parse_messages_body"]

SESSION_HEADER = "x-claude-code-session-id"
AGENT_HEADER = "x-claude-code-agent-id"


def claude_code_session(request: Request, chat: dict[str, Any]) -> str | None:
    """Claude Code's session for this request: its run (``X-Claude-Code-Session-Id``), narrowed to the conversation.

    Claude Code sends the run's id on every request: its sub-agents' (which add ``X-Claude-Code-Agent-Id``) and its
    side calls' (a title, a topic check) too. Taken alone as one named session, parallel sub-agents waited for each
    other on its lock, and a notice for the main agent went to whichever request came next. So the key is the run,
    the agent if any, and the conversation's opening (its first system and user message)."""
    run = request.headers.get(SESSION_HEADER)
    if not run:
        return None
    agent = request.headers.get(AGENT_HEADER)
    opening = fingerprint(chat.get("messages") or [])[:8]
    return f"{run}:{agent}:{opening}" if agent else f"{run}:{opening}"
"""Claude Code names its session in this header: a ready-made session key."""


def parse_messages_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (the chat edge's parser, for its limits on depth and integers, comes after)."""
    return json_object(raw, "`model`, `messages` and `max_tokens`")


class AnthropicFront:
    """Anthropic Messages in, Anthropic Messages out; chat completions upstream (translated mode)."""

    async def decode(self, raw: bytes, request: Request) -> Decoded:
        body = parse_messages_body(raw)
        state: AppState = request.app.state.ctx
        model = body.get("model") if isinstance(body.get("model"), str) else None
        native = state.settings.for_model(model).anthropic_upstream == "native"
        if native and not isinstance(body.get("messages"), list):
            raise BadRequest("`messages` must be a non-empty array of messages.", param="messages")
        chat = native_chat(body) if native else to_chat(body)
        parse_chat_body(orjson.dumps(chat))  # the chat edge's checks, with Anthropic's error shape
        upstream = AnthropicUpstream(body, request.url.query) if native else None
        named = claude_code_session(request, chat)
        size = functools.partial(projected_tokens, state, chat, session_of(request, state.settings, named))
        stops = tuple(s for s in body.get("stop_sequences") or [] if isinstance(s, str))
        return Decoded(chat, named, {"model": body.get("model"), "size": size, "stops": stops}, upstream)

    def encoder(self, decoded: Decoded) -> Encoder:
        return _Encoder(decoded.context.get("model"), decoded.context.get("size"), decoded.context.get("stops", ()))

    def error(self, exc: CtxError) -> Response:
        return error_response(exc)


class _Encoder:
    def __init__(self, model: str | None, size: Callable[[], Awaitable[int]] | None, stops: tuple[str, ...]) -> None:
        self.model, self.size, self.stops = model, size, stops
        """``size``: the prompt's projected tokens, for a stream whose upstream reported no usage; ``stops``: the
        request's ``stop_sequences``."""
        self.stream = AnthropicStream(model, stops)

    async def whole(self, status: int, content: bytes) -> tuple[int, bytes]:
        if status >= 400:
            return status, error_body(status, envelope_message(content))
        try:
            completion = orjson.loads(content)
        except orjson.JSONDecodeError:
            return 502, error_body(502, "The upstream's answer is not JSON: " + content[:300].decode("utf-8",
                                                                                                   "replace"))
        return status, orjson.dumps(message_of(completion, self.model, self.stops))

    def feed(self, chunk: bytes) -> bytes:
        return self.stream.feed(chunk)

    async def close(self) -> bytes:
        if not (self.stream.needs_usage and self.size):
            return self.stream.close()
        try:
            return self.stream.close(await self.size())
        except CtxError:  # the window could not be learnt: say nothing rather than fail a finished answer
            return self.stream.close()


async def messages(request: Request) -> Response:
    return await serve(request, AnthropicFront())
