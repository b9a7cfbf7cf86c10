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

from ctxproxy.proxy.tools.blocks import extract_blocks
from ctxproxy.proxy.tools.schemas import TOOL_NAMES
from ctxproxy.proxy.upstream.answers import parse_chunk

_OPEN = "```context"
_OPENING = re.compile(r"```context[ \t]*\n")


def _opening(text: str) -> int:
    """Where a context block opens in ``text``: -1 for nowhere, -2 when it may open at the very end."""
    match = _OPENING.search(text)
    if match:
        return match.start()
    tail = text.rfind(_OPEN)
    return -2 if tail >= 0 and not text[tail + len(_OPEN):].strip(" \t") else -1

__all__ = ["StreamFilter", "sse_error_chunk"]


@dataclass
class _Call:
    id: str = ""
    name: str = ""
    arguments: str = ""
    ours: bool | None = None
    held: list[dict[str, Any]] = field(default_factory=list)


class _Blocks:
    """The text-protocol route's filter: ``context`` blocks in the text are calls, held back and taken out."""

    def __init__(self) -> None:
        self.hold = ""
        """Text that may be (the start of) a block: held until the next delta tells."""
        self._eat_newline = False
        self.calls: list[dict[str, Any]] = []

    def text(self, said: str) -> str:
        """What of the model's text can go to the agent now: everything but ``context`` blocks, and but a tail
        that may be the start of one (held until the next delta tells)."""
        if self._eat_newline and said:  # the newline that ended a block taken out in the previous delta
            said = said[1:] if said.startswith("\n") else said
            self._eat_newline = False
        self.hold += said
        out = ""
        while True:
            start = _opening(self.hold)
            if start < 0 or self.hold.find("```", start + len(_OPEN)) < 0:
                shown, self.hold = self._split_held(start)
                return out + shown
            close = self.hold.find("```", start + len(_OPEN))
            end = close + 3 + (self.hold[close + 3: close + 4] == "\n")
            self._eat_newline = end == len(self.hold) and self.hold[end - 1] != "\n"
            _, calls = extract_blocks(self.hold[start:end] + ("" if self.hold[end - 1:end] == "\n" else "\n"))
            self.calls += [{**c, "id": f"ctx_block_{len(self.calls) + n}"} for n, c in enumerate(calls)]
            out, self.hold = out + self.hold[:start], self.hold[end:]

    def _split_held(self, start: int) -> tuple[str, str]:
        """What can go now and what stays held, when no whole block is in the held text."""
        if start == -2:  # "```context" at the end: whether a newline follows is not known yet
            cut = self.hold.rfind(_OPEN)
        elif start < 0:  # a tail that may grow into "```context"
            keep = next((n for n in range(min(len(self.hold), len(_OPEN)), 0, -1)
                         if _OPEN.startswith(self.hold[-n:])), 0)
            cut = len(self.hold) - keep
        else:  # a block that opened and has not closed yet
            cut = start
        return self.hold[:cut], self.hold[cut:]

    def release(self) -> str | None:
        """At the end of the answer: the held text (an unclosed ``context`` block was no call: the agent gets it
        as text, unless it opens the held text: an answer cut off by max_tokens inside its block)."""
        if not self.hold:
            return None
        text, self.hold = self.hold, ""
        return "" if _opening(text) == 0 else text


class _Calls:
    """The native route's filter: tool-call deltas, the agent's released as soon as their name says so."""

    def __init__(self, agent_tools: frozenset[str]) -> None:
        self._ours_names = TOOL_NAMES - agent_tools
        self._all_names = self._ours_names | agent_tools
        self.calls: dict[int, _Call] = {}
        self.agent_index: dict[int, int] = {}
        """The agent's calls, upstream index → the index the agent sees (0, 1, … with no gap)."""

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The agent's deltas this one releases (itself, or the held ones of its call once its name is known)."""
        index = int(delta.get("index", len(self.calls) if delta.get("id") else max(self.calls, default=0)))
        call = self.calls.setdefault(index, _Call())
        function = delta.get("function") or {}
        call.id = call.id or str(delta.get("id") or "")
        call.name += str(function.get("name") or "")
        call.arguments += str(function.get("arguments") or "")
        call.held.append(delta)
        for other in self.calls.values():  # a new call started: the ones before it have their whole names
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
            index = next(i for i, c in self.calls.items() if c is call)
            self.agent_index[index] = len(self.agent_index)

    def settle(self) -> list[dict[str, Any]]:
        """Decide every call still undecided (the answer ended) and release what is the agent's."""
        for call in self.calls.values():
            if call.ours is None:
                self._decide(call)
        return self._release()

    def _release(self) -> list[dict[str, Any]]:
        released = []
        for index, call in sorted(self.calls.items()):
            if call.ours is False and call.held:
                released += [{**d, "index": self.agent_index[index]} for d in call.held]
                call.held = []
            elif call.ours:
                call.held = []
        return released

    def ours(self) -> list[dict[str, Any]]:
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for _, c in sorted(self.calls.items()) if c.ours]


