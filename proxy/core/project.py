"""The projection: what the agent sent → what the model should see. Pure: no I/O, clock, SQL or global config.

``project(messages, hashes, decisions, rules, counter, previous)`` re-applies every earlier decision (keyed by
message identity, never by position), spills an oversized or binary tool result when it first arrives, and when
the estimate (× the calibrated ratio k) is over the budget, elides the oldest tool results down to the target, or
as a last resort folds the oldest rounds (``proxy.core.cuts``, ``proxy.core.folds``). It returns the outgoing
messages, the new decisions and the bodies that must reach the overflow store before anything is forwarded.

Cost follows the new messages, not the history: ``previous`` is the state the last projection of the session
left. When the history extends it (same hashes in front) and no decision arrived from elsewhere, only the new
messages are ingested; otherwise everything is recomputed from the decisions, which gives the same bytes.
``previous`` is consumed — extended in place, not copied, since copying it is the one cost that would grow with
the history — so a caller that wants to keep it passes ``state.copy()``. Nothing else is mutated: no I/O, no
clock, no global state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from ctxproxy.proxy.core.arguments import args_target, with_arguments
from ctxproxy.proxy.core.budget import MIN_CUT_CHARS, Budget
from ctxproxy.proxy.core.cuts import elide, prime
from ctxproxy.proxy.core.decisions import CUTS, Decision, OverflowWrite
from ctxproxy.proxy.core.fenced import text_of
from ctxproxy.proxy.core.folds import apply_fold, apply_hides, fold, prime_fold
from ctxproxy.proxy.core.identity import identity_base, next_identity
from ctxproxy.proxy.core.identity import message_hash as _hash
from ctxproxy.proxy.core.resize import recut
from ctxproxy.proxy.core.segments import FencedResult, compose, fenced_command, paste_segment, segment_target
from ctxproxy.proxy.core.state import READ_OVERFLOW, Counter, Rules, State, sha256_text
from ctxproxy.proxy.core.stubs import looks_binary, spill_stub

__all__ = ["PASTE", "Projection", "Report", "absorbed_state", "project"]

PASTE = "paste"
"""The command name a person's pasted attachment is filed under, like a tool's."""
PASTE_HEAD, PASTE_TAIL = 1000, 500
"""A paste's preview: fixed, so whether a paste goes to overflow depends on paste_chars alone."""

@dataclass(frozen=True)
class Report:
    estimate: int
    scaled: int
    budget: int
    target: int
    window: int
    over_budget: bool
    reused: int
    spilled: int = 0
    elided: int = 0
    folded: int = 0
    largest: tuple[tuple[str, int], ...] = ()
    """Over budget only: the biggest items still in the projection, (identity, tokens), biggest first."""


@dataclass(frozen=True)
class Projection:
    messages: list[dict[str, Any]]
    hashes: list[str]
    new: tuple[Decision, ...]
    writes: tuple[OverflowWrite, ...]
    report: Report
    state: State
    changed: bool
    """False when the outgoing messages are the incoming ones, unchanged (the body can go upstream verbatim)."""


def project(messages: Sequence[dict[str, Any]], hashes: Sequence[str], decisions: Sequence[Decision],
            rules: Rules, counter: Counter, previous: State | None = None, seen: int = 0) -> Projection:
    """``seen``: how many leading messages the session already had before this request. Spilling is decided when a
    result arrives, so a recomputation never spills those afresh (the rules may have changed since: another
    window, another model); their decisions, if any, are in ``decisions``."""
    state = _resume(previous, hashes, len(decisions)) or _fresh(decisions)
    state.touched = set()
    reused = len(state.hashes)
    new: list[Decision] = []
    writes: list[OverflowWrite] = []
    for i in range(reused, len(messages)):
        _ingest(state, i, messages, hashes[i], rules, counter, new, writes, seen)
    if reused == 0 and state.hides:
        apply_hides(state, counter)
    if reused == 0 and state.fold is not None:
        apply_fold(state, state.fold, messages, counter)
    _cut_to_fit(state, messages, rules, counter, new, writes)
    prime(state, messages, rules, counter)
    prime_fold(state, messages, rules)
    state.absorbed = len(decisions) + len(new)
    return _result(state, messages, rules, new, writes, reused)


