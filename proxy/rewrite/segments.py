"""Cutting inside a text-protocol results message, result by result (issue #5, part two).

A fenced results message (``proxy.rewrite.fenced``) holds one or more result bodies inside the agent's wrapper.
Each body is cut like a native tool result — spilled when it arrives oversized, elided when the budget is crossed
— and the message goes out with its wrapper intact and each cut body replaced by its stub. A decision names the
message's identity and the segment: ``<identity>@<k>``; the handle the model sees is ``r<round>.<k+1>``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.rewrite.fenced import Segment

__all__ = ["FencedResult", "compose", "fenced_command", "paste_segment", "segment_target", "wrapper_intact"]

_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)


@dataclass(frozen=True)
class FencedResult:
    """What the state keeps of a results message: its round, its segments and the command that produced them."""

    round: int
    segments: tuple[Segment, ...]
    command: str


def paste_segment(content: str, paste_chars: int) -> Segment | None:
    """The pasted attachment in a person's message, if one is larger than ``paste_chars``: its largest fenced
    block, or everything between the first and the last paragraph (the words typed around a paste). A message
    that is one long paragraph gives no way to tell typed words from a paste: it stays the person's."""
    if len(content) < paste_chars:
        return None
    blocks = [m.span(1) for m in _FENCE.finditer(content)]
    if blocks:
        start, end = max(blocks, key=lambda b: b[1] - b[0])
        if end - start >= paste_chars:
            return Segment(start, end)
    first, last = content.find("\n\n"), content.rfind("\n\n")
    if 0 <= first < last and last - first - 2 >= paste_chars:
        return Segment(first + 2, last)
    return None


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
