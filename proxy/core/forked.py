"""A fork's projection from its parent's: the parent's state cut to the history they share.

A fork (an edited earlier message, a retry from further back) opens a session that inherits every decision its
parent had made and shares the parent's first ``length`` messages. Recomputed from those decisions, the fork's
projection of the shared messages is, message for message, what the parent's state already holds for them: the
same decisions re-applied to the same messages. So rather than re-ingest a 600-round history (about 6 ms), the
fork starts from the parent's state cut to ``length`` and ingests only the messages that are its own.

That holds while nothing the parent did reaches past the shared part: a fold whose span ends after ``length``
would not apply to the fork's messages (its digest covers the parent's), and a hide is applied to the whole history
only on a recomputation; either makes ``prefix_state`` give None, and the fork is recomputed from the decisions.
The cut copies what ``project`` extends in place, so the parent's state is never touched.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any, TypeVar

from ctxproxy.proxy.core.identity import identity_base
from ctxproxy.proxy.core.state import State

__all__ = ["prefix_state"]

T = TypeVar("T")


def prefix_state(state: State, length: int, messages: Sequence[dict[str, Any]], hashes: Sequence[str],
                 absorbed: int) -> State | None:
    """The state of a projection of ``messages[:length]`` under the decisions ``state`` reflects, taken from
    ``state`` (the parent's, left as it was); None when it cannot be (then recompute from the decisions).

    ``messages``, ``hashes``: the fork's, whose first ``length`` equal the parent's; ``absorbed``: how many
    decisions the fork's session has (the parent's, all inherited: otherwise this is not its state)."""
    if not _within(state, length, hashes, absorbed):
        return None
    out = state.out[:length]
    calls, call_spans, recalled = _calls(state, length, messages)
    return State(
        hashes=state.hashes[:length], ids=state.ids[:length], out=out, out_hashes=state.out_hashes[:length],
        counts=state.counts[:length], total=_sum_before(state.total, state.counts, length),
        seen=_seen(state, length, messages, hashes), calls=calls, call_spans=call_spans,
        recalled=recalled, result_calls=_before(state.result_calls, length),
        tool_indices=state.tool_indices[:bisect_left(state.tool_indices, length)],
        call_indices=state.call_indices[:bisect_left(state.call_indices, length)],
        user_indices=state.user_indices[:bisect_left(state.user_indices, length)],
        fenced=_before(state.fenced, length),
        rounds=_rounds(state, length, messages),
        decided=dict(state.decided), pins=dict(state.pins), fold=state.fold,
        fold_sum=state.fold_sum if state.fold_sum is not None and state.fold_sum.end <= length else None,
        folded=state.folded, cut=_cut_before(state, length), absorbed=absorbed, settled=min(state.settled, length))


def _sum_before(total: int, counts: Sequence[int], length: int) -> int:
    """``sum(counts[:length])``, ``total`` being the sum of all: summed on the shorter side of ``length``."""
    return sum(counts[:length]) if length <= len(counts) - length else total - sum(counts[length:])


def _cut_before(state: State, length: int) -> int:
    """How many of the first ``length`` messages go upstream changed (``State.cut`` counts all of them)."""
    if length <= len(state.hashes) - length:
        return sum(a != b for a, b in zip(state.out_hashes[:length], state.hashes, strict=False))
    return state.cut - sum(a != b for a, b in zip(state.out_hashes[length:], state.hashes[length:], strict=True))


def _before(by_index: dict[int, T], length: int) -> dict[int, T]:
    """The entries of a dict keyed by message index whose index is below ``length``. Its keys ascend (the messages
    are ingested in order, and a fork's dict is cut from its parent's, then extended), so the copy loses its last
    ones (``popitem``), and a fork near the end of a long history copies rather than filters."""
    kept = dict(by_index)
    while kept and next(reversed(kept)) >= length:
        kept.popitem()
    return kept


def _within(state: State, length: int, hashes: Sequence[str], absorbed: int) -> bool:
    """Whether the parent's state projects the shared messages as the fork's recomputation would."""
    if state.absorbed != absorbed or absorbed < 0 or not 0 < length <= len(state.hashes) or len(hashes) < length:
        return False
    if state.hides or (state.folded is not None and state.folded[1] > length):
        return False  # a hide or a fold reaching past the shared messages: recompute
    return state.hashes[:length] == list(hashes[:length])


def _seen(state: State, length: int, messages: Sequence[dict[str, Any]], hashes: Sequence[str]) -> dict[str, int]:
    """How often each identity base occurs in the first ``length`` messages: counted in them, or, when fewer messages
    follow them, the parent's counts less those (an outgoing message keeps its role and ``tool_call_id``, all an
    identity base reads). A new run forks a long session at its opening: 2 messages counted, not 120 subtracted."""
    if length <= len(state.hashes) - length:
        seen: dict[str, int] = {}
        for first, first_hash in zip(messages[:length], hashes[:length], strict=True):
            base = identity_base(first, first_hash)
            seen[base] = seen.get(base, 0) + 1
        return seen
    seen = dict(state.seen)
    for message, message_hash in zip(state.out[length:], state.hashes[length:], strict=True):
        assert message is not None  # no fold or hide reaches past ``length`` (``_within``)
        base = identity_base(message, message_hash)
        seen[base] -= 1
        if not seen[base]:
            del seen[base]
    return seen


def _rounds(state: State, length: int, messages: Sequence[dict[str, Any]]) -> int:
    """The assistant messages among the first ``length``: counted in them, or the parent's less those after them."""
    if length <= len(state.hashes) - length:
        return sum(1 for m in messages[:length] if m.get("role") == "assistant")
    return int(state.rounds) - sum(1 for m in state.out[length:] if m is not None and m.get("role") == "assistant")


Calls = tuple[dict[str, tuple[str, str]], dict[str, tuple[int, int]], set[str]]
"""``State.calls``, ``State.call_spans``, ``State.recalled``."""


def _calls(state: State, length: int, messages: Sequence[dict[str, Any]]) -> Calls:
    """The latest call per tool_call_id in the first ``length`` messages, where each id is called, and which are
    called more than once: the parent's without the ids first called from ``length`` on, which come last (a dict
    keeps the order its keys came in); walked in those messages when an id called more than once is called on
    both sides of ``length`` (its call before ``length`` is then not the parent's latest)."""
    spans = state.call_spans
    if any(spans[c][0] < length <= spans[c][1] for c in state.recalled):
        return _walked_calls(messages[:length])
    calls, kept = dict(state.calls), dict(spans)
    for call_id, (first, _) in reversed(spans.items()):
        if first < length:
            break
        del calls[call_id], kept[call_id]
    return calls, kept, {c for c in state.recalled if c in kept}


def _walked_calls(messages: Sequence[dict[str, Any]]) -> Calls:
    """``_calls`` as ``project`` records them when it ingests ``messages``."""
    walked = State()
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or ():
            walked.called(i, call)
    return walked.calls, walked.call_spans, walked.recalled
