"""Argument cuts (the second seed: "tool results and call arguments may be removed"): the large string values of
old calls become restorable stubs, the call's id and name intact, its arguments still JSON."""

from __future__ import annotations

import json
from typing import Any

from ctxproxy.proxy.core.arguments import args_target, cut_arguments
from ctxproxy.proxy.core.invariants import violations
from ctxproxy.proxy.core.state import Rules, sha256_text
from ctxproxy.proxy.core.stubs import parse_stub
from tests.test_project import budget, run, session

BODY = "".join(f"def function_{i}():\n    return {i}\n" for i in range(150))  # ~4 KB of a file written


def writes(n: int) -> list[Any]:
    """An agent that writes a file per round: the bodies live in the calls, the results are one line."""
    msgs: list[Any] = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Write it."}]
    for k in range(n):
        arguments = json.dumps({"path": f"src/m{k}.py", "content": f"# module {k}\n" + BODY})
        msgs.append({"role": "assistant", "content": f"Writing m{k}.", "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": "write_file", "arguments": arguments}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{k}", "content": f"wrote src/m{k}.py"})
    return msgs


def prefixes(messages: list[Any]) -> list[list[Any]]:
    return [messages[:i + 1] for i, m in enumerate(messages) if m["role"] == "tool"]


def test_old_write_bodies_are_cut_to_stubs_with_the_call_intact() -> None:
    rules = Rules(budget(8192, spill_chars=100_000, keep_results=2))
    projections, decisions = session(prefixes(writes(12)), rules)
    last, incoming = projections[-1], writes(12)
    assert last.report.estimate <= rules.budget.budget and not any(d.kind == "fold" for d in decisions)
    cut = [d for d in decisions if ">args:" in d.target]
    assert cut and cut[0].target.endswith(">args:call_0")
    call = last.messages[2]["tool_calls"][0]
    assert (call["id"], call["function"]["name"], last.messages[2]["content"]) == ("call_0", "write_file",
                                                                                   "Writing m0.")
    arguments = json.loads(call["function"]["arguments"])
    assert arguments["path"] == "src/m0.py"
    fields = parse_stub(arguments["content"].splitlines()[0])
    original = json.loads(incoming[2]["tool_calls"][0]["function"]["arguments"])["content"]
    assert fields == {"id": sha256_text(original), "tool": "write_file", "bytes": str(len(original.encode())),
                      "call_id": "call_0", "storage": "disk"}
    assert any(w.body == original for p in projections for w in p.writes)
    assert violations(incoming, last.messages) == []
    newest = last.messages[-2]["tool_calls"][0]["function"]["arguments"]  # the newest calls are kept whole
    assert newest == incoming[-2]["tool_calls"][0]["function"]["arguments"]


def test_argument_cuts_are_byte_identical_when_reapplied_from_the_journal() -> None:
    rules = Rules(budget(8192, spill_chars=100_000, keep_results=2))
    projections, decisions = session(prefixes(writes(12)), rules)
    again = run(writes(12), rules, decisions)  # a restart: everything recomputed from the decisions
    assert again.new == () and again.messages == projections[-1].messages


def test_arguments_that_are_not_a_json_object_or_hold_nothing_large_are_left_alone() -> None:
    assert cut_arguments("not json " * 200, "sh", "c", "disk") is None
    assert cut_arguments(json.dumps(["x" * 5000]), "sh", "c", "disk") is None
    assert cut_arguments(json.dumps({"path": "a.py", "n": 3}), "sh", "c", "disk") is None
    nested = cut_arguments(json.dumps({"edits": [{"old": "a", "new": "y" * 3000}]}), "multi_edit", "c7", "disk")
    assert nested is not None and json.loads(nested.arguments)["edits"][0]["old"] == "a"
    assert json.loads(nested.arguments)["edits"][0]["new"].startswith("[overflow id=")
    assert args_target("m", "c7") == "m>args:c7"


def test_a_writing_agent_keeps_every_round_where_results_alone_would_fold() -> None:
    """60 file writes of ~4 KB at a 16k window: without argument cuts the oldest rounds fold (17 folds, 8 of the 60
    assistant texts left); with them nothing folds and every assistant text stays."""
    rules = Rules(budget(16384, spill_chars=100_000))
    projections, decisions = session(prefixes(writes(60)), rules)
    assert not any(d.kind == "fold" for d in decisions)
    assert all(p.report.estimate <= rules.budget.budget for p in projections)
    texts = [m["content"] for m in projections[-1].messages if m["role"] == "assistant"]
    assert texts == [f"Writing m{k}." for k in range(60)]


def test_a_pin_on_a_call_whose_arguments_were_cut_restores_them() -> None:
    from ctxproxy.proxy.tools.apply import View, apply_intent
    from ctxproxy.proxy.tools.intents import Pin
    from tests.test_project import CharCounter

    rules = Rules(budget(16384, spill_chars=100_000))
    msgs = writes(20)
    projections, decisions = session(prefixes(msgs), rules)
    assert ">args:call_0" in next(d.target for d in decisions if ">args:" in d.target)
    view = View(msgs, projections[-1].state, rules, CharCounter(), 20, "approval_id=\\S+", 0)
    pin = apply_intent(Pin((), "Writing m0."), view)
    assert pin.ok, pin.text
    again = run(msgs, rules, [*decisions, *pin.decisions])
    assert again.messages[2] == msgs[2]  # pinned: whole again