def _cut_to_fit(state: State, messages: Sequence[dict[str, Any]], rules: Rules, counter: Counter,
                new: list[Decision], writes: list[OverflowWrite]) -> None:
    """Elide, then fold, with the configured protection; then squeeze down to the newest result and round.

    Once the budget is crossed the cut goes to the target in this request: if eliding alone stops above it and a
    fold can reach it, the fold follows now rather than on the next request, so the prefix cache is broken once,
    not twice in a row. A fold that cannot reach it (the protected newest results are that large) is made only
    when the request is still over budget: it would break the prefix at its start for nothing. The squeeze elides
    every text-protocol round's results but the newest before it folds anything, and a fold keeps the newest round
    whole (its assistant text with its results): one large new message never costs the rounds before it their
    text while a block of theirs could still be cut. Only a request that could not be sent at all otherwise (what
    may never be cut fills the budget) folds the newest assistant text too, rather than be refused. Before the
    squeeze folds, the results it protects are re-cut to the size a result arriving now gets (``recut``): their
    previews may have been sized for a larger window, the fallback used before the real one was learned."""
    keep, rounds = rules.budget.keep_results, rules.budget.keep_tool_rounds
    for keep_results, keep_rounds, newest in ((keep, rounds, max(keep, 2)), (min(keep, 1), min(rounds, 1), 1)):
        if not _over(state, rules):
            return
        elide(state, messages, rules, counter, new, writes, keep_results, keep_rounds)
        if newest == 1 and _over(state, rules):  # cuts sized for a larger window (learned late): re-cut them now
            recut(state, messages, rules, counter, new, writes)
        if _over(state, rules, rules.budget.target):
            fold(state, messages, rules, counter, new, writes, newest, required=_over(state, rules))
    if _over(state, rules) and state.fenced:  # else refused: the newest assistant text goes, restorably, instead
        fold(state, messages, rules, counter, new, writes, 1, paired=False)


def _over(state: State, rules: Rules, limit: int | None = None) -> bool:
    """Is the projection over the budget (or over ``limit``)?"""
    return rules.scaled(state.total + rules.tools_tokens) > (limit or rules.budget.budget)


def _resume(previous: State | None, hashes: Sequence[str], decisions: int) -> State | None:
    if previous is None or previous.absorbed != decisions or len(hashes) < len(previous.hashes):
        return None
    if list(hashes[: len(previous.hashes)]) != previous.hashes:
        return None
    return previous


def absorbed_state(decisions: Sequence[Decision]) -> State:
    """The state of ``decisions`` before any message is ingested: given (a copy) as ``project``'s ``previous``, the
    projection is the one from the decisions, without absorbing them again (a new run inherits a long session's
    ~1,200: 0.5 ms each time; ``proxy.engine.context`` absorbs them once for every session that inherits them)."""
    state = _fresh(decisions)
    state.absorbed = len(decisions)
    return state


def _fresh(decisions: Sequence[Decision]) -> State:
    state = State()
    for d in decisions:
        if d.kind in CUTS:
            state.decided[d.target] = d
        elif d.kind == "pin":
            state.pins[d.target] = d.source
        elif d.kind == "unpin":
            state.pins.pop(d.target, None)
        elif d.kind == "fold":
            state.fold = d
        elif d.kind == "hide":
            state.hides += (d,)
        elif d.kind == "restore":
            state.decided.pop(d.target, None)
    return state


