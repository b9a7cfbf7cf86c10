"""The turn engine on its own, the way mitmproxy's playbooks test a layer: feed events, assert the commands.

No HTTP, no journal, no upstream: ``Turn`` is plain values in and out (``proxy.engine.turn``).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ctxproxy.proxy.engine.turn import (
    Answered,
    Command,
    EndEarly,
    Event,
    Failed,
    Forward,
    RecordRound,
    Refused,
    Reply,
    RunTools,
    Start,
    ToolsRan,
    Turn,
)

STATUS = {"id": "c1", "type": "function", "function": {"name": "context_status", "arguments": "{}"}}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "42 tokens"}


def playbook(turn: Turn, *steps: tuple[Event, list[Command]]) -> None:
    for event, expected in steps:
        assert turn.handle(event) == expected, event


def test_an_answer_without_context_calls_is_the_reply() -> None:
    playbook(Turn(rounds=2),
             (Start(), [Forward((), offer=True)]),
             (Answered(text="hello"), [Reply()]))


def test_an_upstream_error_goes_to_the_agent_as_it_came() -> None:
    playbook(Turn(rounds=2), (Start(), [Forward()]), (Failed(), [Reply()]))


def test_context_calls_only_are_run_spliced_and_asked_again() -> None:
    turn = Turn(rounds=2)
    spliced = ({"role": "assistant", "content": "", "tool_calls": [STATUS]}, RESULT)
    playbook(turn,
             (Start(), [Forward((), offer=True)]),
             (Answered((STATUS,), text=""), [RunTools((STATUS,))]),
             (ToolsRan((RESULT,)), [RecordRound(1), Forward(spliced, offer=True)]),
             (Answered(text="done"), [Reply()]))
    assert turn.internal == 1


def test_the_last_round_goes_without_the_tools_and_its_calls_are_not_followed() -> None:
    """``max_context_rounds=1``: one follow-up, offered no tools; calls it makes anyway run, and it is the reply."""
    turn = Turn(rounds=1)
    playbook(turn,
             (Start(), [Forward((), offer=True)]),
             (Answered((STATUS,), text=""), [RunTools((STATUS,))]))
    [record, follow] = turn.handle(ToolsRan((RESULT,)))
    assert record == RecordRound(1) and isinstance(follow, Forward) and not follow.offer
    playbook(turn,
             (Answered((STATUS,), text=""), [RunTools((STATUS,))]),
             (ToolsRan((RESULT,)), [Reply(took_calls=True)]))


def test_a_mixed_answer_runs_the_context_calls_and_goes_to_the_agent() -> None:
    playbook(Turn(rounds=3),
             (Start(), [Forward()]),
             (Answered((STATUS,), acts=True, text="reading"), [RunTools((STATUS,))]),
             (ToolsRan((RESULT,)), [Reply(took_calls=True, acts=True)]))


def test_without_rounds_the_first_forward_offers_nothing() -> None:
    playbook(Turn(rounds=0), (Start(), [Forward((), offer=False)]),
             (Answered((STATUS,)), [RunTools((STATUS,))]), (ToolsRan((RESULT,)), [Reply(took_calls=True)]))


def test_a_refused_follow_up_ends_early() -> None:
    playbook(Turn(rounds=2),
             (Start(), [Forward()]),
             (Answered((STATUS,), text=""), [RunTools((STATUS,))]),
             (ToolsRan((RESULT,)), [RecordRound(1), Forward(({"role": "assistant", "content": "",
                                                               "tool_calls": [STATUS]}, RESULT))]),
             (Refused(), [EndEarly()]))


def test_fenced_calls_are_spliced_as_the_text_and_one_results_message() -> None:
    block = {"id": "ctx_block_0", "type": "function", "function": {"name": "context_status", "arguments": "{}"}}
    turn = Turn(rounds=2)
    turn.handle(Start())
    turn.handle(Answered((block,), text="```context\n{}\n```", fenced=True))
    [_, follow] = turn.handle(ToolsRan(({"role": "tool", "tool_call_id": "ctx_block_0", "content": "ok"},)))
    assert isinstance(follow, Forward)
    said, results = follow.splice
    assert said == {"role": "assistant", "content": "```context\n{}\n```"}
    assert results["role"] == "user" and "ok" in results["content"]


@given(rounds=st.integers(0, 6), acts_at=st.integers(0, 8))
def test_every_turn_ends_in_one_reply_within_its_rounds(rounds: int, acts_at: int) -> None:
    """Whatever the model does, a turn forwards at most ``rounds + 1`` times and ends with one reply."""
    turn, forwards, ended = Turn(rounds), 0, []
    commands = turn.handle(Start())
    while commands:
        command, *rest = commands
        commands = rest
        if isinstance(command, Forward):
            forwards += 1
            commands += turn.handle(Answered((STATUS,), acts=forwards > acts_at, text=""))
        elif isinstance(command, RunTools):
            commands += turn.handle(ToolsRan((RESULT,)))
        elif isinstance(command, Reply | EndEarly):
            ended.append(command)
    assert forwards <= rounds + 1 and len(ended) == 1 and turn.internal == forwards - 1
