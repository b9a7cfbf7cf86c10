"""A scripted fake OpenAI-compatible upstream, and a way to serve any ASGI app on loopback in a thread.

``FakeUpstream`` is an ASGI app. In-process tests put it behind ``httpx.ASGITransport`` as the proxy's upstream;
end-to-end tests serve it with real uvicorn on 127.0.0.1. It records every request it receives (raw bytes and
headers) and answers from a queue of scripted replies (``enqueue``), or, when the queue is empty, with a
deterministic echo of the last user message, streamed or not as asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.types import Receive, Scope, Send


@dataclass
class Received:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Reply:
    """One scripted answer: a JSON body, an SSE stream, or raw bytes; optional delay before headers."""

    status: int = 200
    body: Any = None
    sse: list[Any] | None = None
    raw: bytes | None = None
    delay: float = 0.0
    chunk_gate: threading.Event | None = None
    headers: dict[str, str] = field(default_factory=dict)
    break_off: bool = False
    """Send the headers, then fail: uvicorn drops the connection (llama-cpp-python's streamed overflow)."""


def completion(text: str, prompt_tokens: int = 10, model: str = "fake-model") -> dict[str, Any]:
    return {"id": "chatcmpl-fake", "object": "chat.completion", "created": 1700000000, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(text.split()),
                      "total_tokens": prompt_tokens + len(text.split())}}


def tool_answer(*calls: tuple[str, dict[str, Any]], content: str | None = None) -> dict[str, Any]:
    """A completion whose message calls tools: ``tool_answer(("context_drop", {"handles": ["call_1"]}))``."""
    tool_calls = [{"id": f"ctx_{i}_{name}", "type": "function",
                   "function": {"name": name, "arguments": json.dumps(args)}} for i, (name, args) in enumerate(calls)]
    return {"id": "chatcmpl-fake", "object": "chat.completion", "created": 1700000000, "model": "fake-model",
            "choices": [{"index": 0, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "content": content, "tool_calls": tool_calls}}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}}


def stream_tool_answer(*calls: tuple[str, dict[str, Any]], content: str | None = None,
                       usage: dict[str, int] | None = None) -> list[Any]:
    """A streamed answer calling tools, in the pieces OpenAI sends: each call's first delta carries its index,
    id and name, the arguments follow in fragments; then the finish chunk and, if asked, the usage chunk."""
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1700000000, "model": "fake-model"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": word + " "}) for word in (content or "").split()]
    for i, (name, args) in enumerate(calls):
        text = json.dumps(args)
        out.append(chunk({"tool_calls": [{"index": i, "id": f"ctx_{i}_{name}", "type": "function",
                                          "function": {"name": name, "arguments": ""}}]}))
        out += [chunk({"tool_calls": [{"index": i, "function": {"arguments": text[k:k + 7]}}]})
                for k in range(0, len(text), 7)]
    out.append(chunk({}, "tool_calls"))
    if usage:
        out.append(base | {"choices": [], "usage": usage})
    return out


