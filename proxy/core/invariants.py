"""The invariants of DESIGN.md §6, checked on a projection: a list of what is wrong (empty when all holds).

- every tool call that had its result still has it, and every result its call (a call and its result are cut or
  folded together, never apart);
- system, user and assistant messages are byte-identical, except where a fold stub stands for whole rounds;
- a cut tool result keeps its place, role and ``tool_call_id``: only its content changes;
- an assistant message with an argument cut keeps its text and each call's id, type and name: only arguments
  change, and they stay a JSON object;
- pinned messages are byte-identical.

The proxy runs it on every request it forwards: ``violations_since`` on what changed since the session's last
checked projection (a fold pass at 600 rounds compared all 1,300 messages again), ``violations`` on a projection
recomputed from the decisions; the property tests run both on every generated history.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ctxproxy.proxy.core.fenced import Segment, text_of
from ctxproxy.proxy.core.segments import wrapper_intact

__all__ = ["Pairs", "broken_pairs", "violations", "violations_since"]

_FOLD = re.compile(r"^\[folded id=[0-9a-f]{64} messages=(\d+) ")
_KEPT_ROLES = ("system", "developer", "user", "assistant")


def broken_pairs(messages: Sequence[dict[str, Any]]) -> Counter[str]:
    """Calls with no result after them and results with no call before them, by id (agents reuse ids: a result
    answers the oldest open call of its id). An id whose calls are all answered is let go as it closes, so a long
    history costs one pass over its messages, not a sum over every id it ever used."""
    return Pairs().extended(messages).broken()


@dataclass(frozen=True)
class Pairs:
    """``broken_pairs``'s walk, stopped after some messages and continued later (``extended``): a fold that grows
    walks only the messages it adds (``proxy.core.state.FoldSum``). Never mutated."""

    open_calls: Mapping[str, int] = field(default_factory=dict)
    orphans: Mapping[str, int] = field(default_factory=dict)

    def extended(self, messages: Iterable[dict[str, Any]]) -> Pairs:
        open_calls, orphans = dict(self.open_calls), dict(self.orphans)
        for m in messages:
            for call in m.get("tool_calls") or ():
                cid = str(call.get("id"))
                open_calls[cid] = open_calls.get(cid, 0) + 1
            if m.get("role") == "tool":
                cid = str(m.get("tool_call_id"))
                waiting = open_calls.get(cid, 0)
                if waiting > 1:
                    open_calls[cid] = waiting - 1
                elif waiting:
                    del open_calls[cid]
                else:
                    orphans[cid] = orphans.get(cid, 0) + 1
        return Pairs(open_calls, orphans)

    def broken(self) -> Counter[str]:
        return Counter(self.open_calls) + Counter(self.orphans)


def violations(incoming: Sequence[dict[str, Any]], outgoing: Sequence[dict[str, Any]],
               pinned: Collection[int] = (), start: int = 0, pairs: bool = True,
               fenced: Mapping[int, Sequence[Segment]] | None = None, hidden: Collection[int] = ()) -> list[str]:
    """``pinned``: incoming indices of pinned messages; ``start``: check from this incoming index on (the
    messages before it were checked on an earlier request and have not changed since); ``pairs=False`` skips the
    pairing walk when nothing but contents changed since it last held; ``fenced``: the text-protocol results
    messages (index → segments), whose result bodies may be cut as long as their wrapper stays."""
    problems: list[str] = []
    # Before ``start`` nothing changed since the last check: any fold lies before it, so the lists line up from
    # there with a constant offset.
    i, j = start, start - (len(incoming) - len(outgoing))
    if j < 0 or hidden:
        i = j = 0
    while i < len(incoming) and j < len(outgoing):
        if i in hidden:  # taken out whole (a round of the agent's mirror edits); its pairs go with it
            i += 1
            continue
        folded = _folded_count(outgoing[j])
        if folded:
            problems += [f"message {x} (pinned) is folded" for x in range(i, i + folded) if x in pinned]
            i, j = i + folded, j + 1
            continue
        if i >= start:
            segments = (fenced or {}).get(i)
            problems += _compare(i, incoming[i], outgoing[j], i in pinned) if segments is None else \
                _compare_fenced(i, incoming[i], outgoing[j], segments)
        i, j = i + 1, j + 1
    while i < len(incoming) and i in hidden:
        i += 1
    if i != len(incoming) or j != len(outgoing):
        problems.append(f"lengths do not line up: {len(incoming)} in, {len(outgoing)} out")
    extra = broken_pairs(outgoing) - broken_pairs(incoming) if pairs else Counter[str]()
    problems += [f"tool call {cid} lost its pair" for cid in sorted(extra)]
    return problems


def violations_since(incoming: Sequence[dict[str, Any]], outgoing: Sequence[dict[str, Any]], start: int,
                     changed: Collection[int], folded: tuple[int, int] | None, fold_changed: bool,
                     pinned: Collection[int] = (), fenced: Mapping[int, Sequence[Segment]] | None = None,
                     span_pairs: Pairs | None = None) -> list[str]:
    """``violations`` of a projection that extends one already checked, in O(what changed): the messages before
    ``start`` are those of the checked projection (same incoming hashes, same outgoing messages) but for the
    ``changed`` ones (cut or folded away since); ``folded``: the span the one fold stub stands for, if any;
    ``fold_changed``: it was made or extended since (else its span is one the check saw). No hides.

    The same problems are found as by the whole walk where it finds any that matter: each compared message as
    there; the fold stub where ``folded`` says (its count read from it), and the lengths that follow from it. A
    pair can be broken only by the fold (a compared message keeps its ids): the span is walked alone and, when
    its calls and results do not close within it, every pair of both lists is compared as there. A span that
    closes on its own leaves the walk of the messages around it as it was (``tests/test_project.py``).
    ``span_pairs``: that walk of the span, if already made (``FoldSum.pairs``)."""
    begin, end = folded or (len(incoming), len(incoming))
    offset = end - begin - 1 if folded else 0
    if len(outgoing) != len(incoming) - offset or (folded and _folded_count(outgoing[begin]) != end - begin):
        return [f"lengths do not line up: {len(incoming)} in, {len(outgoing)} out"]
    problems = [f"message {x} (pinned) is folded" for x in sorted(pinned) if begin <= x < end]
    for i in sorted({*changed, *range(start, len(incoming))}):
        if begin <= i < end:
            continue
        after = outgoing[i - offset if i >= end else i]
        if _folded_count(after):
            problems.append(f"message {i} is a fold stub where no fold is")
            continue
        segments = (fenced or {}).get(i)
        problems += _compare(i, incoming[i], after, i in pinned) if segments is None else \
            _compare_fenced(i, incoming[i], after, segments)
    if folded and fold_changed:
        walked = span_pairs if span_pairs is not None else Pairs().extended(incoming[begin:end])
        if walked.broken():
            extra = broken_pairs(outgoing) - broken_pairs(incoming)
            problems += [f"tool call {cid} lost its pair" for cid in sorted(extra)]
    return problems


def _folded_count(message: dict[str, Any]) -> int:
    content = message.get("content")
    match = _FOLD.match(content) if message.get("role") == "user" and isinstance(content, str) else None
    return int(match.group(1)) if match else 0


def _compare_fenced(i: int, before: dict[str, Any], after: dict[str, Any], segments: Sequence[Segment]) -> list[str]:
    if after is before or after == before:
        return []
    intact = wrapper_intact(text_of(before.get("content")) or "", text_of(after.get("content")) or "", segments)
    if _without_content(after) != _without_content(before) or not intact:
        return [f"message {i} (results) changed outside its result bodies"]
    return []


def _without_content(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k != "content"}


def _compare(i: int, before: dict[str, Any], after: dict[str, Any], pinned: bool) -> list[str]:
    if after is before or after == before:
        return []
    if pinned:
        return [f"message {i} is pinned but changed"]
    if before.get("role") == "assistant" and _only_arguments(before, after):
        return []
    if before.get("role") in _KEPT_ROLES:
        return [f"message {i} ({before.get('role')}) changed"]
    if {**after, "content": None} != {**before, "content": None}:  # all but the content, compared in C
        return [f"message {i} ({before.get('role')}) changed more than its content"]
    return []


def _only_arguments(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Only call arguments changed (an argument cut): the text, each call's id, type and name as they were, and
    the new arguments still a JSON object."""
    calls, cut = before.get("tool_calls") or [], after.get("tool_calls") or []
    if _without(before, "tool_calls") != _without(after, "tool_calls") or len(calls) != len(cut):
        return False
    for a, b in zip(calls, cut, strict=True):
        fa, fb = a.get("function") or {}, b.get("function") or {}
        if _without(a, "function") != _without(b, "function") or _without(fa, "arguments") != _without(fb,
                                                                                                    "arguments"):
            return False
        if fa.get("arguments") != fb.get("arguments") and not _json_object(fb.get("arguments")):
            return False
    return True


def _without(message: Any, key: str) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k != key} if isinstance(message, dict) else {}


def _json_object(text: Any) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (TypeError, ValueError):
        return False
