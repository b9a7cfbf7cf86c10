"""Markers counted ahead (``proxy.core.cuts.prime``): the projection is what it is without them, and an elision
pass finds the markers it writes counted already."""

from __future__ import annotations

import sys
from dataclasses import fields, replace
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from ctxproxy.proxy.core import cuts, folds
from ctxproxy.proxy.core.decisions import Decision
from ctxproxy.proxy.core.identity import message_hash
from ctxproxy.proxy.core.project import Projection, project
from ctxproxy.proxy.core.state import Rules, State
from tests.test_project import CharCounter, argued_histories, budget, fenced_history, fenced_rules, history, prefixes

project_module = sys.modules["ctxproxy.proxy.core.project"]


class CachingCounter(CharCounter):
    """``CharCounter`` with a cache by key, as the proxy's; ``marked``: the markers counted, and whether each was
    counted inside an elision pass (not ahead of it)."""

    def __init__(self) -> None:
        self.cache: dict[str, int] = {}
        self.in_pass = False
        self.marked: list[bool] = []

    def count(self, message: dict[str, Any], key: str | None = None) -> int:
        if key is not None and key in self.cache:
            return self.cache[key]
        content = message.get("content")
        if isinstance(content, str) and content.startswith("[overflow id=") and "Elided" in content:
            self.marked.append(self.in_pass)
        tokens = super().count(message, key)
        if key is not None:
            self.cache[key] = tokens
        return tokens


def _session(msgs: list[Any], rules: Rules, decisions: list[Decision], primed: bool) -> list[Projection]:
    counter, state, out = CachingCounter(), None, []
    hashes = [message_hash(m) for m in msgs]
    decisions = list(decisions)
    with pytest.MonkeyPatch.context() as patch:
        if not primed:
            patch.setattr(project_module, "prime", lambda *_: None)
            patch.setattr(project_module, "prime_fold", lambda *_: None)
        for end in range(2, len(msgs) + 1):
            p = project(msgs[:end], hashes[:end], decisions, rules, counter, state)
            decisions += p.new
            state = p.state
            out.append(p)
    return out


@given(argued_histories(), st.sampled_from([4096, 8192, 32768]))
def test_counting_ahead_changes_nothing_projected(case: tuple[list[Any], set[int]], window: int) -> None:
    msgs, pinned = case
    rules = Rules(budget(window))
    ids = project(msgs, [message_hash(m) for m in msgs], [], rules, CharCounter()).state.ids
    pins = [Decision("pin", ids[i], source="operator") for i in sorted(pinned)]
    for a, b in zip(_session(msgs, rules, pins, True), _session(msgs, rules, pins, False), strict=True):
        assert (a.messages, a.hashes, a.new, a.writes, a.report, a.changed) == \
            (b.messages, b.hashes, b.new, b.writes, b.report, b.changed)
        for f in fields(State):
            if f.name not in ("primed", "marked_ahead", "fold_sum", "fold_ahead"):  # a sum: compared closed below
                assert getattr(a.state, f.name) == getattr(b.state, f.name), f.name
        assert (a.state.fold_sum and a.state.fold_sum.closed()) == (b.state.fold_sum and b.state.fold_sum.closed())


def _watched(counter: CachingCounter) -> Any:
    """``cuts.elide``, telling ``counter`` while it runs."""
    def elide(*args: Any, **kwargs: Any) -> None:
        counter.in_pass = True
        try:
            cuts.elide(*args, **kwargs)
        finally:
            counter.in_pass = False
    return elide