def _ingest(state: State, i: int, messages: Sequence[dict[str, Any]], message_hash: str, rules: Rules,
            counter: Counter, new: list[Decision], writes: list[OverflowWrite], seen: int) -> None:
    message = messages[i]
    mid = next_identity(identity_base(message, message_hash), state.seen)
    state.hashes.append(message_hash)
    state.ids.append(mid)
    for call in message.get("tool_calls") or []:
        state.called(i, call)
    out = message
    state.rounds += message.get("role") == "assistant"
    if message.get("role") == "tool":
        state.tool_indices.append(i)
        state.result_calls[i] = state.calls.get(str(message.get("tool_call_id")), ("?", ""))
        out = _cut_tool_result(state, i, message, message_hash, rules, new, writes, spill=i >= seen)
    elif message.get("role") == "assistant" and message.get("tool_calls"):
        state.call_indices.append(i)
        out = _cut_calls(state, mid, message, message_hash)
    elif message.get("role") == "user":
        state.user_indices.append(i)
        result = _results_of(state, i, messages, rules)
        if result is not None:
            state.fenced[i] = result
            out = _cut_segments(state, mid, message, message_hash, result, rules, new, writes, spill=i >= seen)
    out_hash = message_hash if out is message else _out_hash(out, message_hash, message)
    count = counter.count(out, out_hash)  # a stub's count is cached by its identity too: never recounted
    state.out.append(out)
    state.out_hashes.append(out_hash)
    state.cut += out is not message
    state.counts.append(count)
    state.total += count


_OUT_HASHES: dict[tuple[str, str], str] = {}
"""The hash of a message's stub by (the message's hash, the stub's content): every projection recomputed from the
decisions (a fork, a new run, each request of the peers' benchmark) rebuilt and hashed every stub again (5% of a
630 KB new-text request). Cleared whole when full: a plain dict, safe on the loop and the worker alike. Only
short contents (stubs, markers) are kept, so it holds at most a few MB."""

_OUT_HASHES_KEPT = 8192
_OUT_CONTENT_CHARS = 2048


def _out_hash(out: dict[str, Any], message_hash: str, message: dict[str, Any]) -> str:
    """``message_hash(out)``, where ``out`` is ``message`` with a new content (a stub) and nothing else changed:
    the pair of hashes says it all. Anything else is hashed."""
    content = out.get("content")
    if not isinstance(content, str) or len(content) > _OUT_CONTENT_CHARS or out.keys() != message.keys() or any(
            out[k] is not message[k] for k in out if k != "content"):
        return _hash(out)
    key = (message_hash, content)
    known = _OUT_HASHES.get(key)
    if known is None:
        if len(_OUT_HASHES) >= _OUT_HASHES_KEPT:
            _OUT_HASHES.clear()
        known = _OUT_HASHES[key] = _hash(out)
    return known


def _cut_tool_result(state: State, i: int, message: dict[str, Any], message_hash: str, rules: Rules,
                     new: list[Decision], writes: list[OverflowWrite], spill: bool) -> dict[str, Any]:
    """The result as it goes out: a stored decision re-applied, or (arriving now) a spill decided, or untouched."""
    mid = state.ids[i]
    if mid in state.pins:
        return message
    decided = state.decided.get(mid)
    if decided is not None and decided.message_hash == message_hash:
        return {**message, "content": decided.replacement}
    content = message.get("content")
    call_id = str(message.get("tool_call_id"))
    tool, _ = state.calls.get(call_id, ("?", ""))
    if not spill or not _should_spill(content, tool, rules.budget):
        return message
    assert isinstance(content, str)
    overflow_id = sha256_text(content)
    stub = spill_stub(overflow_id, tool, call_id, rules.storage, content, rules.budget.preview_head,
                      rules.budget.preview_tail, rules.overflow_dir)
    if len(stub) >= len(content):
        return message  # its stub would not be smaller
    decision = Decision("spill", mid, message_hash, stub, overflow_id)
    state.decided[mid] = decision
    new.append(decision)
    writes.append(OverflowWrite(overflow_id, content, tool, call_id, (i, i + 1), len(content.encode()), "content"))
    return {**message, "content": stub}


def _cut_calls(state: State, mid: str, message: dict[str, Any], message_hash: str) -> dict[str, Any]:
    """The assistant message as it goes out: the argument cuts decided for its calls re-applied, byte for byte."""
    if mid in state.pins:
        return message
    replaced = {}
    for call in message.get("tool_calls") or []:
        decided = state.decided.get(args_target(mid, str(call.get("id"))))
        if decided is not None and decided.message_hash == message_hash:
            replaced[call.get("id")] = decided.replacement
    return with_arguments(message, replaced) if replaced else message


