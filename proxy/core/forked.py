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
from typing import Any

from ctxproxy.proxy.core.identity import identity_base
from ctxproxy.proxy.core.state import State

__all__ = ["prefix_state"]


def prefix_state(state: State, length: int, messages: Sequence[dict[str, Any]], hashes: Sequence[str],
                 absorbed: int) -> State | None:
    """The state of a projection of ``messages[:length]`` under the decisions ``state`` reflects, taken from
    ``state`` (the parent's, left as it was); None when it cannot be (then recompute from the decisions).

    ``messages``, ``hashes``: the fork's, whose first ``length`` equal the parent's; ``absorbed``: how many
    decisions the fork's session has (the parent's, all inherited: otherwise this is not its state)."""
    if not _within(state, length, hashes, absorbed):
        return None
    out = state.out[:length]
    calls, call_spans = _calls(state, length, messages)
    return State(
        hashes=state.hashes[:length], ids=state.ids[:length], out=out, out_hashes=state.out_hashes[:length],
        counts=state.counts[:length], total=sum(state.counts[:length]), seen=_seen(state, length, messages, hashes),
        calls=calls, call_spans=call_spans,
        result_calls={i: call for i, call in state.result_calls.items() if i < length},
        tool_indices=state.tool_indices[:bisect_left(state.tool_indices, length)],
        call_indices=state.call_indices[:bisect_left(state.call_indices, length)],
        user_indices=state.user_indices[:bisect_left(state.user_indices, length)],
        fenced={i: result for i, result in state.fenced.items() if i < length},
        rounds=_rounds(state, length, messages),
        decided=dict(state.decided), pins=dict(state.pins), fold=state.fold,
        fold_sum=state.fold_sum if state.fold_sum is not None and state.fold_sum.end <= length else None,
        folded=state.folded, cut=sum(a != b for a, b in zip(state.out_hashes[:length], state.hashes, strict=False)),
        absorbed=absorbed, settled=min(state.settled, length))


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


def _calls(state: State, length: int, messages: Sequence[dict[str, Any]]) -> tuple[dict[str, tuple[str, str]],
                                                                                  dict[str, tuple[int, int]]]:
    """The latest call per tool_call_id in the first ``length`` messages, and where each id is called: the parent's
    for the ids last called before ``length``; walked in those messages when an id is called on both sides of it
    (its call before ``length`` is then not the parent's latest)."""
    calls: dict[str, tuple[str, str]] = {}
    spans: dict[str, tuple[int, int]] = {}
    for call_id, (first, last) in state.call_spans.items():
        if last < length:
            calls[call_id], spans[call_id] = state.calls[call_id], (first, last)
        elif first < length:
            return _walked_calls(messages[:length])
    return calls, spans


def _walked_calls(messages: Sequence[dict[str, Any]]) -> tuple[dict[str, tuple[str, str]],
                                                               dict[str, tuple[int, int]]]:
    """``_calls`` as ``project`` records them when it ingests ``messages``."""
    calls: dict[str, tuple[str, str]] = {}
    spans: dict[str, tuple[int, int]] = {}
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or ():
            function, call_id = call.get("function") or {}, call.get("id", "")
            calls[call_id] = (str(function.get("name", "?")), str(function.get("arguments") or ""))
            spans[call_id] = (spans.get(call_id, (i, i))[0], i)
    return calls, spans
