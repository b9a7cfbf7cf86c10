"""The last cut a projection makes when it is over budget: folding the oldest rounds into one stub.

When every eligible result is already a marker (``proxy.core.cuts``) and the request is still over budget, the
oldest whole rounds after the first task (an assistant message with the results of its calls, or a lone message)
fold into one stub, never splitting a call from its result, never folding a pinned message or the newest rounds. A
later fold extends the earlier one from the same start, so there is only ever one fold stub. A fold names the
messages it stands for (``OverflowWrite.span``) rather than carrying them: their bodies are in the journal already.
Hides (the rounds of the model's own mirror edits, once a ``ctx commit`` applied them) take whole rounds out the
same way, without a stub.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Sequence
from typing import Any

from ctxproxy.proxy.core.cuts import replace_out
from ctxproxy.proxy.core.decisions import Decision, OverflowWrite
from ctxproxy.proxy.core.identity import canonical_json
from ctxproxy.proxy.core.state import Counter, FoldSum, Rules, State, sha256_text
from ctxproxy.proxy.core.stubs import fold_stub_of

__all__ = ["PRIMED_ROUNDS", "apply_fold", "apply_hides", "fold", "fold_body", "hide_decision", "prime_fold", "rounds"]

_FOLD_STUB_TOKENS = 120
"""Room a fold stub takes, reckoned before it is written (its exact count replaces this after)."""


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
        if _pinned_in(state, i, j):
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
    k = bisect_left(spans, (folded_end,))
    if k == len(spans) or spans[k][0] != folded_end or _pinned_in(state, start, folded_end):
        return 0, start, state.total
    return k, folded_end, state.total - sum(state.counts[start:folded_end])


def _pinned_in(state: State, start: int, end: int) -> bool:
    """Whether a message of ``[start, end)`` is pinned (never folded or hidden)."""
    return bool(state.pins) and any(state.ids[i] in state.pins for i in range(start, end))


def _fold_decision(state: State, messages: Sequence[dict[str, Any]], start: int, end: int,
                   rules: Rules) -> tuple[Decision, int]:
    """The fold of ``[start, end)`` and the byte length of its body. Its id is the sha256 of ``fold_body``, as it
    always was, but only the messages the last fold did not cover are serialised and hashed here."""
    run = state.fold_sum
    if run is None or run.start != start or run.end > end:
        run = FoldSum.empty(start)
    for ahead in state.fold_ahead:  # hashed ahead (``prime_fold``): the last that ends by ``end``
        if ahead.start == start and run.end < ahead.end <= end:
            run = ahead
    run = state.fold_sum = run.extend((messages[i], canonical_json(messages[i]), state.hashes[i])
                                      for i in range(run.end, end))
    state.fold_ahead = tuple(ahead for ahead in state.fold_ahead if ahead.start == start and ahead.end > end)
    overflow_id, size = run.closed()
    stub = fold_stub_of(overflow_id, end - start, run.roles, run.tools, size, rules.storage, rules.overflow_dir)
    decision = Decision("fold", state.ids[start], run.message_hash(), stub, overflow_id, until=state.ids[end - 1],
                        count=end - start)
    return decision, size


PRIMED_ROUNDS = 2
"""Rounds hashed ahead per request for the next fold (``prime_fold``): at 128k a fold pass comes every ~20
requests and adds ~20 rounds to the fold."""


def prime_fold(state: State, messages: Sequence[dict[str, Any]], rules: Rules) -> None:
    """Serialise and hash ahead, ``PRIMED_ROUNDS`` a request, the rounds the next fold will take: those after the
    standing fold that its last pass found settled (``State.spans``), in order. Only ``State.fold_ahead`` changes
    (a digest at each round's end), so nothing projected does; the fold pass that takes them hashes only what is
    left (at 128k after 600 rounds it serialised and hashed the ~45 messages it added, 0.2-0.65 ms, issue #13).
    Only while a fold stands and the projection is over the target, where the next pass will come."""
    run, known = state.fold_sum, state.spans
    if run is None or known is None or not known[1] or known[0] != run.start or not rules.budget.fold_history:
        return
    if rules.scaled(state.total + rules.tools_tokens) <= rules.budget.target:
        return
    last = state.fold_ahead[-1] if state.fold_ahead else run
    spans, stable = known[2], known[3]
    k = bisect_left(spans, (last.end,))
    ahead = list(state.fold_ahead)
    for i, j in spans[k:min(stable, k + PRIMED_ROUNDS)]:
        if i != last.end or j > len(state.hashes):
            break
        last = last.extend((messages[m], canonical_json(messages[m]), state.hashes[m]) for m in range(i, j))
        ahead.append(last)
    state.fold_ahead = tuple(ahead)


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
            or _pinned_in(state, start, end):
        state.fold = None
        return
    _put_fold(state, start, end, decision, counter)


def _put_fold(state: State, start: int, end: int, decision: Decision, counter: Counter) -> None:
    for i in range(start + 1, end):
        if state.out[i] is not None:  # those an earlier fold from the same start took out are out already
            replace_out(state, i, None, counter)
    replace_out(state, start, {"role": "user", "content": decision.replacement}, counter)
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
                or _pinned_in(state, start, end):
            continue
        for i in range(start, end):
            if state.out[i] is not None:
                replace_out(state, i, None, counter)
                hidden.append(i)
    state.hidden = tuple(sorted(hidden))
