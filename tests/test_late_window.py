"""#11: a window learned late strands nothing. An upstream that reports no window is budgeted at the 131072
fallback until its first refusal teaches the real one; the cuts made before (previews sized for the fallback, the
newest results protected) are re-cut for the real window once, instead of the request being refused."""

from __future__ import annotations

from typing import Any

from ctxproxy.config import load_settings
from ctxproxy.proxy.core.decisions import Decision
from ctxproxy.proxy.core.fenced import presets_for
from ctxproxy.proxy.core.identity import message_hash
from ctxproxy.proxy.core.invariants import broken_pairs
from ctxproxy.proxy.core.project import Projection, project
from ctxproxy.proxy.core.state import Rules, State
from ctxproxy.proxy.engine.budgets import budget_for
from tests.test_project import STUB, CharCounter, history

BIG = "\n".join(f"def handler_{n}(config, request):  # line {n}" for n in range(700))[:30_000]


def rules(window: int, fenced: bool = False, k: float = 1.0) -> Rules:
    settings = load_settings(env={})
    return Rules(budget_for(settings, window), k, fenced=presets_for(settings.fenced_presets) if fenced else ())


def run(messages: list[Any], rules: Rules, decisions: list[Decision], previous: State | None = None,
        seen: int = 0) -> Projection:
    return project(messages, [message_hash(m) for m in messages], decisions, rules, CharCounter(), previous, seen)


def fenced_history(results: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                  {"role": "user", "content": "Fix the failing test."}]
    for k in range(results):
        msgs += [{"role": "assistant", "content": f"THOUGHT: look.\n\n```mswea_bash_command\ncat big_{k}.py\n```"},
                 {"role": "user", "content": f"<returncode>0</returncode>\n<output>\n{k}{BIG}\n</output>"}]
    return msgs


def under_the_fallback(messages: list[dict[str, Any]], fenced: bool = False) -> tuple[list[Decision], Projection]:
    """The requests of a run up to ``messages``, each adding a round (only its result new), under the 131072
    fallback: the decisions they made, and the last projection."""
    decisions: list[Decision] = []
    state = None
    for end in range(4, len(messages) + 1, 2):
        last = run(messages[:end], rules(131072, fenced), decisions, state, seen=end - 1)
        decisions += last.new
        state = last.state
    return decisions, last


def learned_late(messages: list[dict[str, Any]], fenced: bool) -> tuple[Projection, Projection]:
    """The first requests under the fallback, then the same request again once the real window is known (the
    retry after the upstream's refusal, which also taught that the model counts half as many tokens again as the
    proxy): the spills were decided at the fallback's size."""
    decisions, first = under_the_fallback(messages, fenced)
    return first, run(messages, rules(2048, fenced, k=1.5), decisions, None, seen=len(messages))


def test_previews_sized_for_the_fallback_are_recut_when_the_window_shrinks() -> None:
    messages = history([BIG, BIG, BIG])
    first, retry = learned_late(messages, fenced=False)
    assert first.report.spilled == 1 and len(first.messages[-1]["content"]) > 4000  # previewed for the fallback
    assert not retry.report.over_budget, retry.report
    newest = retry.messages[-1]
    assert STUB.match(newest["content"]) and len(newest["content"]) < 1200  # re-spilled with the 2k window's preview
    assert "def handler_0(" in newest["content"]  # still a preview: its head is shown
    assert {d.kind for d in retry.new} <= {"spill", "elide"} and not retry.report.folded  # no text was folded
    assert not broken_pairs(retry.messages)
    assert all(w.body == BIG for w in retry.writes)  # every cut body is stored: restorable


def test_fenced_previews_sized_for_the_fallback_are_recut_when_the_window_shrinks() -> None:
    messages = fenced_history(3)
    _, retry = learned_late(messages, fenced=True)
    assert not retry.report.over_budget, retry.report
    newest = retry.messages[-1]["content"]
    assert newest.startswith("<returncode>0</returncode>\n<output>\n") and "def handler_0(" in newest
    assert len(newest) < 1500 and not retry.report.folded
    said = [m["content"] for m in retry.messages if m["role"] == "assistant"]
    assert said == [m["content"] for m in messages if m["role"] == "assistant"]  # no thought lost


def test_the_recut_is_made_once_and_kept() -> None:
    """The re-cut decisions are journaled like any other: recomputed from them (a restart) the projection is the
    same bytes, and the next round leaves the re-cut prefix as it was (the prefix breaks once)."""
    messages = history([BIG, BIG, BIG])
    _, retry = learned_late(messages, fenced=False)
    decisions = [*under_the_fallback(messages)[0], *retry.new]
    small = rules(2048, k=1.5)
    again = run(messages, small, decisions, None, seen=len(messages))
    assert again.messages == retry.messages and not again.new
    longer = history([BIG, BIG, BIG, "ok"])
    after = run(longer, small, decisions, again.state, seen=len(longer) - 1)
    assert after.messages[:len(retry.messages)] == retry.messages and not after.report.over_budget

