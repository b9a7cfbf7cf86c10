"""Every recorded agent run in ../shared/trajectories, replayed through the rewrite core at 4k, 8k and 32k.

Table-driven over real histories (reused tool_call_ids, ``content: null``, consecutive user messages, a final
call without a result): every request keeps its pairs and its text, and every request the proxy would forward
fits the budget as the real tokenizer counts it. A request is refused only when what may never be cut — system
and user messages, the tool definitions, the newest result — does not fit by itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from config import load_settings
from proxy.replay import agent_requests, replay, summarize
from proxy.rewrite import budget_for
from proxy.rewrite.tokens import MessageCounter

SHARED = Path(__file__).resolve().parents[2] / "shared"
FILES = sorted((SHARED / "trajectories").glob("*.json"))
FILES = [f for f in FILES if f.name != "manifest.json"]
COUNTER = MessageCounter()


def load(path: Path) -> dict[str, Any]:
    conversation: dict[str, Any] = json.loads(path.read_text())
    conversation.pop("_source", None)
    return conversation


def test_the_shared_trajectories_are_there() -> None:
    assert len(FILES) == 41, f"expected the 41 shared trajectories under {SHARED}"


@pytest.mark.parametrize("window", [4096, 8192, 32768])
@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_a_real_run_replays_within_budget_and_intact(path: Path, window: int) -> None:
    conversation = load(path)
    settings = load_settings(env={})
    budget = budget_for(settings, window)
    steps = list(replay(conversation, settings, window, COUNTER))
    assert len(steps) == len(agent_requests(conversation["messages"]))
    assert summarize(steps).violations == 0, [s.violations for s in steps if s.violations]
    messages = conversation["messages"]
    tools = COUNTER.count_tools(conversation.get("tools"))
    for step in steps:
        if not step.refused:
            assert step.tokens_out <= budget.budget < window
            continue
        uncuttable = tools + sum(COUNTER.count(m) for m in messages[: step.messages]
                                 if m.get("role") in ("system", "user")) + COUNTER.count(messages[step.messages - 1])
        assert uncuttable > budget.target, f"request {step.request} refused though {uncuttable} tokens are uncuttable"


def test_at_32k_no_real_run_is_refused() -> None:
    settings = load_settings(env={})
    refused = {f.name: summarize(list(replay(load(f), settings, 32768, COUNTER))).refused for f in FILES}
    assert not any(refused.values()), refused
