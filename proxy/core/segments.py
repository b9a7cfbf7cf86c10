"""Cutting inside a text-protocol results message, result by result (issue #5, part two).

A fenced results message (``proxy.core.fenced``) holds one or more result bodies inside the agent's wrapper.
Each body is cut like a native tool result — spilled when it arrives oversized, elided when the budget is crossed
— and the message goes out with its wrapper intact and each cut body replaced by its stub. A decision names the
message's identity and the segment: ``<identity>@<k>``; the handle the model sees is ``r<round>.<k+1>``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ctxproxy.proxy.core.fenced import Segment

__all__ = ["FencedResult", "compose", "fenced_command", "paste_segment", "segment_target", "wrapper_intact"]

_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)


@dataclass(frozen=True)
class FencedResult:
    """What the state keeps of a results message: its round, its segments and the command that produced them."""

    round: int
    segments: tuple[Segment, ...]
    command: str


def paste_segment(content: str, paste_chars: int, lines: bool = False) -> Segment | None:
    """The pasted attachment in a message, if one is larger than ``paste_chars``: its largest fenced or
    tag-delimited block (``<output>…</output>``, a tag opening a line and closed at a line's end), or everything
    between the first and the last paragraph (the words typed around a paste); with ``lines``, else everything
    between the first and the last line (an unknown agent's one-line header and trailer). A message that is one long
    paragraph (or line) gives no way to tell typed words from a paste: it stays whole."""
    if len(content) < paste_chars:
        return None
    blocks = [m.span(1) for m in _FENCE.finditer(content)] + _tag_blocks(content)
    if blocks:
        start, end = max(blocks, key=lambda b: b[1] - b[0])
        if end - start >= paste_chars:
            return Segment(start, end)
    for sep in ("\n\n", "\n") if lines else ("\n\n",):
        first, last = content.find(sep), content.rfind(sep)
        if 0 <= first < last and last - first - len(sep) >= paste_chars:
            return Segment(first + len(sep), last)
    return None


_OPEN = re.compile(r"^[ \t]*<([A-Za-z][\w.-]*)(?:[ \t][^<>\n]*)?>[ \t]*\n?", re.M)
_CLOSE = re.compile(r"\n?</([A-Za-z][\w.-]*)>[ \t]*$", re.M)


def _tag_blocks(content: str) -> list[tuple[int, int]]:
    """Per tag name, the span from the end of its first opening to the start of its last closing after it. Linear:
    no backtracking over a large output full of tags, closed or not."""
    opened: dict[str, int] = {}
    for m in _OPEN.finditer(content):
        opened.setdefault(m.group(1), m.end())
    closed: dict[str, int] = {}
    for m in _CLOSE.finditer(content):
        closed[m.group(1)] = m.start()
    return [(opened[name], end) for name, end in closed.items() if name in opened and end > opened[name]]


def segment_target(mid: str, k: int) -> str:
    return f"{mid}@{k}"


def fenced_command(assistant: Mapping[str, Any]) -> str:
    """The command of an assistant's text-protocol turn: the first line of its last fenced block."""
    content = assistant.get("content")
    blocks = _FENCE.findall(content) if isinstance(content, str) else []
    return blocks[-1].strip().splitlines()[0][:200] if blocks and blocks[-1].strip() else ""


def compose(content: str, segments: Sequence[Segment], replacements: Mapping[int, str]) -> str:
    """``content`` with segment ``k``'s body replaced by ``replacements[k]``; the wrapper as it was."""
    out, at = [], 0
    for k, segment in enumerate(segments):
        out.append(content[at:segment.start])
        out.append(replacements.get(k, content[segment.start:segment.end]))
        at = segment.end
    out.append(content[at:])
    return "".join(out)


def wrapper_intact(before: str, after: str, segments: Sequence[Segment]) -> bool:
    """The text around the segments is in ``after`` unchanged, in order: only result bodies were cut."""
    pieces = [before[a:b] for a, b in zip([0, *(s.end for s in segments)], [*(s.start for s in segments),
                                                                             len(before)], strict=True)]
    if not after.startswith(pieces[0]) or not after.endswith(pieces[-1]):
        return False
    at = len(pieces[0])
    for piece in pieces[1:-1]:
        found = after.find(piece, at)
        if found < 0:
            return False
        at = found + len(piece)
    return at <= len(after) - len(pieces[-1]) or len(pieces) == 1