class StreamFilter:
    def __init__(self, agent_tools: frozenset[str], blocks: bool = False) -> None:
        self._blocks = _Blocks() if blocks else None
        """Text-protocol route: ``context`` blocks in the text are calls, held back and taken out."""
        self._calls = _Calls(agent_tools)
        self._buffer = b""
        self._cr = b""
        self.forwarded = ""
        """The text the agent received (without the context blocks)."""
        self.finish: dict[str, Any] | None = None
        """The held finish_reason chunk of this answer."""
        self.usage: dict[str, Any] | None = None
        """The held usage chunk of this answer (``stream_options.include_usage``)."""
        self.text = ""
        """The answer's text so far (spliced back with its context calls in a follow-up round)."""

    @property
    def context_calls(self) -> list[dict[str, Any]]:
        return self._calls.ours() + (self._blocks.calls if self._blocks else [])

    @property
    def agent_calls(self) -> int:
        return len(self._calls.agent_index)

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
        """At the end of the upstream's stream: held text, a last event without its blank line, and any call
        still held."""
        held = self._blocks.release() if self._blocks else None
        if held is not None:
            self.forwarded += held
            yield _delta_event({"content": held})
        self._buffer += self._cr.replace(b"\r", b"\n")
        self._cr = b""
        if self._buffer.strip():
            out = self._event(self._buffer.strip())
            if out is not None:
                yield out + b"\n\n"
        self._buffer = b""
        released = self._calls.settle()
        if released:
            yield _delta_event({"tool_calls": released})

    def _event(self, event: bytes) -> bytes | None:
        if event.startswith(b"error:"):
            return sse_error_chunk(event)
        if not event.startswith(b"data:"):
            return event  # comments, named events: not ours to judge
        payload = event[5:].strip()
        if payload == b"[DONE]":
            return None
        chunk = parse_chunk(payload)  # raises UpstreamMalformed: the relay ends the stream with an error event
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not choices:
            if isinstance(chunk, dict) and chunk.get("usage"):
                self.usage = chunk
                return None
            return event
        return self._choice(chunk, event)

    def _choice(self, chunk: dict[str, Any], raw: bytes) -> bytes | None:
        """A chunk with choices: its text shown (but context blocks), its tool calls and finish held or released."""
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        said = str(delta.get("content") or "")
        self.text += said
        shown = self._blocks.text(said) if self._blocks and said else said
        self.forwarded += shown
        if shown != said:
            delta = {**delta, "content": shown} if shown else {k: v for k, v in delta.items() if k != "content"}
            chunk = {**chunk, "choices": [{**choice, "delta": delta}, *chunk["choices"][1:]]}
            raw = b"data: " + orjson.dumps(chunk)
            if not delta and not choice.get("finish_reason"):
                return None
        if not delta.get("tool_calls") and not choice.get("finish_reason"):
            return raw  # text, role, reasoning: as it came
        return self._calls_and_finish(chunk, choice, delta)

    def _calls_and_finish(self, chunk: dict[str, Any], choice: dict[str, Any],
                          delta: dict[str, Any]) -> bytes | None:
        kept = [d for call in delta.get("tool_calls") or [] for d in self._calls.delta(call)]
        if choice.get("finish_reason"):
            kept += self._calls.settle()
            self.finish = {**chunk, "choices": [{**choice, "delta": {}}]}
        rest = {k: v for k, v in delta.items() if k != "tool_calls"}
        if kept:
            rest["tool_calls"] = kept
        if not rest:
            return None
        return b"data: " + orjson.dumps({**chunk, "choices": [{**choice, "delta": rest, "finish_reason": None}]})


def _delta_event(delta: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps({"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": None}]}) + b"\n\n"


def sse_error_chunk(event: bytes) -> bytes:
    """llama.cpp's older servers report a streamed failure as an SSE ``error:`` field (``server_sent_event(sink,
    "error", …)``), which no client's SSE reader knows: relayed as it came, a truncated answer read as a finished
    one. It becomes the ``data: {"error": …}`` chunk every front and the OpenAI SDKs take for a failed stream."""
    payload = event[len(b"error:"):].strip()
    try:
        error = orjson.loads(payload)
    except orjson.JSONDecodeError:
        error = {"message": payload.decode("utf-8", "replace")}
    return b"data: " + orjson.dumps({"error": error if isinstance(error, dict) else {"message": str(error)}})
