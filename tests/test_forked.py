"""A fork projected from its parent's state cut to their shared messages gives what a projection from the
decisions gives (``proxy.core.forked``), and ingests only the fork's own messages."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from ctxproxy.proxy.core.decisions import Decision
from ctxproxy.proxy.core.forked import prefix_state
from ctxproxy.proxy.core.identity import message_hash
from ctxproxy.proxy.core.project import Projection, absorbed_state, project
from ctxproxy.proxy.core.state import Rules, State
from tests.test_project import CharCounter, budget, histories, history, prefixes, session


class Tally(CharCounter):
    """CharCounter that says how many messages it was asked to count."""

    def __init__(self) -> None:
        self.calls = 0

    def count(self, message: dict[str, Any], key: str | None = None) -> int:
        self.calls += 1
        return super().count(message, key)


def _parent(messages: list[Any], rules: Rules) -> tuple[State, list[Decision]]:
    projections, decisions = session(prefixes(messages), rules)
    return projections[-1].state, decisions


def _edited(messages: list[Any], at: int) -> list[Any]:
    fork = list(messages)
    fork[at] = fork[at] | {"content": f"edited\n{fork[at].get('content')}"}
    return fork


def _both(fork: list[Any], shared: int, parent: State, decisions: list[Decision], rules: Rules,
          counter: Any = None) -> tuple[Projection, Projection | None]:
    hashes = [message_hash(m) for m in fork]
    fresh = project(fork, hashes, decisions, rules, CharCounter(), None, shared)
    start = prefix_state(parent, shared, fork, hashes, len(decisions))
    if start is None:
        return fresh, None
    return fresh, project(fork, hashes, decisions, rules, counter or CharCounter(), start, shared)


def _same(fresh: Projection, cut: Projection) -> None:
    assert cut.messages == fresh.messages and cut.hashes == fresh.hashes and cut.new == fresh.new
    assert [w.overflow_id for w in cut.writes] == [w.overflow_id for w in fresh.writes]
    assert cut.report.estimate == fresh.report.estimate and cut.changed == fresh.changed
    # a running digest (None after a recomputation); out: compared above; settled: how far earlier passes found the
    # candidates settled (a recomputation starts again from 0; tests/test_project.py holds it to a whole pass);
    # touched: what this projection changed since the last (all of it, recomputed), for the invariant check;
    # primed: how far markers were counted ahead (only the counter's cache holds them); spans: the last fold
    # pass's rounds (a recomputation walks them afresh); fold_ahead: the next fold's rounds hashed ahead so far
    left_out = {"fold_sum", "absorbed", "out", "settled", "touched", "primed", "spans", "fold_ahead"}
    for f in fields(State):
        if f.name not in left_out:
            assert getattr(cut.state, f.name) == getattr(fresh.state, f.name), f.name


def test_a_fork_from_the_parents_state_is_the_fork_from_the_decisions() -> None:
    rules = Rules(budget(8192, spill_chars=4000))
    messages = history([("q" * n) for n in (100, 5000, 3000, 9000, 2500, 3000, 700, 3000, 3000, 3000, 2000)])
    parent, decisions = _parent(messages, rules)
    assert any(d.kind == "elide" for d in decisions)  # the parent's state carries cuts the fork inherits
    for at in (len(messages) - 1, len(messages) - 5, 7):
        fresh, cut = _both(_edited(messages, at), at, parent, decisions, rules)
        assert cut is not None
        _same(fresh, cut)


def test_a_fork_ingests_only_its_own_messages() -> None:
    rules = Rules(budget(8192, spill_chars=4000))
    messages = history([("q" * n) for n in (100, 5000, 3000, 9000, 2500, 3000, 700, 3000, 3000, 3000, 2000)])
    parent, decisions = _parent(messages, rules)
    counter = Tally()
    at = len(messages) - 3
    _, cut = _both(_edited(messages, at), at, parent, decisions, rules, counter)
    assert cut is not None and cut.report.reused == at
    assert counter.calls <= 2 * (len(messages) - at)  # each own message, and its stub if one is cut now


def test_a_new_run_at_the_opening_does_not_walk_the_parent_s_history() -> None:
    """A new run forks a long session at its opening (2 of 120 messages, every request of the peers' benchmark):
    the counts of its 2 messages are taken from them, not from the parent's 118 others subtracted (100 µs a request)."""
    rules = Rules(budget(8192, spill_chars=4000))
    messages = history([("q" * n) for n in (100, 5000, 3000, 9000, 2500, 3000, 700, 3000, 3000, 3000, 2000)])
    parent, decisions = _parent(messages, rules)
    fork = [*messages[:2], {"role": "user", "content": "continue (nonce 1)"}]
    hashes = [message_hash(m) for m in fork]
    expected = prefix_state(parent, 2, fork, hashes, len(decisions))
    unread = parent.copy()
    unread.out = [*parent.out[:2], *[None] * (len(parent.out) - 2)]  # what is never read may be anything
    cut = prefix_state(unread, 2, fork, hashes, len(decisions))
    assert cut is not None and expected is not None
    assert all(getattr(cut, f.name) == getattr(expected, f.name) for f in fields(State))
    fresh, projected = _both(fork, 2, parent, decisions, rules)
    assert projected is not None
    _same(fresh, projected)


def test_the_parents_state_is_left_as_it_was() -> None:
    rules = Rules(budget(8192, spill_chars=4000))
    messages = history([("q" * n) for n in (100, 5000, 3000, 9000, 2500, 3000, 700, 3000)])
    parent, decisions = _parent(messages, rules)
    before = parent.copy()
    _both(_edited(messages, 9) + history(["new " * 900])[2:], 9, parent, decisions, rules)
    assert all(getattr(parent, f.name) == getattr(before, f.name) for f in fields(State))


def test_a_fold_reaching_past_the_shared_messages_is_recomputed() -> None:
    rules = Rules(budget(4096, spill_chars=100_000))
    messages = history(["short output " * 10] * 120)
    parent, decisions = _parent(messages, rules)
    assert parent.folded is not None
    at = parent.folded[1] - 2
    assert prefix_state(parent, at, messages, [message_hash(m) for m in messages], len(decisions)) is None
    fresh, cut = _both(_edited(messages, len(messages) - 1), len(messages) - 1, parent, decisions, rules)
    assert cut is not None  # a fold within the shared messages is kept
    _same(fresh, cut)


def test_a_state_out_of_step_with_the_decisions_or_the_history_is_not_used() -> None:
    rules = Rules(budget(8192, spill_chars=4000))
    messages = history([("q" * n) for n in (100, 5000, 3000, 9000, 2500, 3000)])
    parent, decisions = _parent(messages, rules)
    hashes = [message_hash(m) for m in messages]
    assert prefix_state(parent, 6, messages, hashes, len(decisions) + 1) is None  # a decision it does not reflect
    other = _edited(messages, 3)
    assert prefix_state(parent, 6, other, [message_hash(m) for m in other], len(decisions)) is None
    assert prefix_state(parent, len(messages) + 1, messages, hashes, len(decisions)) is None
    hidden = parent.copy()
    hidden.hides = (Decision("hide", "x"),)
    assert prefix_state(hidden, 6, messages, hashes, len(decisions)) is None


@example(([{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}], set()), 4096, 0.5)
@given(histories(), st.sampled_from([4096, 8192]), st.floats(0.1, 1.0))
def test_every_fork_point_gives_the_projection_from_the_decisions(case: tuple[list[Any], set[int]], window: int,
                                                                   where: float) -> None:
    messages, _ = case
    rules = Rules(budget(window))
    parent, decisions = _parent(messages, rules) if len(messages) > 2 else (None, [])
    if parent is None:
        return
    at = max(1, min(len(messages) - 1, int(len(messages) * where)))
    edited = [*_edited(messages, at), {"role": "user", "content": "and then"}]
    retried = [*messages[:at], {"role": "user", "content": "try again from here"}]  # what followed is gone: a
    for fork in (edited, retried):  # call id it reused is the one before the fork, not the parent's latest
        fresh, cut = _both(fork, at, parent, decisions, rules)
        if cut is not None:
            _same(fresh, cut)


@given(histories(), st.sampled_from([4096, 8192]), st.floats(0.0, 1.0))
def test_a_projection_from_the_absorbed_decisions_is_the_projection_from_the_decisions(
        case: tuple[list[Any], set[int]], window: int, where: float) -> None:
    """A new run's first request starts from the state its inherited decisions make before any message, absorbed
    once (``absorbed_state``): its projection is the one that absorbs them itself, and the absorbed state is left
    as it was for the next session that inherits them."""
    messages, pinned = case
    rules = Rules(budget(window))
    projections, decisions = session(prefixes(messages), rules)
    ids = projections[-1].state.ids if projections else []
    cut = [d for d in decisions if d.kind != "fold"][:1]
    decisions += [Decision("pin", ids[i], source="operator") for i in sorted(pinned) if i < len(ids)]
    decisions += [Decision("restore", d.target, source="model") for d in cut]  # taken back, then pinned or not
    run = [*messages[:max(2, int(len(messages) * where))], {"role": "user", "content": "a run of its own"}]
    hashes = [message_hash(m) for m in run]
    absorbed = absorbed_state(decisions)
    before = absorbed.copy()
    fresh = project(run, hashes, decisions, rules, CharCounter(), None, 2)
    started = project(run, hashes, decisions, rules, CharCounter(), absorbed.copy(), 2)
    assert started.report.reused == 0
    _same(fresh, started)
    assert all(getattr(absorbed, f.name) == getattr(before, f.name) for f in fields(State))