def test_an_elision_pass_finds_its_markers_counted_ahead() -> None:
    """A long session over its target: the later passes tokenise no marker of their own, where without counting
    ahead each pass tokenised every marker it wrote."""
    rules = Rules(budget(8192, spill_chars=100_000))
    msgs = history([f"line {k}\n" + "r" * 2000 for k in range(80)])
    for primed, most in ((True, 0), (False, None)):
        counter, state, passes = CachingCounter(), None, 0
        decisions: list[Decision] = []
        with pytest.MonkeyPatch.context() as patch:
            if not primed:
                patch.setattr(project_module, "prime", lambda *_: None)
            patch.setattr(project_module, "elide", _watched(counter))
            for request in prefixes(msgs):
                p = project(request, [message_hash(m) for m in request], decisions, rules, counter, state)
                decisions += p.new
                state = p.state
                passes += bool(p.report.elided)
        in_passes = sum(counter.marked[len(counter.marked) // 2:])  # the later half: past the first passes
        assert passes >= 3
        assert in_passes == 0 if most is not None else in_passes > 5


def test_counting_ahead_waits_for_the_target_and_keeps_to_its_share() -> None:
    rules = Rules(budget(8192, spill_chars=100_000))
    msgs = history(["r" * 2000] * 30)
    state = project(msgs[:6], [message_hash(m) for m in msgs[:6]], [], rules, CharCounter()).state
    assert state.primed == 0  # under the target: nothing counted ahead
    counter = CachingCounter()
    big = replace(rules, budget=replace(rules.budget, target=1))
    state = project(msgs, [message_hash(m) for m in msgs], [], replace(big, budget=replace(
        big.budget, budget=10**9)), counter).state
    assert len(counter.marked) == cuts.PRIMED_PER_REQUEST and state.primed == cuts.PRIMED_PER_REQUEST


class _Forgetful(dict[tuple[str | None, ...], tuple[str, str]]):
    """A marker cache that never finds what it keeps: every marker built afresh."""

    def get(self, key: Any, default: Any = None) -> Any:
        return default


@given(argued_histories(), st.sampled_from([4096, 8192]))
def test_a_kept_marker_is_the_one_built_afresh(case: tuple[list[Any], set[int]], window: int) -> None:
    """The markers ``prime`` built, found again by the pass, are those the pass would build: the same session with
    a cache that forgets gives the same bytes and decisions (run second: the first warmed the cache)."""
    msgs, _ = case
    rules = Rules(budget(window))
    kept = _session(msgs, rules, [], True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuts, "_MARKERS", _Forgetful())
        fresh = _session(msgs, rules, [], True)
    for a, b in zip(kept, fresh, strict=True):
        assert (a.messages, a.new) == (b.messages, b.new)


def test_a_marker_is_kept_for_its_own_call_and_storage_only() -> None:
    """The same result under another command, another storage or another outfiles folder gets its own marker."""
    results = [f"line {k}\n" + "r" * 2000 for k in range(40)]
    seen = set()
    for command, storage, outdir in (("cmd", "disk", ""), ("grep", "disk", ""), ("cmd", "memory-only (incognito)", ""),
                                     ("cmd", "disk", "/tmp/out")):
        msgs = history(results)
        for m in msgs:
            for call in m.get("tool_calls") or []:
                call["function"]["arguments"] = call["function"]["arguments"].replace("cmd", command)
        rules = Rules(budget(8192, spill_chars=100_000), storage=storage, overflow_dir=outdir)
        marker = next(d.replacement for p in _session(msgs, rules, [], True) for d in p.new if d.kind == "elide")
        assert marker not in seen
        seen.add(marker)
        assert (f"`{command} 0`" in marker, storage in marker, outdir in marker) == (True, True, True)


def _checked_spans(seen: list[int]) -> Any:
    """``folds._fold_spans``, asserting each time that its spans are the whole walk's."""
    real = folds._fold_spans

    def spans(state: State, messages: Any, start: int, paired: bool) -> list[tuple[int, int]]:
        got = real(state, messages, start, paired)
        assert got == folds.rounds(messages, start, state.fenced if paired else ())
        seen.append(len(got))
        return got
    return spans


@given(argued_histories(), st.sampled_from([4096, 8192]))
def test_a_fold_pass_walks_on_from_the_rounds_the_last_one_found(case: tuple[list[Any], set[int]],
                                                                 window: int) -> None:
    """The rounds a fold pass starts from (kept from the pass before, walked on from the last one no message
    could change) are those a walk of the whole history finds, request after request, pins and all."""
    msgs, pinned = case
    rules = Rules(budget(window))
    ids = project(msgs, [message_hash(m) for m in msgs], [], rules, CharCounter()).state.ids
    pins = [Decision("pin", ids[i], source="operator") for i in sorted(pinned)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(folds, "_fold_spans", _checked_spans([]))
        _session(msgs, rules, pins, True)


def test_text_protocol_rounds_are_walked_on_as_they_pair() -> None:
    seen: list[int] = []
    msgs = fenced_history([f"out {k}\n" + "f" * 2500 for k in range(40)])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(folds, "_fold_spans", _checked_spans(seen))
        _session(msgs, fenced_rules(4096), [], True)
        unanswered = history(["u" * 2500] * 30)
        unanswered.insert(5, {"role": "assistant", "content": "never answered", "tool_calls": [
            {"id": "lost", "type": "function", "function": {"name": "sh", "arguments": "{}"}}]})
        _session(unanswered, Rules(budget(4096, spill_chars=100_000)), [], True)
    assert len(seen) > 10


_ROUND_STEP = st.one_of(
    st.lists(st.sampled_from(["a", "b", "c"]), max_size=2).map(
        lambda ids: {"role": "assistant", "content": "x", "tool_calls": [{"id": i} for i in ids]}),
    st.sampled_from(["a", "b", "c"]).map(lambda i: {"role": "tool", "tool_call_id": i}),
    st.just({"role": "user", "content": "results"}))


_CALL_A = {"role": "assistant", "content": "x", "tool_calls": [{"id": "a"}]}


@given(st.lists(_ROUND_STEP, max_size=25), st.lists(st.integers(0, 25), max_size=4), st.booleans(),
       st.sets(st.integers(0, 25)))
@example([_CALL_A, {"role": "user", "content": "r"}, {"role": "tool", "tool_call_id": "a"}], [2], True, set())
@example([{"role": "assistant", "content": "x"}, {"role": "user", "content": "results"}], [1], True, {1})
def test_rounds_walked_on_from_an_earlier_history_are_the_whole_walks(
        messages: list[Any], cuts_at: list[int], paired: bool, fenced: set[int]) -> None:
    """Any history, its spans found at earlier lengths first (an unanswered call, a results message not yet
    there), then at its own: the same as one walk of it."""
    state = State()
    for end in [*sorted(c for c in cuts_at if c <= len(messages)), len(messages)]:
        # the results messages the state knows of: those ingested so far, as in a projection
        state.fenced = {i: None for i in fenced if i < end and messages[i]["role"] == "user"}  # type: ignore[misc]
        got = folds._fold_spans(state, messages[:end], 0, paired)
        assert got == folds.rounds(messages[:end], 0, state.fenced if paired else ())


def test_a_full_marker_cache_starts_again_and_gives_the_same_markers() -> None:
    rules = Rules(budget(8192, spill_chars=100_000))
    msgs = history([f"line {k}\n" + "r" * 2000 for k in range(30)])
    kept = _session(msgs, rules, [], True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuts, "_MARKERS", {})
        patch.setattr(cuts, "_MARKERS_KEPT", 1)
        small = _session(msgs, rules, [], True)
        assert len(cuts._MARKERS) <= 1
    assert [(p.messages, p.new) for p in kept] == [(p.messages, p.new) for p in small]


def _fold_serialised(counter: list[int]) -> Any:
    """``folds.fold``, counting the messages it serialises (``canonical_json``) while it runs."""
    real_fold, real_json = folds.fold, folds.canonical_json

    def counting_json(value: Any) -> bytes:
        counter[0] += 1
        return real_json(value)

    def fold(*args: Any, **kwargs: Any) -> None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(folds, "canonical_json", counting_json)
            real_fold(*args, **kwargs)
    return fold


def test_a_fold_pass_finds_its_rounds_hashed_ahead() -> None:
    """Issue #13: a long session past its target folds again and again; with the rounds hashed ahead
    (``prime_fold``), each later pass serialises only what the requests before it did not reach, and the folds
    are the same, id for id, as those hashed afresh."""
    rules = Rules(budget(8192, spill_chars=100_000))
    msgs = history([f"line {k}\n" + "r" * 3000 for k in range(160)])
    made: dict[bool, tuple[list[Decision], int, int]] = {}
    for primed in (True, False):
        serialised, folded, decisions, state = [0], 0, [], None
        with pytest.MonkeyPatch.context() as patch:
            if not primed:
                patch.setattr(project_module, "prime_fold", lambda *_: None)
            patch.setattr(project_module, "fold", _fold_serialised(serialised))
            for request in prefixes(msgs):
                p = project(request, [message_hash(m) for m in request], decisions, rules, CharCounter(), state)
                decisions += p.new
                state = p.state
                folded += bool(p.report.folded)
        made[primed] = ([d for d in decisions if d.kind == "fold"], folded, serialised[0])
    (ahead, passes, few), (afresh, _, many) = made[True], made[False]
    assert passes >= 3 and ahead == afresh
    assert few * 3 < many
