"""The chat engine's SSE stream → Anthropic's: ``message_start``, content blocks, ``message_delta``, ``message_stop``.

Chat chunks arrive split anywhere; complete lines are read as they come. The first chunk opens the message;
text deltas go to a ``text`` block, ``reasoning_content`` deltas to a ``thinking`` block, each tool call (a new
``index`` with its id and name) opens a ``tool_use`` block whose argument fragments are ``input_json_delta``s;
a block closes when another kind begins. ``finish_reason`` and the usage chunk (the front asks for it with
``stream_options.include_usage``) make the closing ``message_delta``; ``[DONE]`` (or the stream's end) the
``message_stop``. SSE comments (the engine's ``: context_op`` lines while the context tools run) pass through as
comments, which Anthropic clients skip, and keep the connection alive. An error the engine writes into the stream
(a follow-up that failed) becomes an ``error`` event.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from ctxproxy.proxy.edge.fronts.anthropic.chatstream import SIGNATURE
from ctxproxy.proxy.edge.fronts.anthropic.encode import (
    CARRIER,
    ERROR_KINDS,
    envelope_message,
    error_body,
    stop_of,
    usage_of,
)
from ctxproxy.proxy.upstream.sse import sse_lines

__all__ = ["AnthropicStream"]


def event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"


class AnthropicStream:
    """One streamed answer's translation; ``feed`` chat SSE bytes, get Anthropic SSE bytes."""

    def __init__(self, model: str | None, stops: Sequence[str] = ()) -> None:
        self.model, self._stops = model, stops
        """``stops``: the request's ``stop_sequences`` (``stop_of``)."""
        self._matched: Any = None
        self._pending = ""
        self._started = self._stopped = False
        self._block: tuple[str, int] | None = None  # the open block's kind and chat tool index
        self._index = -1
        self._finish: str | None = None
        self._stopped_by: Any = None
        self._usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> bytes:
        lines = sse_lines(self._pending + chunk.decode("utf-8", "replace"))
        self._pending = lines.pop()
        return b"".join(self._line(line) for line in lines)

    @property
    def needs_usage(self) -> bool:
        """The chat stream carried no usage (llama-cpp-python sends none): ``close`` should be told the input size."""
        return self._started and self._usage is None

    def close(self, input_tokens: int | None = None) -> bytes:
        """The closing ``message_delta`` and ``message_stop`` (held from ``[DONE]`` until here, so that a stream
        without usage can be given the prompt's size, ``input_tokens``)."""
        tail = self._line(self._pending) if self._pending else b""
        self._pending = ""
        return tail + self._stop(input_tokens)

    def _line(self, line: str) -> bytes:
        if line.startswith(":"):
            return line.encode() + b"\n\n"
        if not line.startswith("data:"):
            return b""
        payload = line[5:].strip()
        if payload == "[DONE]":
            return b""
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return b""
        return self._chunk(data) if isinstance(data, dict) else b""

    def _chunk(self, data: dict[str, Any]) -> bytes:
        if isinstance(data.get("error"), dict):
            return self._start(data) + b"event: error\ndata: " + _error_event(data) + b"\n\n"
        out = self._start(data)
        if isinstance(data.get("usage"), dict):
            self._usage = data["usage"]
        for choice in data.get("choices") or []:
            out += self._delta(choice.get("delta") or {})
            self._finish = choice.get("finish_reason") or self._finish
            self._stopped_by = choice.get(CARRIER) or self._stopped_by
            self._matched = choice.get("stop_reason", self._matched)
        return out

    def _start(self, data: dict[str, Any]) -> bytes:
        if self._started:
            return b""
        self._started = True
        carried = data.get(CARRIER)
        if isinstance(carried, dict):  # a native upstream's own message_start
            return event("message_start", {"message": carried})
        message: dict[str, Any] = {"id": f"msg_{data.get('id') or 'ctxproxy'}", "type": "message", "role": "assistant",
                   "model": self.model or data.get("model"), "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": usage_of(None)}
        return event("message_start", {"message": message})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        out = b""
        if delta.get("reasoning_content"):
            out += self._open("thinking", -1, {"type": "thinking", "thinking": "", "signature": ""})
            out += self._block_delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            out += self._open("text", -1, {"type": "text", "text": ""})
            out += self._block_delta({"type": "text_delta", "text": delta["content"]})
        if delta.get(SIGNATURE) is not None:
            out += self._open("thinking", -1, {"type": "thinking", "thinking": "", "signature": ""})
            out += self._block_delta({"type": "signature_delta", "signature": delta[SIGNATURE]})
        for call in delta.get("tool_calls") or []:
            out += self._tool(call)
        if isinstance(delta.get(CARRIER), dict):  # a native block chat has no word for: whole, as it came
            out += self._open("carried", self._index + 1, delta[CARRIER]) + self._close_block()
        return out

    def _tool(self, call: dict[str, Any]) -> bytes:
        index = int(call.get("index") or 0)
        function = call.get("function") or {}
        out = b""
        if self._block != ("tool_use", index):
            out += self._open("tool_use", index, {"type": "tool_use", "id": call.get("id"),
                                                  "name": function.get("name"), "input": {}})
        if function.get("arguments"):
            out += self._block_delta({"type": "input_json_delta", "partial_json": function["arguments"]})
        return out

    def _open(self, kind: str, tool: int, block: dict[str, Any]) -> bytes:
        if self._block == (kind, tool):
            return b""
        out = self._close_block()
        self._index += 1
        self._block = (kind, tool)
        return out + event("content_block_start", {"index": self._index, "content_block": block})

    def _block_delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self._index, "delta": delta})

    def _close_block(self) -> bytes:
        if self._block is None:
            return b""
        self._block = None
        return event("content_block_stop", {"index": self._index})

    def _stop(self, input_tokens: int | None) -> bytes:
        if self._stopped or not self._started:
            return b""
        self._stopped = True
        delta = stop_of(self._finish or "stop", self._stopped_by, self._matched, self._stops)
        usage = (self._usage or {}).get(CARRIER) or usage_of(self._usage)
        if self._usage is None and input_tokens is not None:
            usage["input_tokens"] = input_tokens
        out = self._close_block() + event("message_delta", {"delta": delta, "usage": usage})
        return out + event("message_stop", {})


def _error_event(data: dict[str, Any]) -> bytes:
    """A failed stream's ``error`` event: a native upstream's own error type kept (Claude Code retries an
    ``overloaded_error`` its own way), else the type its status code names, else ``api_error``."""
    error, message = data["error"], envelope_message(orjson.dumps(data))
    kind = error.get("type")
    if isinstance(kind, str) and kind in ERROR_KINDS:
        return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})
    status = error.get("code")
    return error_body(status if isinstance(status, int) else 500, message)
