"""Relaying a streamed answer while taking out the model's context-tool calls, chunk by chunk.

An OpenAI stream sends a tool call in pieces: the first delta of a call carries its ``index``, ``id`` and
``function.name``, later ones only argument fragments. ``StreamFilter`` forwards text as it comes and each agent
tool-call delta as soon as its call's name shows it is the agent's (renumbering indexes so the agent sees 0, 1, …
with no gap); it swallows the deltas of context-tool calls and assembles them for the proxy to execute. The
``finish_reason`` chunk, the usage chunk and ``[DONE]`` are held back: whether this answer is the last one of the
client's stream is only known once it has ended.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.answers import parse_chunk
from proxy.tools.blocks import extract_blocks
from proxy.tools.schemas import TOOL_NAMES

_OPEN = "```context"
_OPENING = re.compile(r"```context[ \t]*\n")


def _opening(text: str) -> int:
    """Where a context block opens in ``text``: -1 for nowhere, -2 when it may open at the very end."""
    match = _OPENING.search(text)
    if match:
        return match.start()
    tail = text.rfind(_OPEN)
    return -2 if tail >= 0 and not text[tail + len(_OPEN):].strip(" \t") else -1

__all__ = ["StreamFilter"]


@dataclass
class _Call:
    id: str = ""
    name: str = ""
    arguments: str = ""
    ours: bool | None = None
    held: list[dict[str, Any]] = field(default_factory=list)


class StreamFilter:
    def __init__(self, agent_tools: frozenset[str], blocks: bool = False) -> None:
        self._blocks = blocks
        """Text-protocol route: ``context`` blocks in the text are calls, held back and taken out."""
        self._hold = ""
        self._eat_newline = False
        self._block_calls: list[dict[str, Any]] = []
        self.forwarded = ""
        """The text the agent received (without the context blocks)."""
        self._ours_names = TOOL_NAMES - agent_tools
        self._all_names = self._ours_names | agent_tools
        self._calls: dict[int, _Call] = {}
        self._agent_index: dict[int, int] = {}
        self._buffer = b""
        self._cr = b""
        self.finish: dict[str, Any] | None = None
        """The held finish_reason chunk of this answer."""
        self.usage: dict[str, Any] | None = None
        """The held usage chunk of this answer (``stream_options.include_usage``)."""
        self.text = ""
        """The answer's text so far (spliced back with its context calls in a follow-up round)."""

    @property
    def context_calls(self) -> list[dict[str, Any]]:
        native = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                  for _, c in sorted(self._calls.items()) if c.ours]
        return native + self._block_calls

    @property
    def agent_calls(self) -> int:
        return len(self._agent_index)

    def closing(self, final_reason: str | None = None) -> Iterator[bytes]:
        """The held tail of the client's stream: the finish chunk (its reason replaced when the context calls it
        announced were taken out), the usage chunk, then ``[DONE]``."""
        if self.finish is not None:
            finish = self.finish
            if final_reason is not None:
                choice = finish["choices"][0]
                finish = {**finish, "choices": [{**choice, "finish_reason": final_reason}]}
            yield b"data: " + orjson.dumps(finish) + b"\n\n"
        if self.usage is not None:
            yield b"data: " + orjson.dumps(self.usage) + b"\n\n"
        yield b"data: [DONE]\n\n"

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The bytes to forward for ``data`` (any slice of the upstream's stream; CRLF or LF line endings)."""
        data = self._cr + data
        self._cr = b"\r" if data.endswith(b"\r") else b""  # a CRLF may be cut between two chunks: wait for its LF
        data = data[:-1] if self._cr else data
        self._buffer += data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            out = self._event(event)
            if out is not None:
                yield out + b"\n\n"

    def flush(self) -> Iterator[bytes]:
        """At the end of the upstream's stream: a last event without its blank line, any call still held, and held
        text (an unclosed ``context`` block was no call: the agent gets it as text)."""
        if self._hold:
            text, self._hold = self._hold, ""
            if _opening(text) == 0:  # a block the answer never closed (cut off by max_tokens): ours, not the agent's
                text = ""
            self.forwarded += text
            yield b"data: " + orjson.dumps({"object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"content": text}, "finish_reason": None}]}) + b"\n\n"
        self._buffer += self._cr.replace(b"\r", b"\n")
        self._cr = b""
        if self._buffer.strip():
            out = self._event(self._buffer.strip())
            if out is not None:
                yield out + b"\n\n"
        self._buffer = b""
        released = self._settle()
        if released:
            yield b"data: " + orjson.dumps({"object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"tool_calls": released}, "finish_reason": None}]}) + b"\n\n"

    def _event(self, event: bytes) -> bytes | None:
        if not event.startswith(b"data:"):
            return event  # comments, named events: not ours to judge
        payload = event[5:].strip()
        if payload == b"[DONE]":
            return None
        chunk = parse_chunk(payload)  # raises UpstreamMalformed: the relay ends the stream with an error event
        return self._chunk(chunk, event)

    def _chunk(self, chunk: Any, raw: bytes) -> bytes | None:
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not choices:
            if isinstance(chunk, dict) and chunk.get("usage"):
                self.usage = chunk
                return None
            return raw
        choice = choices[0]
        delta = choice.get("delta") or {}
        said = str(delta.get("content") or "")
        self.text += said
        calls = delta.get("tool_calls")
        if self._blocks and said:
            shown = self._text(said)
            self.forwarded += shown
            if shown != said:
                delta = {**delta, "content": shown} if shown else {k: v for k, v in delta.items() if k != "content"}
                chunk = {**chunk, "choices": [{**choice, "delta": delta}, *choices[1:]]}
                raw = b"data: " + orjson.dumps(chunk)
                if not delta and not choice.get("finish_reason"):
                    return None
        elif said:
            self.forwarded += said
        if not calls and not choice.get("finish_reason"):
            return raw  # text, role, reasoning: as it came
        kept = [d for call in calls or [] for d in self._tool_delta(call)]
        if choice.get("finish_reason"):
            kept += self._settle()
            self.finish = {**chunk, "choices": [{**choice, "delta": {}}]}
        rest = {k: v for k, v in delta.items() if k != "tool_calls"}
        if kept:
            rest["tool_calls"] = kept
        if not rest:
            return None
        return b"data: " + orjson.dumps({**chunk, "choices": [{**choice, "delta": rest, "finish_reason": None}]})

    def _text(self, said: str) -> str:
        """What of the model's text can go to the agent now: everything but ``context`` blocks, and but a tail
        that may be the start of one (held until the next delta tells)."""
        if self._eat_newline and said:  # the newline that ended a block taken out in the previous delta
            said = said[1:] if said.startswith("\n") else said
            self._eat_newline = False
        self._hold += said
        out = ""
        while True:
            start = _opening(self._hold)
            if start == -2:  # "```context" at the end: whether a newline follows is not known yet
                cut = self._hold.rfind(_OPEN)
                out, self._hold = out + self._hold[:cut], self._hold[cut:]
                return out
            if start < 0:
                keep = next((n for n in range(min(len(self._hold), len(_OPEN)), 0, -1)
                             if _OPEN.startswith(self._hold[-n:])), 0)
                cut = len(self._hold) - keep
                out, self._hold = out + self._hold[:cut], self._hold[cut:]
                return out
            close = self._hold.find("```", start + len(_OPEN))
            if close < 0:
                out, self._hold = out + self._hold[:start], self._hold[start:]
                return out
            end = close + 3 + (self._hold[close + 3: close + 4] == "\n")
            self._eat_newline = end == len(self._hold) and self._hold[end - 1] != "\n"
            _, calls = extract_blocks(self._hold[start:end] + ("" if self._hold[end - 1:end] == "\n" else "\n"))
            self._block_calls += [{**c, "id": f"ctx_block_{len(self._block_calls) + n}"} for n, c in enumerate(calls)]
            out, self._hold = out + self._hold[:start], self._hold[end:]

    def _tool_delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The agent's deltas this one releases (itself, or the held ones of its call once its name is known)."""
        index = int(delta.get("index", len(self._calls) if delta.get("id") else max(self._calls, default=0)))
        call = self._calls.setdefault(index, _Call())
        function = delta.get("function") or {}
        call.id = call.id or str(delta.get("id") or "")
        call.name += str(function.get("name") or "")
        call.arguments += str(function.get("arguments") or "")
        call.held.append(delta)
        for other in self._calls.values():  # a new call started: the ones before it have their whole names
            if other is not call and other.ours is None:
                self._decide(other)
        if call.ours is None and call.name and (call.arguments or not self._may_grow(call.name)):
            self._decide(call)
        return self._release()

    def _may_grow(self, name: str) -> bool:
        """A name that is still the start of a longer known tool name may be only its first piece."""
        return any(n != name and n.startswith(name) for n in self._all_names)

    def _decide(self, call: _Call) -> None:
        call.ours = call.name in self._ours_names
        if not call.ours:
            index = next(i for i, c in self._calls.items() if c is call)
            self._agent_index[index] = len(self._agent_index)

    def _settle(self) -> list[dict[str, Any]]:
        """Decide every call still undecided (the answer ended) and release what is the agent's."""
        for call in self._calls.values():
            if call.ours is None:
                self._decide(call)
        return self._release()

    def _release(self) -> list[dict[str, Any]]:
        released = []
        for index, call in sorted(self._calls.items()):
            if call.ours is False and call.held:
                released += [{**d, "index": self._agent_index[index]} for d in call.held]
                call.held = []
            elif call.ours:
                call.held = []
        return released
