"""The two cuts a projection makes when it is over budget: auto-elision, then folding as the last resort.

Auto-elision (DESIGN.md §4) collapses the oldest tool results — not pinned, not among the newest
``keep_results``, not a ``read_overflow`` result — into a marker, oldest first, until the estimate is at the
target. One pass cuts deep, then nothing changes for many requests: the upstream's prefix cache survives.

Folding: when every eligible result is already a marker and the request is still over budget, the oldest whole
rounds after the first task (an assistant message with the results of its calls, or a lone message) fold into
one stub, never splitting a call from its result, never folding a pinned message or the newest rounds. A later
fold extends the earlier one from the same start, so there is only ever one fold stub. A fold names the messages
it stands for (``OverflowWrite.span``) rather than carrying them: their bodies are in the journal already.

How much is protected is the caller's choice (``keep_results``, ``newest``): ``project`` first cuts with the
configured protection, then, only if the request still cannot fit, squeezes with everything but the newest
result and round — losing the newer results (restorably) is better than a request the model cannot read.
"""

from __future__ import annotations

import bisect
import json
from bisect import bisect_left
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from ctxproxy.proxy.core.arguments import args_target, cut_arguments, with_arguments
from ctxproxy.proxy.core.budget import MIN_CUT_CHARS
from ctxproxy.proxy.core.decisions import Decision, OverflowWrite
from ctxproxy.proxy.core.fenced import text_of
from ctxproxy.proxy.core.identity import canonical_json, message_hash
from ctxproxy.proxy.core.segments import compose, segment_target
from ctxproxy.proxy.core.state import READ_OVERFLOW, Counter, FoldSum, Rules, State, sha256_text
from ctxproxy.proxy.core.stubs import elision_marker, fold_stub_of

__all__ = ["PRIMED_PER_REQUEST", "apply_fold", "apply_hides", "elide", "fold", "fold_body", "hide_decision", "prime",
           "replace_out", "rounds"]

_FOLD_STUB_TOKENS = 120
"""Room a fold stub takes, reckoned before it is written (its exact count replaces this after)."""


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


_MARKERS: dict[tuple[str, ...], str] = {}
"""Elision markers by what makes them: the message (its hash: content and call id), the overflow id, the call's
tool and arguments, the storage and the outfiles folder. ``prime`` builds each one a request or more before the
pass that cuts it, which then builds it again: 1.5 ms of a 128k fold request. Cleared whole when full; a plain
dict, safe on the loop and the worker alike (as ``proxy.core.project._OUT_HASHES``)."""
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
    overflow_id = decided.overflow_id if decided is not None else sha256_text(content)
    key = (state.hashes[i], overflow_id, tool, arguments, rules.storage, rules.overflow_dir)
    marker = _MARKERS.get(key)
    if marker is None:
        if len(_MARKERS) >= _MARKERS_KEPT:
            _MARKERS.clear()
        marker = _MARKERS[key] = elision_marker(overflow_id, tool, call_id, rules.storage, content, arguments,
                                                rules.overflow_dir)
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
    session that never reaches it counts nothing ahead."""
    if rules.scaled(state.total + rules.tools_tokens) <= rules.budget.target:
        return
    k = max(state.primed, bisect_left(state.tool_indices, state.settled))
    primed, looked = 0, 0
    while k < len(state.tool_indices) and primed < PRIMED_PER_REQUEST and looked < _PRIME_LOOKS:
        i = state.tool_indices[k]
        decision = _elision(state, i, messages[i], rules) if state.ids[i] not in state.pins else None
        if decision is not None:
            marked = {**messages[i], "content": decision.replacement}
            counter.count(marked, message_hash(marked))
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


def rounds(messages: Sequence[dict[str, Any]], start: int, fenced: Collection[int] = ()) -> list[tuple[int, int]]:
    """``[start, end)`` spans from ``start`` on: an assistant message through the last result of its calls
    (whatever stands between them), an assistant message and the text-protocol results message answering it
    (indices in ``fenced``), or one message."""
    spans, i = [], start
    while i < len(messages):
        open_calls = {c.get("id") for c in messages[i].get("tool_calls") or []}
        j = i + 2 if messages[i].get("role") == "assistant" and i + 1 in fenced else i + 1
        while open_calls and j < len(messages):
            if messages[j].get("role") == "tool":
                open_calls.discard(messages[j].get("tool_call_id"))
            j += 1
        if open_calls:  # calls never answered (the run's last one): the span is just this message
            j = i + 1 if not any(m.get("role") == "tool" for m in messages[i + 1:]) else j
        spans.append((i, j))
        i = j
    return spans


def _fold_spans(state: State, messages: Sequence[dict[str, Any]], start: int, paired: bool) -> list[tuple[int, int]]:
    """``rounds(messages, start, state.fenced if paired else ())``, walked only from the last span the state's
    previous pass found that no later message can change (``State.spans``): a fold pass at 600 rounds walked all
    ~550 spans again (1.4 ms at 128k). The walk is greedy from the left, so the spans after a kept one are the
    walk's from its end."""
    fenced = state.fenced if paired else ()
    known = state.spans
    kept = known[2][:known[3]] if known is not None and known[:2] == (start, paired) else []
    spans = kept + rounds(messages, kept[-1][1] if kept else start, fenced)
    stable = len(kept)
    while stable < len(spans) and _settled_span(messages, spans[stable]):
        stable += 1
    state.spans = (start, paired, spans, stable)
    return spans


