"""The first cut a projection makes when it is over budget: auto-elision (the last resort, folding, is
``proxy.core.folds``).

Auto-elision (DESIGN.md §4) collapses the oldest tool results — not pinned, not among the newest
``keep_results``, not a ``read_overflow`` result — into a marker, oldest first, until the estimate is at the
target. One pass cuts deep, then nothing changes for many requests: the upstream's prefix cache survives.

How much is protected is the caller's choice (``keep_results``, ``newest``): ``project`` first cuts with the
configured protection, then, only if the request still cannot fit, squeezes with everything but the newest
result and round — losing the newer results (restorably) is better than a request the model cannot read.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

from ctxproxy.proxy.core.arguments import args_target, cut_arguments, with_arguments
from ctxproxy.proxy.core.budget import MIN_CUT_CHARS
from ctxproxy.proxy.core.decisions import Decision, OverflowWrite
from ctxproxy.proxy.core.fenced import text_of
from ctxproxy.proxy.core.identity import message_hash
from ctxproxy.proxy.core.segments import compose, segment_target
from ctxproxy.proxy.core.state import READ_OVERFLOW, Counter, Rules, State, sha256_text
from ctxproxy.proxy.core.stubs import elision_marker

__all__ = ["PRIMED_PER_REQUEST", "elide", "prime", "replace_out"]


def elide(state: State, messages: Sequence[dict[str, Any]], rules: Rules, counter: Counter,
          new: list[Decision], writes: list[OverflowWrite], keep_results: int, keep_rounds: int) -> None:
    keep = set(state.tool_indices[-keep_results:]) if keep_results else set()
    newest_round = max((r.round for r in state.fenced.values()), default=0)
    # Arguments: only the newest call is kept whole. A write's body is the model's own text, already on disk, and
    # a few of them outweigh every result: sparing them as results are spared would fold whole rounds instead.
    kept_calls = {messages[j].get("tool_call_id") for j in state.tool_indices[-1:]} if keep_results else set()
    answered = max(state.tool_indices, default=-1)
    for i in _unsettled(state, messages, sorted([*state.tool_indices, *state.fenced, *state.call_indices])):
        if rules.scaled(state.total + rules.tools_tokens) <= rules.budget.target:
            return
        if i in keep or state.out[i] is None or state.ids[i] in state.pins:
            continue
        if messages[i].get("role") == "assistant":  # an old call's arguments
            calls = {c.get("id") for c in messages[i].get("tool_calls") or []}
            if i < answered and not calls & kept_calls:
                _elide_arguments(state, i, messages[i], rules, counter, new, writes)
            continue
        if i in state.fenced:
            if state.fenced[i].round > newest_round - keep_rounds:
                continue  # the newest rounds of a text-protocol agent, as keep_results for native ones
            _elide_fenced(state, i, messages[i], rules, counter, new, writes)
            continue
        decision = _elision(state, i, messages[i], rules)
        if decision is None:
            continue
        spilled = state.decided.get(state.ids[i])
        if spilled is None or spilled.message_hash != state.hashes[i]:  # else its body is stored already
            call_id = str(messages[i].get("tool_call_id"))
            content = str(messages[i]["content"])
            writes.append(OverflowWrite(decision.overflow_id, content, state.result_calls.get(i, ("?", ""))[0],
                                        call_id, (i, i + 1), len(content.encode()), "content"))
        state.decided[state.ids[i]] = decision
        new.append(decision)
        _replace(state, i, {**messages[i], "content": decision.replacement}, counter)


def _unsettled(state: State, messages: Sequence[dict[str, Any]], candidates: list[int]) -> Iterator[int]:
    """The candidates from the first one not settled on: ``state.settled`` moves past those that are."""
    rest = iter(candidates[bisect_left(candidates, state.settled):])
    for i in rest:
        if not _settled(state, i, messages[i]):
            yield i
            break
        state.settled = i + 1
    yield from rest


def _settled(state: State, i: int, message: dict[str, Any]) -> bool:
    """Whether elision can never cut candidate ``i`` again, whatever the protection: taken out (folded, hidden), a
    result cut already (not just spilled) or too short or ``read_overflow``'s, an assistant message none of whose
    arguments is long enough or uncut; text-protocol messages never are. A pin changes none of it (pinned or not,
    such a message is not cut), and a new pin or unpin rebuilds the state. A pass starts after the settled part of
    a long history (a fold pass at 600 rounds walked all of it)."""
    if state.out[i] is None:
        return True
    mid = state.ids[i]
    if i in state.fenced:
        return False
    if message.get("role") == "assistant":
        return all(len(str((call.get("function") or {}).get("arguments") or "")) < MIN_CUT_CHARS
                   or _cut_for(state, args_target(mid, str(call.get("id"))), state.hashes[i])
                   for call in message.get("tool_calls") or [])
    content = message.get("content")
    if not isinstance(content, str) or len(content) < MIN_CUT_CHARS:
        return True
    return state.result_calls.get(i, ("?", ""))[0] == READ_OVERFLOW or _cut_for(state, mid, state.hashes[i])


def _cut_for(state: State, target: str, message_hash: str) -> bool:
    """``target`` holds a cut (not a spill, which elision may still replace) made for this very message."""
    decided = state.decided.get(target)
    return decided is not None and decided.kind != "spill" and decided.message_hash == message_hash


def _elide_arguments(state: State, i: int, message: dict[str, Any], rules: Rules, counter: Counter,
                     new: list[Decision], writes: list[OverflowWrite]) -> None:
    """Each call of an assistant message whose arguments hold a large string value: that value becomes a stub."""
    replaced = {}
    for call in message.get("tool_calls") or []:
        function, call_id = call.get("function") or {}, str(call.get("id"))
        target = args_target(state.ids[i], call_id)
        decided = state.decided.get(target)
        if decided is not None and decided.message_hash == state.hashes[i]:
            continue  # cut already (re-applied on ingest)
        cut = cut_arguments(str(function.get("arguments") or ""), str(function.get("name", "?")), call_id,
                            rules.storage, rules.overflow_dir)
        if cut is None:
            continue
        decision = Decision("elide", target, state.hashes[i], cut.arguments, cut.writes[0].overflow_id)
        state.decided[target] = decision
        new.append(decision)
        writes.extend(cut.writes)
        replaced[call.get("id")] = cut.arguments
    current = state.out[i]
    if replaced and current is not None:
        _replace(state, i, with_arguments(current, replaced), counter)


def _elide_fenced(state: State, i: int, message: dict[str, Any], rules: Rules, counter: Counter,
                  new: list[Decision], writes: list[OverflowWrite]) -> None:
    """Each result body of a results message that is not cut yet becomes a marker; the wrapper stays."""
    result, content, mid = state.fenced[i], text_of(message.get("content")) or "", state.ids[i]
    replacements: dict[int, str] = {}
    for k, segment in enumerate(result.segments):
        body, target = content[segment.start:segment.end], segment_target(mid, k)
        decided = state.decided.get(target)
        if decided is not None and decided.message_hash == state.hashes[i] and decided.kind != "spill":
            replacements[k] = decided.replacement
            continue
        call_id = f"paste.{result.round}" if result.command == "paste" else f"r{result.round}.{k + 1}"
        tool = result.command or "fenced"
        marker = elision_marker(sha256_text(body), tool, call_id, rules.storage, body,
                                json.dumps({"command": result.command}), rules.overflow_dir)
        current = decided.replacement if decided is not None and decided.message_hash == state.hashes[i] else body
        if len(body) < MIN_CUT_CHARS or len(marker) >= len(current):
            replacements[k] = current
            continue
        if decided is None or decided.message_hash != state.hashes[i]:
            writes.append(OverflowWrite(sha256_text(body), body, tool, call_id))
        decision = Decision("elide", target, state.hashes[i], marker, sha256_text(body))
        state.decided[target] = decision
        new.append(decision)
        replacements[k] = marker
    changed = {k: v for k, v in replacements.items() if v != content[result.segments[k].start:result.segments[k].end]}
    if changed:
        _replace(state, i, {**message, "content": compose(content, result.segments, changed)}, counter)


_MARKERS: dict[tuple[str | None, ...], tuple[str, str]] = {}
"""Elision markers and the overflow ids they name, by what makes them: the message (its hash: content and call id),
the spill's overflow id if it was spilled, the call's tool and arguments, the storage and the outfiles folder.
``prime`` builds each one a request or more before the pass that cuts it, which then finds it here: building them
again was 1.5 ms of a 128k fold request, and the pass hashed each result's content again for its id (issue #13).
Cleared whole when full; a plain dict, safe on the loop and the worker alike (as ``proxy.core.project._OUT_HASHES``)."""
_MARKERS_KEPT = 4096


def _elision(state: State, i: int, message: dict[str, Any], rules: Rules) -> Decision | None:
    """The elision of result ``i``, or None when it is not eligible or its marker would not be smaller."""
    content = message.get("content")
    current = state.out[i]
    if not isinstance(content, str) or len(content) < MIN_CUT_CHARS or current is None:
        return None
    decided = state.decided.get(state.ids[i])
    if decided is not None and decided.message_hash != state.hashes[i]:
        decided = None  # made for another message under the same identity: not this one's
    if decided is not None and decided.kind != "spill":
        return None  # already a marker, or the model's own drop or note: never re-cut
    call_id = str(message.get("tool_call_id"))
    tool, arguments = state.result_calls.get(i, ("?", ""))
    if tool == READ_OVERFLOW:
        return None
    spilled = decided.overflow_id if decided is not None else None
    key = (state.hashes[i], spilled, tool, arguments, rules.storage, rules.overflow_dir)
    made = _MARKERS.get(key)
    if made is None:
        if len(_MARKERS) >= _MARKERS_KEPT:
            _MARKERS.clear()
        overflow_id = spilled or sha256_text(content)
        made = _MARKERS[key] = overflow_id, elision_marker(overflow_id, tool, call_id, rules.storage, content,
                                                          arguments, rules.overflow_dir)
    overflow_id, marker = made
    if len(marker) >= len(str(current.get("content"))):
        return None
    return Decision("elide", state.ids[i], state.hashes[i], marker, overflow_id)


PRIMED_PER_REQUEST = 2
"""Markers counted ahead per request (``prime``): a fold pass at 600 rounds writes ~20, one every ~20 requests."""
_PRIME_LOOKS = 16


def prime(state: State, messages: Sequence[dict[str, Any]], rules: Rules, counter: Counter) -> None:
    """Count ahead the markers the next elision pass will write: those of the oldest results not cut yet, a few a
    request, from where the last call stopped (``State.primed``), up to the newest (kept now, cut in a few
    requests: the pass that cuts one is the request where it stops being kept). Only the counter's cache changes
    (the count is cached under the marker message's hash, as ``_replace`` looks it up), so nothing projected
    does; a pass that cut twenty results tokenised twenty markers at once, most of what made a fold request twice
    the median (issue #13). Only while the projection is over the target, where the next pass will come: a
    session that never reaches it counts nothing ahead. The markers counted are left in ``State.marked_ahead``
    for the mirror, which renders their entries ahead as well (``proxy.engine.mirror_file``)."""
    state.marked_ahead = []
    if rules.scaled(state.total + rules.tools_tokens) <= rules.budget.target:
        return
    k = max(state.primed, bisect_left(state.tool_indices, state.settled))
    primed, looked = 0, 0
    while k < len(state.tool_indices) and primed < PRIMED_PER_REQUEST and looked < _PRIME_LOOKS:
        i = state.tool_indices[k]
        decision = _elision(state, i, messages[i], rules) if state.ids[i] not in state.pins else None
        if decision is not None:
            marked = {**messages[i], "content": decision.replacement}
            marked_hash = message_hash(marked)
            counter.count(marked, marked_hash)
            state.marked_ahead.append((i, marked, marked_hash))
            primed += 1
        looked += 1
        k += 1
    state.primed = k


def _replace(state: State, i: int, message: dict[str, Any] | None, counter: Counter) -> None:
    out_hash = message_hash(message) if message is not None else ""
    count = counter.count(message, out_hash) if message is not None else 0  # cached by identity: never recounted
    state.total += count - state.counts[i]
    state.counts[i] = count
    was_cut = state.out_hashes[i] != state.hashes[i]
    state.out[i] = message
    state.out_hashes[i] = out_hash
    state.touched.add(i)
    state.cut += (state.out_hashes[i] != state.hashes[i]) - was_cut


replace_out = _replace
"""Put ``message`` (or None: taken out) in the projection at ``i``, keeping the counts (``proxy.core.resize``)."""
