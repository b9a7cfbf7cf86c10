"""The fastest OpenAI-compatible upstream we can write: a baseline for measuring what ctxproxy adds.

Why not ``tests/fakes.py``? That fake records every request and parses bodies to script answers: fine for tests,
but its own cost would sit inside both the direct and the proxied timings and blur the difference. This one is
pure ASGI on uvicorn with uvloop + httptools and no access log: it reads the whole body (so a 630 KB upload is
really received), then answers a fixed ``chat.completion`` with ``usage``. A body carrying ``"stream":true``
(compact JSON, as ``bench/latency.py`` sends) gets three SSE chunks and ``data: [DONE]``, each its own write.

Run: ``python bench/fake_upstream.py --port 8999`` (always 127.0.0.1).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_USAGE = {"prompt_tokens": 42, "completion_tokens": 3, "total_tokens": 45}
_BASE = {"id": "chatcmpl-bench", "created": 1700000000, "model": "fake-model"}
COMPLETION = json.dumps(_BASE | {
    "object": "chat.completion", "usage": _USAGE,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok, done."}, "finish_reason": "stop"}],
}, separators=(",", ":")).encode()
_CHUNK_DELTAS = [{"role": "assistant", "content": "ok"}, {"content": ", done."}, {}]
SSE_CHUNKS = [
    b"data: " + json.dumps(_BASE | {"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": "stop" if not delta else None}]},
        separators=(",", ":")).encode() + b"\n\n"
    for delta in _CHUNK_DELTAS
] + [b"data: [DONE]\n\n"]
MODELS = b'{"object":"list","data":[{"id":"fake-model","object":"model","owned_by":"bench"}]}'
_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    if scope["type"] != "http":
        return
    body = await read_body(receive)
    if scope["method"] == "POST" and scope["path"].endswith("/chat/completions"):
        if b'"stream":true' in body:
            await send_sse(send)
        else:
            await send_bytes(send, 200, COMPLETION)
    elif scope["method"] == "GET" and scope["path"].endswith("/models"):
        await send_bytes(send, 200, MODELS)
    else:
        await send_bytes(send, 404, b'{"error":{"message":"not found","type":"invalid_request_error"}}')


async def lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_bytes(send: Send, status: int, body: bytes) -> None:
    headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_sse(send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    for chunk in SSE_CHUNKS:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools", access_log=False,
                log_level="warning", server_header=False, date_header=False)


if __name__ == "__main__":
    main()
