"""The model behind ``ctxproxy replay``: it answers each request with the recorded conversation's next assistant
message, and keeps every body the proxy sent it.

An ASGI app, so one object serves both sides of the comparison: ``ctxproxy replay`` reaches it in process
(``httpx.ASGITransport``), and the test that holds replay to the server (``tests/test_replay.py``) puts it behind a
real ``ctxproxy serve`` over loopback. Its ``usage`` is the proxy's own tokenizer's count of the body it got (an
upstream whose tokenizer is cl100k, with no template cost): the server calibrates from it as it does from a real
model's answers, and both runs see the same figures, so both send the same bytes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import orjson

from ctxproxy.proxy.core import message_hash
from ctxproxy.proxy.core.tokens import MessageCounter

__all__ = ["LAST_ANSWER", "RecordedUpstream", "Sent", "prompt_tokens"]

LAST_ANSWER: dict[str, Any] = {"role": "assistant", "content": ""}
"""The answer to a conversation's last request, which the recording does not hold (it ends before the model's)."""

_Scope = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
_Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_JSON = [(b"content-type", b"application/json")]


@dataclass(frozen=True)
class Sent:
    """One request the proxy sent upstream, and its tokens as the upstream counted them."""

    body: bytes
    prompt_tokens: int


class RecordedUpstream:
    """Set ``answer`` before each request of the agent; every chat completion gets it until it changes."""

    def __init__(self, counter: MessageCounter | None = None) -> None:
        self.counter = counter or MessageCounter()
        self.answer: dict[str, Any] = LAST_ANSWER
        self.sent: list[Sent] = []

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        body = await _body(receive)
        if scope["method"] == "POST" and scope["path"].endswith("/chat/completions"):
            status, payload = 200, self.complete(body)
        else:  # the replay sets the window: nothing else is ever asked
            status, payload = 404, orjson.dumps({"error": {"message": f"no {scope['path']} in a recording",
                                                           "type": "not_found_error", "param": None, "code": None}})
        await send({"type": "http.response.start", "status": status, "headers": _JSON})
        await send({"type": "http.response.body", "body": payload})

    def complete(self, body: bytes) -> bytes:
        """The recorded answer as a chat completion; the request is kept with its token count."""
        request = orjson.loads(body)
        prompt = prompt_tokens(request, self.counter)
        self.sent.append(Sent(body, prompt))
        message = self.answer
        completion = self.counter.count(message)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        return orjson.dumps({
            "id": "chatcmpl-replay", "object": "chat.completion", "created": 0, "model": request.get("model"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}})


def prompt_tokens(request: dict[str, Any], counter: MessageCounter) -> int:
    """A chat request's messages and tools, counted (each message cached under its content hash)."""
    messages = request.get("messages") or []
    return sum(counter.count(m, message_hash(m)) for m in messages) + counter.count_tools(request.get("tools"))


async def _body(receive: _Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _lifespan(receive: _Receive, send: _Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
