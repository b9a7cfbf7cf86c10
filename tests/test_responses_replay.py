"""Agent runs replayed over the Responses front (``ctxproxy replay --protocol responses``): the same guarantees
as over chat completions — every request within the budget, no pair broken, every cut restorable — and the
same prefix reuse, since the front is a codec around the same engine."""

from __future__ import annotations

import pytest

from ctxproxy.config import load_settings
from ctxproxy.proxy.commands.replay import replay, summarize
from ctxproxy.proxy.edge.fronts.responses.spoken import as_spoken
from tests.test_trajectories import COUNTER, assert_replays_within_budget_and_intact
from tests.transcripts import transcript
from tests.workloads import conversation


@pytest.mark.parametrize("window", [4096, 32768])
def test_the_long_workload_replays_over_responses_within_budget_and_intact(window: int) -> None:
    spoken = as_spoken(conversation(rounds=30))
    steps = list(replay(spoken, load_settings(env={}), window, COUNTER, protocol="responses"))
    assert_replays_within_budget_and_intact(spoken, window, steps)
    summary = summarize(steps)
    assert summary.unrestorable == 0 and summary.over_window == 0


def test_a_native_run_reuses_the_prefix_as_much_over_responses_as_over_chat() -> None:
    spoken = as_spoken(transcript("native").conversation)
    chat = summarize(list(replay(spoken, load_settings(env={}), 8192, COUNTER)))
    responses = summarize(list(replay(spoken, load_settings(env={}), 8192, COUNTER, protocol="responses")))
    assert (responses.chars_sent, responses.chars_reused, responses.refused) == (
        chat.chars_sent, chat.chars_reused, chat.refused)
