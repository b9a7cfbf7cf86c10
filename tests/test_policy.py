"""The pure policy beside the turn engine (``proxy.engine.policy``), without HTTP, journal or session: the offer
rule, the notices, and how the request that goes upstream is assembled."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from ctxproxy.proxy.core import Decision, message_hash
from ctxproxy.proxy.engine.policy import (
    COMPACT,
    assemble,
    confirmation_notice,
    guidance,
    listed_tools,
    offer_due,
    reminder_due,
    restorable,
)
from ctxproxy.proxy.tools.blocks import NOTE, RESTORE_NOTE
from ctxproxy.proxy.tools.schemas import CONTEXT_TOOLS, READ_TOOL

AGENT_TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {}}}


def test_the_tools_are_offered_from_the_usage_threshold_on() -> None:
    assert not offer_due(False, 0.44, 0.45, False, 1, 12)
    assert offer_due(False, 0.45, 0.45, False, 1, 12)


def test_the_tools_are_offered_when_the_person_asks_or_the_turn_runs_long() -> None:
    assert offer_due(False, 0.1, 0.45, True, 1, 12)
    assert offer_due(False, 0.1, 0.45, False, 12, 12)
    assert not offer_due(False, 0.1, 0.45, False, 99, 0), "offer_round 0: never by rounds"


@given(usage=st.floats(0, 1), asked=st.booleans(), round_=st.integers(0, 50))
def test_an_offer_holds_for_the_rest_of_the_turn(usage: float, asked: bool, round_: int) -> None:
    """DESIGN §5: once offered in a turn, whatever the usage does after, the tool list does not change."""
    assert offer_due(True, usage, 0.45, asked, round_, 12)


def test_the_reminder_comes_once_per_offered_turn_near_the_ceiling() -> None:
    assert reminder_due(True, 860, 0.85, 1000, None, "turn-1")
    assert not reminder_due(True, 860, 0.85, 1000, "turn-1", "turn-1"), "already reminded in this turn"
    assert not reminder_due(True, 840, 0.85, 1000, None, "turn-1"), "below the soft ceiling"
    assert not reminder_due(False, 990, 0.85, 1000, None, "turn-1"), "the tools are not offered"


def test_the_confirmations_are_one_system_line() -> None:
    notice = confirmation_notice(["Dropped m1.", "Noted m2."])
    assert notice == {"role": "system", "content": "[ctxproxy] Applied since your last request: Dropped m1. Noted m2."}


def test_guidance_names_the_fenced_syntax_compact_and_the_mirror() -> None:
    assert guidance(False, True, True, None, None) == [], "native: the tool list says it all"
    assert [m["content"] for m in guidance(True, True, False, None, None)] == [NOTE]
    assert [m["content"] for m in guidance(True, False, True, None, None)] == [RESTORE_NOTE]
    lines = [m["content"] for m in guidance(False, True, False, "keep the plan", Path("/tmp/LIVE_CONTEXT.json"))]
    assert lines[0] == COMPACT + " The person adds: keep the plan" and "/tmp/LIVE_CONTEXT.json" in lines[1]


def test_read_overflow_stays_listed_once_anything_was_cut() -> None:
    cut = Decision(kind="elide", target="m1")
    assert restorable([cut], []) and restorable([], [cut]) and not restorable([], [])
    assert listed_tools(True, False, True) == CONTEXT_TOOLS
    assert listed_tools(False, True, True) == (READ_TOOL,)
    assert listed_tools(False, True, False) == (), "no tool list to put it in"


def test_an_unchanged_request_is_not_marked_changed() -> None:
    messages = [{"role": "user", "content": "hi"}]
    payload = assemble({"model": "m", "messages": messages}, list(messages), [message_hash(messages[0])], False,
                       [], (), False, fill_null=False)
    assert not payload.changed and payload.sent == messages


def test_the_proxys_tools_follow_the_agents_and_its_lines_follow_the_projection() -> None:
    messages = [{"role": "user", "content": "hi"}]
    notice = confirmation_notice(["Dropped m1."])
    payload = assemble({"messages": messages, "tools": [AGENT_TOOL]}, list(messages), ["h"], False, [notice],
                       (READ_TOOL,), False, fill_null=False)
    assert payload.changed and payload.sent == [*messages, notice]
    assert payload.body["tools"] == [AGENT_TOOL, READ_TOOL] and payload.hashes == ["h", message_hash(notice)]
    fenced = assemble({"messages": messages}, list(messages), ["h"], False, [], (READ_TOOL,), True, fill_null=False)
    assert "tools" not in fenced.body, "the fenced route names the tools in a note"


def test_null_content_is_filled_only_when_asked_and_rehashed() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": []}]
    hashes = [message_hash(m) for m in messages]
    kept = assemble({"messages": messages}, list(messages), hashes, False, [], (), False, fill_null=False)
    filled = assemble({"messages": messages}, list(messages), hashes, False, [], (), False, fill_null=True)
    assert not kept.changed and kept.sent[1]["content"] is None
    assert filled.changed and filled.sent[1]["content"] == "" and filled.hashes[1] == message_hash(filled.sent[1])
    assert messages[1]["content"] is None, "the client's message is not touched"
