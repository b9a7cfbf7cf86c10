"""Native mode: an Anthropic event stream, read as chat chunks by the engine (which takes the context calls out).

Text and thinking deltas become ``content`` and ``reasoning_content`` deltas; each ``tool_use`` block a tool
call (its index, id and name first, then its argument fragments). What chat cannot say rides in ``CARRIER``
keys the front's encoder reads back: the ``message_start`` message on the first chunk, a thinking block's
signature, whole blocks of other kinds (``redacted_thinking``, server tools' blocks), the stop reason on the
finish chunk and Anthropic's usage on the usage chunk. ``ping`` becomes an SSE comment; ``message_stop`` ``[DONE]``.
"""

from __future__ import annotations

from typing import Any

import orjson

from ctxproxy.proxy.edge.fronts.anthropic.native import CARRIER
from ctxproxy.proxy.upstream.sse import sse_lines

__all__ = ["FINISH", "SIGNATURE", "ChatFromAnthropic", "chat_usage"]

SIGNATURE = "ctxproxy_signature"
"""The delta key carrying a thinking block's ``signature_delta``."""
FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
          "pause_turn": "stop", "refusal": "content_filter", "model_context_window_exceeded": "length"}


def chat_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic usage as chat's: the prompt is what was read fresh, from the cache and into it (the budget's
    calibration compares the whole prompt with ctxproxy's count); the original rides along."""
    cached = int(usage.get("cache_read_input_tokens") or 0)
    prompt = int(usage.get("input_tokens") or 0) + cached + int(usage.get("cache_creation_input_tokens") or 0)
    completion = int(usage.get("output_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}, CARRIER: usage}


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, stop: Any = None, **extra: Any) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    if stop is not None:
        choice[CARRIER] = stop
    choices = [] if delta is None else [choice]
    return b"data: " + orjson.dumps({"object": "chat.completion.chunk", "choices": choices, **extra}) + b"\n\n"


class ChatFromAnthropic:
    def __init__(self) -> None:
        self._pending = ""
        self._tools: dict[int, int] = {}
        """Block index → chat tool-call index."""
        self._carried: dict[int, dict[str, Any]] = {}
        """Blocks chat has no word for, assembled until their stop."""
        self._usage: dict[str, Any] = {}

    def feed(self, data: bytes) -> bytes:
        lines = sse_lines(self._pending + data.decode("utf-8", "replace"))
        self._pending = lines.pop()
        return b"".join(self._line(line) for line in lines)

    def close(self) -> bytes:
        tail = self._line(self._pending) if self._pending else b""
        self._pending = ""
        return tail

    def _line(self, line: str) -> bytes:
        if not line.startswith("data:"):
            return b""
        try:
            event = orjson.loads(line[5:].strip())
        except orjson.JSONDecodeError:
            return b""
        return self._event(event) if isinstance(event, dict) else b""

    def _event(self, event: dict[str, Any]) -> bytes:
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message") or {}
            self._usage = dict(message.get("usage") or {})
            extra: dict[str, Any] = {"id": message.get("id"), "model": message.get("model"), CARRIER: message}
            return chunk({"role": "assistant", "content": ""}, None, None, **extra)
        if kind == "content_block_start":
            return self._start(int(event.get("index") or 0), event.get("content_block") or {})
        if kind == "content_block_delta":
            return self._delta(int(event.get("index") or 0), event.get("delta") or {})
        if kind == "content_block_stop":
            block = self._carried.pop(int(event.get("index") or 0), None)
            return chunk({CARRIER: _parsed(block)}) if block is not None else b""
        return self._other(kind, event)

    def _other(self, kind: Any, event: dict[str, Any]) -> bytes:
        if kind == "message_delta":
            self._usage |= event.get("usage") or {}
            stop = event.get("delta") or {}
            finish = chunk({}, FINISH.get(str(stop.get("stop_reason")), "stop"), stop)
            return finish + chunk(None, usage=chat_usage(self._usage))
        if kind == "message_stop":
            return b"data: [DONE]\n\n"
        if kind == "error":
            return b"data: " + orjson.dumps({"error": event.get("error") or {}}) + b"\n\n"
        return b": ping\n\n" if kind == "ping" else b""

    def _start(self, index: int, block: dict[str, Any]) -> bytes:
        kind = block.get("type")
        if kind == "text":
            return chunk({"content": block["text"]}) if block.get("text") else b""
        if kind == "thinking":
            return chunk({"reasoning_content": block["thinking"]}) if block.get("thinking") else b""
        if kind == "tool_use":
            self._tools[index] = len(self._tools)
            return chunk({"tool_calls": [{"index": self._tools[index], "id": block.get("id"), "type": "function",
                                          "function": {"name": block.get("name"), "arguments": ""}}]})
        self._carried[index] = dict(block)
        return b""

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        kind = delta.get("type")
        if kind == "text_delta":
            return chunk({"content": delta.get("text", "")})
        if kind == "thinking_delta":
            return chunk({"reasoning_content": delta.get("thinking", "")})
        if kind == "signature_delta":
            return chunk({SIGNATURE: delta.get("signature", "")})
        if kind == "input_json_delta" and index in self._tools:
            return chunk({"tool_calls": [{"index": self._tools[index],
                                          "function": {"arguments": delta.get("partial_json", "")}}]})
        block = self._carried.get(index)
        if block is not None and kind == "input_json_delta":
            block["_json"] = block.get("_json", "") + delta.get("partial_json", "")
        return b""


def _parsed(block: dict[str, Any]) -> dict[str, Any]:
    """A carried block whole: its streamed input parsed (a server tool's call)."""
    text = block.pop("_json", None)
    if text is not None:
        try:
            block["input"] = orjson.loads(text or "{}")
        except orjson.JSONDecodeError:
            block["input"] = {}
    return block