def _settled_span(messages: Sequence[dict[str, Any]], span: tuple[int, int]) -> bool:
    """Whether ``rounds`` finds this span again however the history goes on: it ends before the last message, and
    the calls of its first message are all answered within it (else its end was set by where the history ended)."""
    i, j = span
    if j >= len(messages):
        return False
    waiting = {c.get("id") for c in messages[i].get("tool_calls") or []}
    for m in messages[i + 1:j]:
        if m.get("role") == "tool":
            waiting.discard(m.get("tool_call_id"))
    return not waiting


def _fold_start(messages: Sequence[dict[str, Any]]) -> int:
    """The first index after the protected head: the system messages and the first task."""
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first_user is not None:
        return first_user + 1
    return next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")), len(messages))


def fold(state: State, messages: Sequence[dict[str, Any]], rules: Rules, counter: Counter,
         new: list[Decision], writes: list[OverflowWrite], newest: int, required: bool = True,
         paired: bool = True) -> None:
    """Fold the oldest whole rounds into one stub, down to the target; unless ``required``, only if that reaches
    the target. ``paired``: a text-protocol assistant message and its results message are one round."""
    if not rules.budget.fold_history:
        return
    start = _fold_start(messages)
    spans = _fold_spans(state, messages, start, paired)
    first, end, total = _past_last_fold(state, spans, start)
    for i, j in spans[first: max(first, len(spans) - newest)]:
        if rules.scaled(total + rules.tools_tokens + _FOLD_STUB_TOKENS) <= rules.budget.target and end > start:
            break
        if state.pins and any(state.ids[x] in state.pins for x in range(i, j)):
            break
        total -= sum(state.counts[i:j])
        end = j
    if end <= start or (state.folded is not None and end <= state.folded[1]):
        return
    if not required and rules.scaled(total + rules.tools_tokens + _FOLD_STUB_TOKENS) > rules.budget.target:
        return
    decision, size = _fold_decision(state, messages, start, end, rules)
    writes.append(OverflowWrite(decision.overflow_id, "", "fold", "", span=(start, end), size=size))
    state.fold = decision
    new.append(decision)
    _put_fold(state, start, end, decision, counter)  # made for these rounds, none of them pinned


