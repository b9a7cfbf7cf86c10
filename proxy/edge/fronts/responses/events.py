"""A chat-completions SSE stream encoded, as it arrives, into the Responses stream events.

The engine relays one coherent chat stream (the context calls already taken out, ``proxy.engine.stream``); this
encoder turns each of its chunks into the events a Responses client reads: ``response.created`` and
``response.in_progress`` first; per output item ``response.output_item.added``, its deltas
(``response.output_text.delta``, ``response.refusal.delta``, ``response.function_call_arguments.delta``,
``response.reasoning_text.delta``),
their ``…done`` and ``response.output_item.done``; then ``response.completed`` (or ``response.incomplete``) with
the whole response, usage included. Every event carries its ``sequence_number``. SSE comments (the engine's
keep-alives and context-op notes) pass through. An error event in the chat stream becomes ``error`` and
``response.failed``; a stream that ends without ``[DONE]`` ends with ``response.failed`` too.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ctxproxy.proxy.edge.fronts.responses.encode import (
    Frame,
    function_call_item,
    message_item,
    reasoning_item,
    responses_usage,
    status_of,
)

__all__ = ["CARRIER_EVENT", "StreamEncoder", "parsed_event"]

Item = dict[str, Any]
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_DONE = object()
_MESSAGES = ("message", "refusal")
"""The kinds of streamed item that are an assistant message: its text, or its refusal (chat's ``delta.refusal``)."""
_PARTS = {"message": "output_text", "refusal": "refusal", "reasoning": "reasoning_text"}
"""Each text kind's part, as its events name it (``response.<part>.delta`` / ``.done``)."""
CARRIER_EVENT = b"ctxproxy-output-item"
"""Native mode: a named SSE event carrying one of the upstream's output items whole (the engine's stream filter
passes named events untouched); it goes to the agent as that item, byte for byte."""


class _Numbered:
    """Responses events as SSE bytes, numbered in the order they are made."""

    sequence = 0

    def _emit(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class StreamEncoder(_Numbered):
    """Feed it the chat stream's bytes as they come; it returns the Responses stream's bytes."""

    def __init__(self, frame: Frame) -> None:
        self.frame = frame
        self.pending = b""
        self.output: list[Item] = []
        self.current: _Open | None = None
        self.usage: dict[str, Any] | None = None
        self.finish_reason: Any = None
        self.started = self.done = False
        self.response: dict[str, Any] | None = None
        """The closing response object, once the stream has ended (completed, incomplete or failed)."""
        self.tail = b""
        """The closing event, which ``close`` sends."""

    def feed(self, chunk: bytes) -> bytes:
        out = self._start()
        self.pending += chunk
        while (end := _EVENT_END.search(self.pending)) is not None:
            block, self.pending = self.pending[:end.start()], self.pending[end.end():]
            out += self._block(block)
        return out

    def close(self) -> bytes:
        """The stream ended: the closing event (held back until now, so the response can be kept first, and the
        engine's closing comments come before it); if it never finished, the client learns it broke off."""
        out = self._start() + self.feed(b"\n\n" if self.pending.strip() else b"")
        if not self.done:
            out += self._failed("upstream_stream_ended", "The upstream's stream ended before the answer was complete.")
        tail, self.tail = self.tail, b""
        return out + tail

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        response = self.frame.response("in_progress", [], None)
        return self._emit("response.created", response=response) + self._emit("response.in_progress",
                                                                                response=response)

    def _block(self, block: bytes) -> bytes:
        out, chunk, name = parsed_event(block)
        if chunk is None or self.done:
            return out
        if name == CARRIER_EVENT and isinstance(chunk, dict):
            return self._carried(chunk)
        if chunk is _DONE:
            return out + self._completed()
        if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):
            error = chunk["error"]
            return out + self._failed(str(error.get("code") or error.get("type") or "upstream_error"),
                                      str(error.get("message") or ""), error.get("param"))
        return out + self._chunk(chunk) if isinstance(chunk, dict) else out

    def _chunk(self, chunk: dict[str, Any]) -> bytes:
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        out = b""
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            for kind, text in _texts(delta):
                out += self._delta(kind, None, text)
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _call(self, call: dict[str, Any]) -> bytes:
        function = call.get("function") or {}
        out = b""
        if self.current is None or self.current.key != ("call", call.get("index", 0)):
            out += self._open(_Open("call", call.get("index", 0), call.get("id") or "", function.get("name") or ""))
        elif function.get("name"):
            self.current.name += function["name"]
        return out + self._append(function.get("arguments") or "")

    def _delta(self, kind: str, index: int | None, text: str) -> bytes:
        out = b"" if self.current is not None and self.current.key == (kind, index) else self._open(
            _Open(kind, index))
        return out + self._append(text)

    def _open(self, item: _Open) -> bytes:
        out = self._close()
        self.current, item.output_index = item, len(self.output)
        added = _item(self.frame, item, "in_progress")
        out += self._emit("response.output_item.added", output_index=item.output_index, item=added)
        if item.kind in _MESSAGES:
            part = message_item(self.frame, 0, "", refusal=item.kind == "refusal")["content"][0]
            out += self._emit("response.content_part.added", item_id=added["id"], output_index=item.output_index,
                              content_index=0, part=part)
        return out

    def _append(self, text: str) -> bytes:
        item = self.current
        assert item is not None
        item.text += text
        if not text:
            return b""
        where = {"item_id": _item(self.frame, item, "in_progress")["id"], "output_index": item.output_index}
        if item.kind == "call":
            return self._emit("response.function_call_arguments.delta", **where, delta=text)
        return self._emit(f"response.{_PARTS[item.kind]}.delta", **where, content_index=0, delta=text,
                          **({"logprobs": []} if item.kind == "message" else {}))

    def _close(self) -> bytes:
        item, self.current = self.current, None
        if item is None:
            return b""
        done = _item(self.frame, item, "completed")
        where = {"item_id": done["id"], "output_index": item.output_index}
        if item.kind == "call":
            out = self._emit("response.function_call_arguments.done", **where, name=done["name"],
                             arguments=item.text)
        else:
            said: dict[str, Any] = {"refusal": item.text} if item.kind == "refusal" else {"text": item.text} | (
                {"logprobs": []} if item.kind == "message" else {})
            out = self._emit(f"response.{_PARTS[item.kind]}.done", **where, content_index=0, **said)
            if item.kind in _MESSAGES:
                out += self._emit("response.content_part.done", **where, content_index=0, part=done["content"][0])
        self.output.append(done)
        return out + self._emit("response.output_item.done", output_index=item.output_index, item=done)

    def _carried(self, item: Item) -> bytes:
        out = self._close()
        index = len(self.output)
        self.output.append(item)
        return out + self._emit("response.output_item.added", output_index=index, item=item) + self._emit(
            "response.output_item.done", output_index=index, item=item)

    def _completed(self) -> bytes:
        out = self._close()
        self.done = True
        status, incomplete = status_of(self.finish_reason)
        response = self.response = self.frame.response(status, self.output, responses_usage(self.usage), incomplete)
        self.tail = self._emit(f"response.{status}", response=response)
        return out

    def _failed(self, code: str, message: str, param: Any = None) -> bytes:
        out = self._close()
        self.done = True
        out += self._emit("error", code=code, message=message, param=param)
        response = self.response = self.frame.response("failed", self.output, responses_usage(self.usage),
                                                       error={"code": code, "message": message})
        self.tail = self._emit("response.failed", response=response)
        return out



def parsed_event(block: bytes) -> tuple[bytes, Any, bytes]:
    """An SSE event's comment lines (passed on as they are), its data (a JSON value, ``_DONE``, or None) and its
    name (``b""`` when unnamed)."""
    lines = block.splitlines()
    comments = b"".join(line + b"\n" for line in lines if line.startswith(b":"))
    data = b"\n".join(line[5:].lstrip() for line in lines if line.startswith(b"data:"))
    name = next((line[6:].strip() for line in lines if line.startswith(b"event:")), b"")
    comments += b"\n" if comments else b""
    if data == b"[DONE]":
        return comments, _DONE, name
    try:
        return comments, orjson.loads(data) if data else None, name
    except orjson.JSONDecodeError:
        return comments, None, name


_TEXTS = (("reasoning_content", "reasoning"), ("content", "message"), ("refusal", "refusal"))
"""A chat delta's texts, and the kind of output item each streams into."""


def _texts(delta: dict[str, Any]) -> list[tuple[str, str]]:
    return [(kind, delta[key]) for key, kind in _TEXTS if isinstance(delta.get(key), str) and delta[key]]


def _item(frame: Frame, item: _Open, status: str) -> Item:
    """The output item as it stands: empty while it is being streamed, whole once done."""
    index = item.output_index
    if item.kind == "call":
        return function_call_item(frame, index, item.call_id, item.name, item.text, status)
    if item.kind in _MESSAGES:
        refusal = item.kind == "refusal"
        return message_item(frame, index, item.text, status, refusal) if status == "completed" else {
            **message_item(frame, index, "", status), "content": []}
    return reasoning_item(frame, index, item.text) if status == "completed" else {
        **reasoning_item(frame, index, ""), "content": []}


class _Open:
    """The output item being streamed: its kind (message, reasoning, call), text or arguments so far."""

    def __init__(self, kind: str, index: int | None, call_id: str = "", name: str = "") -> None:
        self.kind, self.index, self.call_id, self.name = kind, index, call_id, name
        self.text = ""
        self.output_index = 0

    @property
    def key(self) -> tuple[str, int | None]:
        return self.kind, self.index