def _results_of(state: State, i: int, messages: Sequence[dict[str, Any]], rules: Rules) -> FencedResult | None:
    """What of a user message may be cut: the results of a text-protocol round, or a person's large paste."""
    content = text_of(messages[i].get("content"))
    if content is None:
        return None
    if rules.fenced and i and messages[i - 1].get("role") == "assistant":
        segments = next((found for p in rules.fenced if (found := p.segments(content))), None)
        if segments:
            return FencedResult(state.rounds, tuple(segments), fenced_command(messages[i - 1]))
        # No preset knows it: most likely the results of an agent nobody wrote a rule for. Its largest block is cut
        # like a result (spilled when that large, elided when old), the words around it kept, rather than folding
        # earlier rounds to make room for it.
        block = paste_segment(content, MIN_CUT_CHARS, lines=True)
        if block:
            return FencedResult(state.rounds, (block,), fenced_command(messages[i - 1]))
    paste = paste_segment(content, rules.budget.paste_chars)
    return FencedResult(state.rounds, (paste,), PASTE) if paste else None


def _cut_segments(state: State, mid: str, message: dict[str, Any], message_hash: str, result: FencedResult,
                  rules: Rules, new: list[Decision], writes: list[OverflowWrite], spill: bool) -> dict[str, Any]:
    """The message as it goes out: each cuttable body cut as a native result would be, the rest as it was."""
    content = text_of(message.get("content")) or ""
    if mid in state.pins:  # a pin covers the whole message (a text-protocol round's results, a paste)
        return message
    replacements = {}
    tool = result.command or "fenced"
    for k, segment in enumerate(result.segments):
        body, target = content[segment.start:segment.end], segment_target(mid, k)
        call_id = f"paste.{result.round}" if result.command == PASTE else f"r{result.round}.{k + 1}"
        decided = state.decided.get(target)
        if decided is not None and decided.message_hash == message_hash:
            replacements[k] = decided.replacement
        elif spill and (_should_spill(body, "", rules.budget) or result.command == PASTE):
            head, tail = (PASTE_HEAD, PASTE_TAIL) if result.command == PASTE else (rules.budget.preview_head,
                                                                                   rules.budget.preview_tail)
            stub = spill_stub(sha256_text(body), tool, call_id, rules.storage, body, head, tail, rules.overflow_dir)
            if len(stub) < len(body):
                decision = Decision("spill", target, message_hash, stub, sha256_text(body))
                state.decided[target] = decision
                new.append(decision)
                writes.append(OverflowWrite(decision.overflow_id, body, tool, call_id))
                replacements[k] = stub
    return {**message, "content": compose(content, result.segments, replacements)} if replacements else message


def _should_spill(content: Any, tool: str, budget: Budget) -> bool:
    if not isinstance(content, str) or len(content) < MIN_CUT_CHARS or tool == READ_OVERFLOW:
        return False
    return len(content) >= budget.spill_chars or looks_binary(content)


def _result(state: State, messages: Sequence[dict[str, Any]], rules: Rules, new: list[Decision],
            writes: list[OverflowWrite], reused: int) -> Projection:
    if state.hidden:  # spans taken out here and there: filter (only sessions that used the mirror)
        out = [m for m in state.out if m is not None]
        out_hashes = [h for h, m in zip(state.out_hashes, state.out, strict=True) if m is not None]
    else:
        start, end = state.folded or (0, 1)  # the folded-away messages are the Nones after the stub: slice them out
        out = cast(list[dict[str, Any]], state.out[: start + 1] + state.out[end:])
        out_hashes = state.out_hashes[: start + 1] + state.out_hashes[end:]
    changed = state.cut > 0
    estimate = state.total + rules.tools_tokens
    scaled = rules.scaled(estimate)
    kinds = [d.kind for d in new]
    over = scaled > rules.budget.budget
    largest = sorted(zip(state.ids, state.counts, strict=True), key=lambda p: -p[1])[:5] if over else []
    if over and rules.tools_tokens:
        largest = sorted([*largest, ("tools", rules.tools_tokens)], key=lambda p: -p[1])[:5]
    report = Report(estimate, scaled, rules.budget.budget, rules.budget.target, rules.budget.window, over, reused,
                    kinds.count("spill"), kinds.count("elide"), kinds.count("fold"), tuple(largest))
    return Projection(out, out_hashes, tuple(new), tuple(writes), report, state, changed)
