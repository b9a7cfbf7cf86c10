"""The invariant check of a projection that extends the session's last one (``violations_since``) finds a problem
exactly where the whole walk (``violations``) does, on generated sessions, intact or broken after the fact."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ctxproxy.proxy.core.decisions import Decision
from ctxproxy.proxy.core.identity import message_hash
from ctxproxy.proxy.core.invariants import broken_pairs, violations, violations_since
from ctxproxy.proxy.core.project import Projection, project
from ctxproxy.proxy.core.state import Rules
from tests.test_project import _PAIR_STEP, CharCounter, argued_histories, budget, history, prefixes


def both(request: list[Any], p: Projection, pinned: set[int], out: list[Any] | None = None) -> tuple[bool, bool]:
    """(the whole walk found a problem, the check since the last projection found one), over ``out`` (default:
    the projection's messages)."""
    out = p.messages if out is None else out
    state = p.state
    fenced = {i: r.segments for i, r in state.fenced.items()}
    whole = violations(request, out, pinned, fenced=fenced)
    since = violations_since(request, out, p.report.reused, state.touched, state.folded, bool(p.report.folded),
                             pinned, fenced)
    return bool(whole), bool(since)


def broken(out: list[Any], j: int) -> list[Any]:
    """``out`` with message ``j`` changed as no cut may change it: another role or call id, or other text."""
    out = copy.deepcopy(out)
    m = out[j]
    if m.get("role") == "tool":
        m["tool_call_id"] = "call_elsewhere"
    elif m.get("tool_calls"):
        m["tool_calls"][0]["id"] = "call_elsewhere"
    else:
        m["content"] = f"{m.get('content')} (edited)"
    return out


def session_checks(msgs: list[Any], pinned: set[int], window: int, corrupt: int | None) -> int:
    """Every request of ``msgs`` projected in turn; each checked both ways (and, with ``corrupt``, with one of the
    messages the quick check compares broken: the ``corrupt``-th, modulo). How many extended a checked one."""
    rules = Rules(budget(window))
    hashes = [message_hash(m) for m in msgs]
    ids = project(msgs, hashes, [], rules, CharCounter()).state.ids
    decisions: list[Decision] = [Decision("pin", ids[i], source="operator") for i in sorted(pinned)]
    state, extended = None, 0
    for end in range(2, len(msgs) + 1):
        request, kept = msgs[:end], {i for i in pinned if i < end}
        p = project(request, hashes[:end], decisions, rules, CharCounter(), state)
        decisions += p.new
        state = p.state
        if not p.report.reused or state.hidden:
            continue
        extended += 1
        assert both(request, p, kept) == (False, False)
        if corrupt is not None:
            begin, stop = state.folded or (end, end)
            compared = sorted(i for i in {*state.touched, *range(p.report.reused, end)} if not begin <= i < stop)
            if compared:
                i = compared[corrupt % len(compared)]
                j = i - (stop - begin - 1) if state.folded and i >= stop else i
                assert both(request, p, kept, broken(p.messages, j)) == (True, True)
    return extended


@given(argued_histories(), st.sampled_from([4096, 8192, 32768]), st.none() | st.integers(0, 10**6))
def test_the_quick_check_agrees_with_the_whole_walk(case: tuple[list[Any], set[int]], window: int,
                                                    corrupt: int | None) -> None:
    msgs, pinned = case
    session_checks(msgs, pinned, window, corrupt)


def test_a_fold_pass_is_checked_by_what_it_changed() -> None:
    """Folds that extend a checked projection: a wrong outgoing message among those they changed is found, and so
    is a fold stub whose span does not line up with the lists."""
    rules = Rules(budget(4096, spill_chars=100_000))
    msgs = history(["r" * 1500] * 60)
    assert session_checks(msgs, set(), 4096, 7) > 40
    requests = prefixes(msgs)
    state, decisions, folds = None, [], 0
    for request in requests:
        p = project(request, [message_hash(m) for m in request], decisions, rules, CharCounter(), state)
        decisions += p.new
        state = p.state
        if p.report.folded and p.report.reused:
            folds += 1
            assert state.touched and len(state.touched) < len(request) // 2
            begin, end = state.folded or (0, 0)
            assert violations_since(request, p.messages, p.report.reused, state.touched, (begin, end - 1), True)
            shifted = p.messages[:begin + 1] + p.messages[begin + 2:]
            assert violations_since(request, shifted, p.report.reused, state.touched, state.folded, True)
    assert folds >= 2


def test_a_fold_that_splits_a_call_from_its_result_is_found() -> None:
    msgs = history(["a", "b", "c", "d"])  # system, task, then four rounds of (assistant, tool)
    stub = {"role": "user", "content": f"[folded id={'0' * 64} messages=2 bytes=1 storage=disk]"}
    out = [*msgs[:3], stub, *msgs[5:]]  # folds the first round's result with the second round's call
    problems = violations_since(msgs, out, len(msgs), {3, 4}, (3, 5), True)
    assert problems == violations(msgs, out)[-len(problems):] and problems


@given(st.lists(_PAIR_STEP, max_size=30), st.integers(0, 30), st.integers(0, 30))
def test_a_span_whose_pairs_close_within_it_leaves_the_pairs_around_it_as_they_were(
        messages: list[Any], a: int, b: int) -> None:
    """The lemma the quick check's pairing rests on: take out a span whose calls and results close on their own,
    and the pairs of the rest are those of the whole."""
    begin, end = sorted((min(a, len(messages)), min(b, len(messages))))
    if broken_pairs(messages[begin:end]):
        return
    assert broken_pairs(messages[:begin] + messages[end:]) == broken_pairs(messages)


def test_a_fold_stub_where_no_fold_is_is_found() -> None:
    msgs = history(["a", "b"])
    stub = {"role": "user", "content": f"[folded id={'0' * 64} messages=1 bytes=1 storage=disk]"}
    out = [*msgs[:2], stub, *msgs[3:]]  # the first round's call replaced by a stub, no fold recorded
    assert violations_since(msgs, out, len(msgs), {2}, None, False) == ["message 2 is a fold stub where no fold is"]
    assert violations(msgs, out)
