"""Re-cut what was sized for a larger window, when the window turns out smaller (issue #11).

Why: a spill's preview is sized when its result arrives, from the budget of that moment (``spill_chars``, a tenth
of the budget). An upstream that reports no window (llama-cpp-python) is budgeted at the 131072 fallback until its
first refusal teaches the real one; by then the newest results carry previews of a few thousand characters and
are protected from elision, so a 4k model's request cannot fit however much else is cut. ``recut`` is the pass the
projection makes only then — still over the budget after every ordinary cut — and it makes each remaining result
as small as a result arriving now would be: a spill re-spilled with the current preview, a result that was below
the old spill size spilled now, the newest ones included (a preview still shows their head and tail, and the whole
body is in the overflow store). The new decisions replace the old ones by identity, so the prefix breaks once.

Never re-cut: pinned messages, ``read_overflow`` results, pastes (their preview is fixed), and anything already
elided, dropped or noted (those are smaller than any preview).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ctxproxy.proxy.core.budget import MIN_CUT_CHARS, Budget
from ctxproxy.proxy.core.cuts import replace_out
from ctxproxy.proxy.core.decisions import Decision, OverflowWrite
from ctxproxy.proxy.core.fenced import text_of
from ctxproxy.proxy.core.segments import compose, segment_target
from ctxproxy.proxy.core.state import READ_OVERFLOW, Counter, Rules, State, sha256_text
from ctxproxy.proxy.core.stubs import looks_binary, spill_stub

__all__ = ["recut"]

_PASTE = "paste"  # proxy.core.project.PASTE (importing it would be circular)


def recut(state: State, messages: Sequence[dict[str, Any]], rules: Rules, counter: Counter,
          new: list[Decision], writes: list[OverflowWrite]) -> None:
    """Re-spill every result still in the projection whose cut is larger than one made under ``rules`` now."""
    for i in sorted([*state.tool_indices, *state.fenced]):
        if state.out[i] is None or state.ids[i] in state.pins:
            continue
        if i in state.fenced:
            _recut_segments(state, i, messages[i], rules, counter, new, writes)
        else:
            _recut_result(state, i, messages[i], rules, counter, new, writes)


def _recut_result(state: State, i: int, message: dict[str, Any], rules: Rules, counter: Counter,
                  new: list[Decision], writes: list[OverflowWrite]) -> None:
    content, current = message.get("content"), state.out[i]
    tool = state.result_calls.get(i, ("?", ""))[0]
    if not isinstance(content, str) or current is None or tool == READ_OVERFLOW:
        return
    call_id = str(message.get("tool_call_id"))
    stub = _smaller_spill(state, state.ids[i], state.hashes[i], content, str(current.get("content")), tool, call_id,
                          rules, new, writes)
    if stub is not None:
        replace_out(state, i, {**message, "content": stub}, counter)


def _recut_segments(state: State, i: int, message: dict[str, Any], rules: Rules, counter: Counter,
                    new: list[Decision], writes: list[OverflowWrite]) -> None:
    result, content = state.fenced[i], text_of(message.get("content")) or ""
    if result.command == _PASTE:
        return
    tool, replacements, fresh = result.command or "fenced", {}, False
    for k, segment in enumerate(result.segments):
        body, target = content[segment.start:segment.end], segment_target(state.ids[i], k)
        decided = state.decided.get(target)
        current = decided.replacement if decided is not None and decided.message_hash == state.hashes[i] else body
        stub = _smaller_spill(state, target, state.hashes[i], body, current, tool, f"r{result.round}.{k + 1}", rules,
                              new, writes)
        replacements[k], fresh = (current, fresh) if stub is None else (stub, True)
    if fresh:
        replace_out(state, i, {**message, "content": compose(content, result.segments, replacements)}, counter)


def _smaller_spill(state: State, target: str, message_hash: str, body: str, current: str, tool: str, call_id: str,
                   rules: Rules, new: list[Decision], writes: list[OverflowWrite]) -> str | None:
    """The spill of ``body`` under the current budget, decided, if it is smaller than ``current``; else None."""
    decided = state.decided.get(target)
    if decided is not None and decided.message_hash == message_hash and decided.kind != "spill":
        return None  # elided, dropped or noted: already smaller than a preview
    if not _spillable(body, rules.budget):
        return None
    budget = rules.budget
    stub = spill_stub(sha256_text(body), tool, call_id, rules.storage, body, budget.preview_head, budget.preview_tail)
    if len(stub) >= len(current):
        return None
    decision = Decision("spill", target, message_hash, stub, sha256_text(body))
    state.decided[target] = decision
    new.append(decision)
    writes.append(OverflowWrite(decision.overflow_id, body, tool, call_id))  # stored once: the store ignores repeats
    return stub


def _spillable(body: str, budget: Budget) -> bool:
    return len(body) >= MIN_CUT_CHARS and (len(body) >= budget.spill_chars or looks_binary(body))
