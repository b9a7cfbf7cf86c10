"""Native mode's upstream: each forward encoded into ``/v1/messages``, each answer decoded into chat for the engine.

``AnthropicUpstream`` is the ``UpstreamCodec`` (``proxy.engine.forward``) the Anthropic front hands the engine when
the model's ``anthropic_upstream`` is ``native``. Its answers reach the engine as chat: a message becomes a
completion, an event stream becomes chat chunks (``proxy.edge.fronts.anthropic.chatstream``), an error the OpenAI
envelope (Anthropic's "prompt is too long" in words the overflow detector reads, so the engine cuts and retries).
What chat has no word for travels in ``CARRIER`` keys the front's encoder reads back: the answer's own blocks
(thinking with its signature), its usage, its stop reason.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from ctxproxy.proxy.edge.fronts.anthropic.chatstream import FINISH, ChatFromAnthropic, chat_usage
from ctxproxy.proxy.edge.fronts.anthropic.native import CARRIER, native_body

__all__ = ["AnthropicUpstream", "chat_completion", "chat_error"]

_TOO_LONG = re.compile(r"prompt is too long: (\d+) tokens > (\d+)")


class AnthropicUpstream:
    """Forwards in Anthropic Messages, built on the client's ``original`` body."""

    path = "/v1/messages"

    def __init__(self, original: dict[str, Any], query: str) -> None:
        self.original, self.query = original, query

    def request(self, body: bytes) -> bytes:
        return orjson.dumps(native_body(orjson.loads(body), self.original))

    def response(self, answer: httpx.Response) -> httpx.Response:
        headers = [(k, v) for k, v in answer.headers.raw if k.lower() not in (b"content-length", b"content-encoding")]
        streamed = answer.headers.get("content-type", "").startswith("text/event-stream")
        return httpx.Response(answer.status_code, headers=headers, stream=_Translated(answer, streamed))


class _Translated(httpx.AsyncByteStream):
    def __init__(self, answer: httpx.Response, streamed: bool) -> None:
        self.answer, self.streamed = answer, streamed

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.streamed and self.answer.status_code == 200:
            translator = ChatFromAnthropic()
            async for chunk in self.answer.aiter_raw():
                out = translator.feed(chunk)
                if out:
                    yield out
            yield translator.close()
            return
        content = b"".join([chunk async for chunk in self.answer.aiter_raw()])
        yield _whole(self.answer.status_code, content)

    async def aclose(self) -> None:
        await self.answer.aclose()


def _whole(status: int, content: bytes) -> bytes:
    try:
        parsed = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content if status >= 400 else chat_error("The upstream's answer is not JSON.", "api_error")
    if status >= 400 or not isinstance(parsed, dict) or parsed.get("type") == "error":
        error = parsed.get("error") if isinstance(parsed, dict) else None
        error = error if isinstance(error, dict) else {}
        return chat_error(str(error.get("message") or content[:500].decode("utf-8", "replace")),
                          str(error.get("type") or "api_error"))
    return orjson.dumps(chat_completion(parsed))


def chat_error(message: str, kind: str) -> bytes:
    """An Anthropic error in the OpenAI envelope; "prompt is too long" in the words ``proxy.upstream.overflow``
    reads."""
    too_long = _TOO_LONG.search(message)
    if too_long:
        return orjson.dumps({"error": {"message": f"This model's maximum context length is {too_long[2]} tokens, "
                                                  f"however you requested {too_long[1]} tokens ({message})",
                                       "type": kind, "code": "context_length_exceeded"}})
    return orjson.dumps({"error": {"message": message, "type": kind}})


def chat_completion(message: dict[str, Any]) -> dict[str, Any]:
    blocks = [b for b in message.get("content") or [] if isinstance(b, dict)]
    text = "".join(str(b.get("text", "")) for b in blocks if b.get("type") == "text")
    chat: dict[str, Any] = {"role": "assistant", "content": text or None}
    thinking = "".join(str(b.get("thinking", "")) for b in blocks if b.get("type") == "thinking")
    if thinking:
        chat["reasoning_content"] = thinking
    calls = [{"id": b.get("id"), "type": "function", "function": {
        "name": b.get("name"), "arguments": orjson.dumps(b.get("input") or {}).decode()}}
        for b in blocks if b.get("type") == "tool_use"]
    if calls:
        chat["tool_calls"] = calls
    chat[CARRIER] = blocks
    stop = {"stop_reason": message.get("stop_reason"), "stop_sequence": message.get("stop_sequence")}
    choice = {"index": 0, "message": chat, "finish_reason": FINISH.get(str(stop["stop_reason"]), "stop"),
              CARRIER: stop}
    return {"id": message.get("id"), "object": "chat.completion", "model": message.get("model"),
            "choices": [choice], "usage": chat_usage(message.get("usage") or {})}