def _past_last_fold(state: State, spans: Sequence[tuple[int, int]], start: int) -> tuple[int, int, int]:
    """Where ``fold``'s walk over ``spans`` may begin: (span index, end so far, total so far). From the first span
    after the standing fold from ``start`` (a fold that ends within it is void anyway: no new decision), with its
    messages' counts taken off at once; from the first span when there is none, or a pin stands in it. At 600
    rounds the walk went over ~500 folded spans again on each fold pass."""
    if state.folded is None or state.folded[0] != start:
        return 0, start, state.total
    folded_end = state.folded[1]
    k = bisect.bisect_left(spans, (folded_end,))
    if k == len(spans) or spans[k][0] != folded_end or (state.pins and any(
            state.ids[x] in state.pins for x in range(start, folded_end))):
        return 0, start, state.total
    return k, folded_end, state.total - sum(state.counts[start:folded_end])


def _fold_decision(state: State, messages: Sequence[dict[str, Any]], start: int, end: int,
                   rules: Rules) -> tuple[Decision, int]:
    """The fold of ``[start, end)`` and the byte length of its body. Its id is the sha256 of ``fold_body``, as it
    always was, but only the messages the last fold did not cover are serialised and hashed here."""
    run = state.fold_sum
    if run is None or run.start != start or run.end > end:
        run = FoldSum.empty(start)
    run = state.fold_sum = run.extend((messages[i], canonical_json(messages[i]), state.hashes[i])
                                      for i in range(run.end, end))
    overflow_id, size = run.closed()
    stub = fold_stub_of(overflow_id, end - start, run.roles, run.tools, size, rules.storage, rules.overflow_dir)
    decision = Decision("fold", state.ids[start], run.message_hash(), stub, overflow_id, until=state.ids[end - 1],
                        count=end - start)
    return decision, size


def fold_body(messages: Sequence[dict[str, Any]], span: tuple[int, int]) -> str:
    """What a fold of ``span`` stands for, byte for byte: the canonical JSON array of those messages (the journal
    rebuilds it from the messages' own stored bodies)."""
    return canonical_json(list(messages[span[0]:span[1]])).decode()


def _digest(hashes: Sequence[str]) -> str:
    return sha256_text("".join(hashes))


def apply_fold(state: State, decision: Decision, messages: Sequence[dict[str, Any]], counter: Counter) -> None:
    """Put the fold stub where its rounds were, if they are still exactly the rounds it was made for; else the fold
    is void for this history (an edited history, a fork's, a message pinned since)."""
    start = state.ids.index(decision.target) if decision.target in state.ids else -1
    end = start + decision.count
    if start < 0 or end > len(state.ids) or _digest(state.hashes[start:end]) != decision.message_hash \
            or any(state.ids[i] in state.pins for i in range(start, end)):
        state.fold = None
        return
    _put_fold(state, start, end, decision, counter)


def _put_fold(state: State, start: int, end: int, decision: Decision, counter: Counter) -> None:
    for i in range(start + 1, end):
        if state.out[i] is not None:  # those an earlier fold from the same start took out are out already
            _replace(state, i, None, counter)
    _replace(state, start, {"role": "user", "content": decision.replacement}, counter)
    state.folded = (start, end)


def hide_decision(state: State, start: int, end: int) -> Decision:
    """Take messages ``[start, end)`` (whole rounds) out of the projection; they stay in the journal."""
    return Decision("hide", state.ids[start], _digest(state.hashes[start:end]), until=state.ids[end - 1],
                    count=end - start, source="model")


def apply_hides(state: State, counter: Counter) -> None:
    """Take out the rounds the hides name, where they are still exactly those rounds."""
    hidden = []
    for decision in state.hides:
        start = state.ids.index(decision.target) if decision.target in state.ids else -1
        end = start + decision.count
        if start < 0 or end > len(state.ids) or _digest(state.hashes[start:end]) != decision.message_hash \
                or any(state.ids[i] in state.pins for i in range(start, end)):
            continue
        for i in range(start, end):
            if state.out[i] is not None:
                _replace(state, i, None, counter)
                hidden.append(i)
    state.hidden = tuple(sorted(hidden))
