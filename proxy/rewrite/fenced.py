"""Text-protocol agents: finding the tool results inside the user messages that carry them (issue #5, part one).

Many agents on local models do not use function calling: the command sits in a fenced block of the assistant's
text, and its output comes back as the next user message, wrapped in the agent's own format. A preset knows one
such format and finds, inside a results message, the offsets of each result body (the "segments"); everything
around them is the wrapper, which is never cut. Presets:

- ``mini-swe-agent``: ``<returncode>N</returncode>`` then ``<output>…</output>``;
- ``swe-agent``: the observation, then ``(Open file: …)(Current directory: …)[(Interactive session: …)]bash-$``;
- ``cline``: one or more ``[tool for '…'] Result:`` sections (Cline, Roo Code);
- ``generic``: a message that opens with a line "Tool execution results:" (or "Tool results:") alone.

A person's message must never be mistaken for results: a user message counts only when it directly follows an
assistant message and matches a preset whole; when unsure, it is the person's. Pure: no I/O.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PRESETS", "Preset", "ResultsMessage", "Segment", "find_results", "parse_preset", "presets_for", "route_of"]


@dataclass(frozen=True)
class Segment:
    """A result body inside a results message: ``content[start:end]``."""

    start: int
    end: int


@dataclass(frozen=True)
class Preset:
    name: str
    pattern: re.Pattern[str]
    """Matches a whole results message; its ``body`` group (one or more matches, for ``repeat``) is a result."""
    repeat: bool = False
    """The pattern is a section header found repeatedly; each body runs to the next header or the end."""

    def segments(self, content: str) -> list[Segment] | None:
        if self.repeat:
            return _sections(self.pattern, content)
        match = self.pattern.fullmatch(content)
        return [Segment(match.start("body"), match.end("body"))] if match else None


def _sections(header: re.Pattern[str], content: str) -> list[Segment] | None:
    heads = list(header.finditer(content))
    if not heads or heads[0].start() != 0:
        return None
    ends = [h.start() for h in heads[1:]] + [len(content)]
    return [Segment(h.end(), end) for h, end in zip(heads, ends, strict=True)]


PRESETS: tuple[Preset, ...] = (
    Preset("mini-swe-agent", re.compile(
        r"<returncode>-?\d+</returncode>\n(?:<warning>.*?</warning>\n)?<output>\n?(?P<body>.*?)\n?</output>\s*",
        re.S)),
    Preset("swe-agent", re.compile(
        r"(?P<body>.*?)\n?\(Open file: [^\n]*\)\n\(Current directory: [^\n]*\)\n"
        r"(?:\(Interactive session: [^\n]*\)\n)?bash-\$\s*", re.S)),
    Preset("cline", re.compile(r"^\[[\w.-]+(?: for '[^'\n]*')?\] Result:[ \t]*\n", re.M), repeat=True),
    Preset("generic", re.compile(r"(?:tool execution results?|tool results?)[ \t]*:[ \t]*\n(?P<body>.+)", re.S | re.I)),
)


def parse_preset(name: str, pattern: str) -> Preset:
    """A preset from the settings: ``pattern`` must match a whole results message and name its ``body``."""
    compiled = re.compile(pattern, re.S)
    if "body" not in compiled.groupindex:
        raise ValueError(f"preset {name!r}: the pattern needs a named group (?P<body>...) for the result")
    return Preset(name, compiled)


@dataclass(frozen=True)
class ResultsMessage:
    index: int
    """Position of the user message in the conversation."""
    round: int
    """The assistant round it answers: 1 for the first assistant message, and so on."""
    preset: str
    segments: tuple[Segment, ...]


def find_results(messages: Sequence[dict[str, Any]], presets: Sequence[Preset] = PRESETS) -> list[ResultsMessage]:
    """Every user message that carries the results of the assistant round before it, with its segments."""
    found, round_ = [], 0
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            round_ += 1
            continue
        if message.get("role") != "user" or i == 0 or messages[i - 1].get("role") != "assistant":
            continue
        content = message.get("content")
        if not isinstance(content, str):
            continue
        for preset in presets:
            segments = preset.segments(content)
            if segments:
                found.append(ResultsMessage(i, round_, preset.name, tuple(segments)))
                break
    return found


@functools.lru_cache(maxsize=32)
def presets_for(custom: tuple[tuple[str, str], ...]) -> tuple[Preset, ...]:
    """The operator's presets (tried first), then the built-in ones. Compiled once per configuration."""
    return (*(parse_preset(name, pattern) for name, pattern in custom), *PRESETS)


def route_of(messages: Sequence[dict[str, Any]], tools: Any, setting: str,
             presets: Sequence[Preset] = PRESETS) -> str:
    """``native`` when the request carries tools or tool messages, ``fenced`` when a preset recognises its history
    (or the setting says so), else ``native``: a plain conversation has nothing to find."""
    if setting in ("native", "fenced"):
        return setting
    if tools or any(m.get("role") == "tool" for m in messages):
        return "native"
    return "fenced" if find_results(messages, presets) else "native"