def stream_chunks(text: str, model: str = "fake-model", usage: dict[str, int] | None = None) -> list[Any]:
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1700000000, "model": model}
    chunks: list[Any] = [base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    for word in text.split(" "):
        chunks.append(base | {"choices": [{"index": 0, "delta": {"content": word + " "}}]})
    chunks.append(base | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if usage:
        chunks.append(base | {"choices": [], "usage": usage})
    return chunks


class FakeUpstream:
    def __init__(self) -> None:
        self.received: list[Received] = []
        self.replies: dict[str, deque[Reply]] = {}

    def enqueue(self, reply: Reply, path: str = "/chat/completions") -> None:
        """Script the next answer to a request whose path ends with ``path`` (other routes keep their defaults,
        so a proxy's own side requests, like its window detection, do not eat a test's scripted answers)."""
        self.replies.setdefault(path, deque()).append(reply)

    def _next(self, got: Received) -> Reply:
        for suffix, queue in self.replies.items():
            if got.path.endswith(suffix) and queue:
                return queue.popleft()
        return self._echo(got)

    @property
    def chats(self) -> list[Received]:
        """The chat requests received (the proxy's side requests left out)."""
        return [r for r in self.received if r.path.endswith("/chat/completions")]

    @property
    def last(self) -> Received:
        return self.received[-1]

    @property
    def last_chat(self) -> Received:
        return self.chats[-1]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        body = await receive_body(receive)
        got = Received(scope["method"], scope["path"], scope["query_string"].decode(),
                       {k.decode().lower(): v.decode() for k, v in scope["headers"]}, body)
        self.received.append(got)
        reply = self._next(got)
        if reply.delay:
            await asyncio.sleep(reply.delay)
        await _send_reply(reply, send)

    def _echo(self, got: Received) -> Reply:
        if got.path.endswith("/models"):
            return Reply(body={"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        if not got.path.endswith("/chat/completions"):
            return Reply(body={"path": got.path, "method": got.method, "echo": got.body.decode(errors="replace")})
        request = got.json()
        users = [m.get("content") for m in request.get("messages", []) if m.get("role") == "user"]
        text = f"echo: {users[-1] if users else ''}"
        prompt = len(got.body) // 4
        if request.get("stream"):
            usage = None
            if (request.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3}
            return Reply(sse=stream_chunks(text, request.get("model", "fake-model"), usage))
        return Reply(body=completion(text, prompt, request.get("model", "fake-model")))


async def lifespan(receive: Receive, send: Send, on_shutdown: Callable[[], Awaitable[None]] | None = None) -> None:
    """An ASGI app's lifespan: start at once; at shutdown, run ``on_shutdown`` first."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if on_shutdown is not None:
                await on_shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return


async def receive_body(receive: Receive) -> bytes:
    """A request's whole body, however many ASGI messages it comes in."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


class BrokeOff(Exception):
    """Raised by a fake upstream's app to make its server drop the connection mid-answer."""


async def _send_reply(reply: Reply, send: Send) -> None:
    if reply.break_off:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        raise BrokeOff("the fake upstream drops the connection")
    if reply.sse is not None:
        headers = {"content-type": "text/event-stream"} | reply.headers
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
        async for piece in _sse_pieces(reply):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    payload = reply.raw if reply.raw is not None else json.dumps(reply.body).encode()
    headers = {"content-type": "application/json"} | reply.headers
    await send({"type": "http.response.start", "status": reply.status,
                "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


async def _sse_pieces(reply: Reply) -> AsyncIterator[bytes]:
    for i, event in enumerate(reply.sse or []):
        if i == 1 and reply.chunk_gate is not None:
            while not reply.chunk_gate.is_set():  # the test releases the rest once it has seen the first chunk
                await asyncio.sleep(0.005)
        yield event if isinstance(event, bytes) else b"data: " + json.dumps(event).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


@contextlib.contextmanager
def serve_in_thread(app: Any, **config: Any) -> Iterator[str]:
    """Serve ``app`` with real uvicorn on 127.0.0.1 (a free port); yields its base URL, stops it after."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class CountingUpstream(FakeUpstream):
    """A model server with a real window: it counts each prompt (cl100k × ``ratio``, plus a per-message template
    cost) and answers like llama.cpp — 400 ``exceed_context_size_error`` above ``window``, an empty 200 when the
    request streams — and otherwise with ``usage.prompt_tokens`` set to its own count."""

    def __init__(self, window: int, ratio: float = 1.0) -> None:
        super().__init__()
        from ctxproxy.proxy.core.tokens import MessageCounter

        self.window, self.ratio = window, ratio
        self.counter = MessageCounter()
        self.counts: list[int] = []
        """The prompt size of every chat request received, as this server counts it."""

    def _echo(self, got: Received) -> Reply:
        if not got.path.endswith("/chat/completions"):
            return super()._echo(got)
        request = got.json()
        counted = int(sum(self.counter.count(m) for m in request["messages"]) * self.ratio)
        counted += int(self.counter.count_tools(request.get("tools")) * self.ratio)
        self.counts.append(counted)
        if counted > self.window:
            if request.get("stream"):
                return Reply(raw=b"", headers={"content-type": "text/event-stream"})
            return Reply(status=400, body={"error": {
                "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": counted, "n_ctx": self.window,
                "message": "the request exceeds the available context size, try increasing it"}})
        if request.get("stream"):
            return Reply(sse=stream_chunks("fits", usage={"prompt_tokens": counted, "completion_tokens": 1,
                                                          "total_tokens": counted + 1}))
        return Reply(body=completion("fits", counted))

    @property
    def over_window(self) -> int:
        return sum(1 for c in self.counts if c > self.window)
