"""The pure projection: spill on arrival, elision under budget, folding as a last resort, pins, and the
invariants of DESIGN.md §6 over generated histories."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from ctxproxy.config import load_settings
from ctxproxy.proxy.core import cuts
from ctxproxy.proxy.core.budget import Budget
from ctxproxy.proxy.core.decisions import Decision
from ctxproxy.proxy.core.folds import fold_body
from ctxproxy.proxy.core.identity import message_hash
from ctxproxy.proxy.core.invariants import broken_pairs, violations
from ctxproxy.proxy.core.project import Projection, project
from ctxproxy.proxy.core.state import Rules, State, sha256_text
from ctxproxy.proxy.engine.budgets import budget_for

STUB = re.compile(r"^\[overflow id=([0-9a-f]{64}) tool=(\S+) bytes=(\d+) call_id=(\S+) storage=(disk|memory-only "
                  r"\(incognito\))\]\n")


class CharCounter:
    """4 characters a token plus 4 a message: fast and exact enough to test the rules."""

    def count(self, message: dict[str, Any], key: str | None = None) -> int:
        content = message.get("content")
        text = content if isinstance(content, str) else str(content or "")
        args = "".join(c["function"].get("arguments", "") for c in message.get("tool_calls") or [])
        return 4 + (len(text) + len(args)) // 4


def budget(window: int = 8192, **overrides: Any) -> Budget:
    return replace(budget_for(load_settings(env={}), window), **overrides)


def history(results: Sequence[str], task: str = "Fix the failing test.", call_id: str = "call_{}") -> list[Any]:
    msgs: list[Any] = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": task}]
    for k, out in enumerate(results):
        cid = call_id.format(k)
        msgs.append({"role": "assistant", "content": f"step {k}", "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "sh", "arguments": f'{{"command": "cmd {k}"}}'}}]})
        msgs.append({"role": "tool", "tool_call_id": cid, "content": out})
    return msgs


def run(messages: list[Any], rules: Rules, decisions: list[Decision] | None = None,
        previous: State | None = None) -> Projection:
    return project(messages, [message_hash(m) for m in messages], decisions or [], rules, CharCounter(), previous)


def session(requests: Sequence[list[Any]], rules: Rules) -> tuple[list[Projection], list[Decision]]:
    """Each request projected in turn, carrying the decisions and the state, as the proxy does."""
    decisions: list[Decision] = []
    state, out = None, []
    for messages in requests:
        p = run(messages, rules, decisions, state)
        decisions += p.new
        state = p.state
        out.append(p)
    return out, decisions


def prefixes(messages: list[Any]) -> list[list[Any]]:
    return [messages[:i + 1] for i, m in enumerate(messages) if m["role"] == "tool"]


def test_a_huge_result_is_spilled_on_arrival_with_an_exact_stub() -> None:
    big = "line of output\n" * 2000
    p = run(history(["ok", big]), Rules(budget(32768)))
    content = p.messages[-1]["content"]
    match = STUB.match(content)
    assert match is not None
    assert match.groups() == (sha256_text(big), "sh", str(len(big.encode())), "call_1", "disk")
    assert "read_overflow id=" + sha256_text(big) in content
    assert [(d.kind, d.target) for d in p.new] == [("spill", "tool:call_1")]
    assert [(w.overflow_id, w.body) for w in p.writes] == [(sha256_text(big), big)]
    assert len(content) < budget(32768).spill_chars


def test_a_spill_is_reapplied_byte_for_byte_and_never_decided_twice() -> None:
    big = "x" * 50_000
    first = run(history([big]), Rules(budget()))
    again = run(history([big, "ok"]), Rules(budget()), list(first.new))
    assert again.new == () and again.messages[3] == first.messages[3]


def test_short_and_read_overflow_results_are_never_cut() -> None:
    msgs = history(["y" * 599])
    msgs.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": "r", "type": "function", "function": {"name": "read_overflow", "arguments": "{}"}}]})
    msgs.append({"role": "tool", "tool_call_id": "r", "content": "z" * 50_000})
    p = run(msgs, Rules(budget(131072, spill_chars=600)))
    assert p.new == () and not p.changed


def test_binary_output_is_spilled_even_when_small() -> None:
    p = run(history(["\x00\x01\x02" * 300]), Rules(budget(131072)))
    assert "looks binary" in p.messages[-1]["content"]


def test_over_budget_the_oldest_results_are_elided_down_to_the_target() -> None:
    rules = Rules(budget(8192, spill_chars=100_000))
    projections, decisions = session(prefixes(history(["r" * 2000] * 20)), rules)
    elided = [d.target for d in decisions if d.kind == "elide"]
    assert elided == [f"tool:call_{k}" for k in range(len(elided))]  # oldest first
    for p in projections:
        assert p.report.estimate <= rules.budget.budget
    event = next(p for p in projections if p.report.elided)
    assert event.report.estimate <= rules.budget.target
    assert all(not p.report.elided for p in projections[projections.index(event) + 1:][:2])  # deep: then quiet


def test_the_newest_results_are_protected() -> None:
    rules = Rules(budget(8192, spill_chars=100_000, keep_results=5))
    p = session(prefixes(history(["r" * 3000] * 14)), rules)[0][-1]
    tools = [m for m in p.messages if m["role"] == "tool"]
    assert all(not m["content"].startswith("[overflow") for m in tools[-5:])


def test_markers_are_byte_identical_on_every_later_request() -> None:
    rules = Rules(budget(8192, spill_chars=100_000))
    projections, _ = session(prefixes(history(["r" * 3000] * 20)), rules)
    for before, after in itertools.pairwise(projections):
        later = {m.get("tool_call_id"): m for m in after.messages if m["role"] == "tool"}
        for a in before.messages:
            if isinstance(a.get("content"), str) and a["content"].startswith("[overflow"):
                assert later.get(a["tool_call_id"], a) == a  # unchanged, unless folded away since


def test_a_cut_goes_to_the_target_at_once_so_cuts_never_follow_each_other() -> None:
    """When eliding alone stops above the target (the newest results are protected), the fold follows in the
    same request: a request that cuts is never followed by another that cuts (each cut breaks the prefix cache)."""
    rules = Rules(budget(8192, spill_chars=100_000))
    projections, _ = session(prefixes(history(["r" * 3000] * 40)), rules)
    cut = [bool(p.report.elided or p.report.folded) for p in projections]
    assert sum(cut) >= 5 and not any(a and b for a, b in itertools.pairwise(cut))
    assert all(p.report.estimate <= rules.budget.target for p, c in zip(projections, cut, strict=True) if c)


def test_no_fold_under_budget_when_the_protected_newest_results_alone_exceed_the_target() -> None:
    """Folding would not reach the target, and would break the prefix at its start on every request."""
    rules = Rules(budget(8192, spill_chars=100_000))
    projections, _ = session(prefixes(history(["r" * 4200] * 20)), rules)
    assert all(p.report.estimate <= rules.budget.budget for p in projections)
    folds = [n for n, p in enumerate(projections) if p.report.folded]
    assert not any(b == a + 1 for a, b in itertools.pairwise(folds)), folds


def test_incremental_and_from_scratch_give_the_same_bytes() -> None:
    rules = Rules(budget(8192, spill_chars=4000))
    requests = prefixes(history([("q" * n) for n in (100, 5000, 3000, 9000, 2500, 3000, 700, 3000, 3000, 3000)]))
    projections, decisions = session(requests, rules)
    fresh = run(requests[-1], rules, decisions)
    assert fresh.messages == projections[-1].messages and fresh.new == ()


def test_reused_call_ids_get_distinct_identities() -> None:
    msgs = history(["a" * 20_000, "b" * 20_000], call_id="call_same")
    p = run(msgs, Rules(budget(32768)))
    assert [d.target for d in p.new] == ["tool:call_same", "tool:call_same#1"]
    assert violations(msgs, p.messages) == []


def test_an_operator_pin_keeps_a_result_whole_and_restores_a_cut_one() -> None:
    rules = Rules(budget(32768))
    msgs = history(["z" * 20_000])
    cut = run(msgs, rules)
    pinned = run(msgs, rules, [*cut.new, Decision("pin", "tool:call_0", source="operator")])
    assert pinned.messages == msgs and not pinned.changed
    assert violations(msgs, pinned.messages, pinned=[3]) == []


def test_a_restore_undoes_a_cut_until_the_rules_cut_afresh() -> None:
    """The operator's restore (the inspector): a spilled result goes whole; a spill is decided on arrival only, so
    it is not spilled again, and a later cut of the same message is a new decision that applies."""
    rules = Rules(budget(32768))
    msgs = history(["z" * 20_000, "short"])
    cut = run(msgs, rules)
    assert cut.messages != msgs
    restored = project(msgs, [message_hash(m) for m in msgs], [*cut.new, Decision("restore", "tool:call_0")], rules,
                       CharCounter(), seen=len(msgs))
    assert restored.messages == msgs and not restored.new
    again = run(msgs, rules, [*cut.new, Decision("restore", "tool:call_0"), *cut.new])
    assert again.messages == cut.messages


def test_folding_is_the_last_resort_and_keeps_pairs_whole() -> None:
    rules = Rules(budget(4096, spill_chars=100_000))
    msgs = history(["short output " * 10] * 120)  # nothing to elide: every result is under 600 characters
    p = run(msgs, rules)
    assert [d.kind for d in p.new] == ["fold"]
    stub = p.messages[2]
    assert stub["role"] == "user" and stub["content"].startswith("[folded id=")
    assert p.messages[:2] == msgs[:2] and p.messages[-4:] == msgs[-4:]
    assert violations(msgs, p.messages) == [] and p.report.estimate <= rules.budget.budget


def test_without_folding_an_unfittable_request_is_reported_with_what_takes_the_room() -> None:
    rules = Rules(budget(4096, spill_chars=100_000, fold_history=False), tools_tokens=500)
    p = run(history(["short output " * 10] * 120), rules)
    assert p.report.over_budget and p.new == ()
    assert ("tools", 500) in p.report.largest


def test_the_calibration_ratio_scales_every_threshold() -> None:
    requests = prefixes(history(["r" * 3000] * 10))
    plain = session(requests, Rules(budget(8192, spill_chars=100_000)))[1]
    scaled = session(requests, Rules(budget(8192, spill_chars=100_000), k=1.5))[1]
    assert len(scaled) > len(plain)


def test_null_contents_and_consecutive_user_messages_pass() -> None:
    msgs = history(["a" * 10_000])
    msgs[2]["content"] = None
    msgs.insert(2, {"role": "user", "content": "and also this"})
    p = run(msgs, Rules(budget(8192)))
    assert violations(msgs, p.messages) == [] and p.messages[2] == msgs[2]


def test_a_trailing_call_without_result_is_left_alone() -> None:
    msgs = history(["a" * 10_000])
    msgs.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": "final", "type": "function", "function": {"name": "submit", "arguments": "{}"}}]})
    p = run(msgs, Rules(budget(8192)))
    assert broken_pairs(p.messages) == {"final": 1} and violations(msgs, p.messages) == []


# --- properties ------------------------------------------------------------------------------------------------

sizes = st.one_of(st.integers(0, 800), st.integers(800, 20_000), st.integers(20_000, 200_000))
step = st.tuples(sizes, st.booleans(), st.booleans(), st.booleans())  # size, reuse an id, null content, user msg


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[Any], set[int]]:
    msgs: list[Any] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    for k, (size, reuse, null, user) in enumerate(draw(st.lists(step, min_size=1, max_size=25))):
        cid = "call_0" if reuse else f"call_{k}"
        msgs.append({"role": "assistant", "content": None if null else f"step {k}",
                     "tool_calls": [{"id": cid, "type": "function", "function": {"name": "sh", "arguments": "{}"}}]})
        msgs.append({"role": "tool", "tool_call_id": cid, "content": chr(97 + k % 26) * size})
        if user:
            msgs.append({"role": "user", "content": f"note {k}"})
    pins = draw(st.sets(st.sampled_from(range(len(msgs)))))
    return msgs, pins


@example(([{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}], set()), 4096)
@given(histories(), st.sampled_from([4096, 8192, 32768]))
def test_every_invariant_holds_on_every_request(case: tuple[list[Any], set[int]], window: int) -> None:
    msgs, pinned = case
    rules = Rules(budget(window))
    hashes = [message_hash(m) for m in msgs]
    ids = project(msgs, hashes, [], rules, CharCounter()).state.ids
    pins = [Decision("pin", ids[i], source="operator") for i in sorted(pinned)]
    decisions: list[Decision] = list(pins)
    state, bodies = None, {}
    for end in range(2, len(msgs) + 1):
        request = msgs[:end]
        p = project(request, hashes[:end], decisions, rules, CharCounter(), state)
        decisions += p.new
        state = p.state
        bodies |= {w.overflow_id: fold_body(request, w.span) if w.span and w.part == "messages" else w.body
                   for w in p.writes}
        assert violations(request, p.messages, pinned={i for i in pinned if i < end}) == []
        assert p.report.estimate <= rules.budget.budget or p.report.over_budget
        again = project(request, hashes[:end], decisions, rules, CharCounter())  # from scratch, same journal
        assert again.messages == p.messages and again.new == ()
        _assert_restorable(request, p.messages, bodies)


def _assert_restorable(incoming: list[Any], outgoing: list[Any], bodies: dict[str, str]) -> None:
    """Every cut names an overflow body whose bytes are exactly what was cut."""
    for m in outgoing:
        content = m.get("content")
        match = re.match(r"^\[(?:overflow|folded) id=([0-9a-f]{64})", content) if isinstance(content, str) else None
        if match:
            body = bodies[match.group(1)]
            assert sha256_text(body) == match.group(1)
            if m["role"] == "tool":
                assert any(x.get("content") == body for x in incoming if x.get("role") == "tool")


def test_a_fold_made_for_another_history_is_ignored_not_fatal() -> None:
    rules = Rules(budget(4096, spill_chars=100_000))
    folded = run(history(["short output " * 10] * 120), rules)
    other = history(["other output " * 10] * 120, task="Another task entirely.")
    p = run(other, rules, list(folded.new))  # a fork that inherited the fold of a different run
    assert violations(other, p.messages) == [] and [d.kind for d in p.new] == ["fold"]


def test_an_elision_marker_names_the_call_its_result_answered_when_ids_are_reused() -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "t"}]
    for k, command in enumerate(["cat secrets.txt", "ls -la /"] + ["echo"] * 12):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [{"id": "same", "type": "function",
                     "function": {"name": f"tool{k}", "arguments": json.dumps({"command": command})}}]})
        msgs.append({"role": "tool", "tool_call_id": "same", "content": f"{k}" * 2000})
    p = run(msgs, Rules(budget(8192, spill_chars=100_000, fold_history=False)))
    marker = p.messages[3]["content"]
    assert "tool=tool0" in marker and "cat secrets.txt" in marker


def test_a_recomputation_never_spills_what_the_session_had_already_seen() -> None:
    msgs = history(["x" * 3000, "y" * 3000])
    loose = Rules(budget(131072))  # spill_chars 10000: nothing spilled
    first = run(msgs, loose)
    strict = Rules(budget(131072, spill_chars=2000))  # the rules changed since (another model, another window)
    again = project(msgs, [message_hash(m) for m in msgs], list(first.new), strict, CharCounter(), seen=len(msgs))
    assert again.messages == first.messages == msgs


def test_a_round_with_a_message_between_call_and_result_folds_whole() -> None:
    msgs = history(["short output " * 10] * 120)
    msgs.insert(3, {"role": "user", "content": "(the person typed while the tool ran)"})
    p = run(msgs, Rules(budget(4096, spill_chars=100_000)))
    assert violations(msgs, p.messages) == [] and any(d.kind == "fold" for d in p.new)


def test_a_spill_never_makes_a_result_bigger() -> None:
    content = "z" * 610
    p = run(history([content]), Rules(budget(4096)))  # spill_chars 600: the stub would be longer than 610
    assert p.messages[-1]["content"] == content


# --- text-protocol (fenced) histories ----------------------------------------------------------------------------

def fenced_history(outputs: Sequence[str]) -> list[Any]:
    msgs: list[Any] = [{"role": "system", "content": "Reply with one ```bash``` block."},
                       {"role": "user", "content": "Fix the failing test."}]
    for k, out in enumerate(outputs):
        msgs.append({"role": "assistant", "content": f"Step {k}.\n```bash\npytest -k case{k}\n```"})
        msgs.append({"role": "user", "content": f"<returncode>0</returncode>\n<output>\n{out}\n</output>"})
    return msgs


def fenced_rules(window: int = 8192, **overrides: Any) -> Rules:
    from ctxproxy.proxy.core.fenced import builtin_presets

    return Rules(budget(window, **overrides), fenced=builtin_presets())


def test_a_huge_fenced_result_is_spilled_inside_its_wrapper() -> None:
    big = "x" * 30_000
    msgs = fenced_history(["ok", big])
    p = run(msgs, fenced_rules(32768))
    content = p.messages[-1]["content"]
    assert content.startswith("<returncode>0</returncode>\n<output>\n[overflow id=")
    assert content.endswith("\n</output>") and "call_id=r2.1 " in content and " tool=pytest bytes=" in content
    assert [(w.overflow_id, w.body) for w in p.writes] == [(sha256_text(big), big)]
    fenced = {i: r.segments for i, r in p.state.fenced.items()}
    assert violations(msgs, p.messages, fenced=fenced) == []
    assert violations(msgs, p.messages) != []  # without knowing the segments, a changed user message is flagged


def test_old_fenced_results_are_elided_and_the_newest_rounds_kept() -> None:
    rules = fenced_rules(8192, spill_chars=100_000, keep_tool_rounds=3)
    msgs = fenced_history([f"{k}" * 2000 for k in range(14)])
    projections, decisions = session([msgs[: 2 * n + 4] for n in range(1, 14)], rules)
    last = projections[-1]
    assert any(d.kind == "elide" and "@0" in d.target for d in decisions)
    fenced = {i: r.segments for i, r in last.state.fenced.items()}
    assert violations(msgs[: len(last.state.ids)], last.messages, fenced=fenced) == []
    tail = [m["content"] for m in last.messages[-6:] if m["role"] == "user"]
    assert all("[overflow id=" not in c for c in tail)  # the newest three rounds are whole
    assert last.report.estimate <= rules.budget.budget


def test_a_persons_large_paste_goes_to_overflow_and_the_typed_words_stay() -> None:
    pasted = "".join(f"2024-06-01 12:00:{i % 60:02d} ERROR worker {i} crashed\n" for i in range(1200))
    typed = "Here is the log from last night:\n\n```\n" + pasted + "```\n\nWhat went wrong?"
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": typed}]
    p = run(msgs, Rules(budget(131072, paste_chars=20_000)))
    content = p.messages[1]["content"]
    assert content.startswith("Here is the log from last night:\n\n```\n[overflow id=")
    assert content.endswith("```\n\nWhat went wrong?") and "tool=paste" in content
    assert [w.body for w in p.writes] == [pasted]
    fenced = {i: r.segments for i, r in p.state.fenced.items()}
    assert violations(msgs, p.messages, fenced=fenced) == []


def test_one_long_paragraph_is_left_as_the_person_typed_it() -> None:
    msgs = [{"role": "user", "content": "word " * 10_000}]
    assert not run(msgs, Rules(budget(131072, paste_chars=20_000))).changed


@st.composite
def argued_histories(draw: st.DrawFn) -> tuple[list[Any], set[int]]:
    """``histories`` whose calls may carry long arguments (a write's body): the other kind of elision candidate."""
    msgs, pins = draw(histories())
    for m in msgs:
        if m.get("tool_calls") and draw(st.booleans()):
            m["tool_calls"][0]["function"]["arguments"] = json.dumps({"path": "f.py", "text": "w" * draw(sizes)})
    return msgs, pins


@given(argued_histories(), st.sampled_from([4096, 8192, 32768]))
def test_an_elision_pass_that_starts_after_the_settled_candidates_cuts_what_a_whole_pass_cuts(
        case: tuple[list[Any], set[int]], window: int) -> None:
    """Issue #13: ``elide`` starts after the candidates a resumed state knows are settled (``State.settled``) and
    moves past those it finds settled; a pass that walks every candidate, from the same state, projects every
    request to the same messages and the same decisions."""
    msgs, pinned = case
    rules = Rules(budget(window))
    hashes = [message_hash(m) for m in msgs]
    ids = project(msgs, hashes, [], rules, CharCounter()).state.ids
    decisions: list[Decision] = [Decision("pin", ids[i], source="operator") for i in sorted(pinned)]
    state = None
    for end in range(2, len(msgs) + 1):
        whole = None if state is None else replace(state.copy(), settled=0)
        p = project(msgs[:end], hashes[:end], decisions, rules, CharCounter(), state)
        with pytest.MonkeyPatch.context() as walk_all:
            walk_all.setattr(cuts, "_settled", lambda *_: False)
            q = project(msgs[:end], hashes[:end], decisions, rules, CharCounter(), whole)
        assert (p.messages, p.new) == (q.messages, q.new)
        decisions += p.new
        state = p.state


def _reference_pairs(messages: list[Any]) -> Counter[str]:
    """``broken_pairs`` as it was written first: every id counted, the zeros dropped at the end."""
    open_calls: Counter[str] = Counter()
    orphans: Counter[str] = Counter()
    for m in messages:
        for call in m.get("tool_calls") or []:
            open_calls[str(call.get("id"))] += 1
        if m.get("role") == "tool":
            cid = str(m.get("tool_call_id"))
            if open_calls[cid]:
                open_calls[cid] -= 1
            else:
                orphans[cid] += 1
    return +(open_calls + orphans)


_PAIR_STEP = st.one_of(
    st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3).map(
        lambda ids: {"role": "assistant", "tool_calls": [{"id": i} for i in ids]}),
    st.sampled_from(["a", "b", "c", "d"]).map(lambda i: {"role": "tool", "tool_call_id": i}),
    st.just({"role": "user", "content": "x"}))


@given(st.lists(_PAIR_STEP, max_size=30))
def test_broken_pairs_lets_closed_ids_go_and_finds_what_it_always_found(messages: list[Any]) -> None:
    """Issue #13: ids whose calls are all answered are dropped as they close (one pass over a long history)."""
    assert broken_pairs(messages) == _reference_pairs(messages)
