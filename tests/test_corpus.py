"""The recorded third-party agent runs (SWE-agent, mini-swe-agent, OpenHands), replayed when they are there.

They are an external corpus, not part of the repository: ``CTXPROXY_TRAJECTORIES`` names their directory
(``.ci/run`` sets it to ``../shared/trajectories`` when that exists). Unset, this whole module is one skip; set to
a directory that is not there, it is one collection error. Every file is replayed through the proxy at 4k,
8k and 32k (``tests/test_trajectories.py``'s check), and in every text-protocol run (``*.fenced.json``) each
results message must be found and nothing else: never the task, SWE-agent's demonstration, a person's opening.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from ctxproxy.proxy.commands.replay import ReplayStep, summarize
from ctxproxy.proxy.core.fenced import find_results, route_of
from tests.test_trajectories import WINDOWS, assert_replays_within_budget_and_intact, replayed
from tests.workloads import TRAJECTORIES_ENV, trajectories_dir

SETTING = trajectories_dir()
if SETTING is None:
    pytest.skip(f"{TRAJECTORIES_ENV} is not set: the recorded trajectories are not replayed", allow_module_level=True)
if not SETTING.is_dir():
    pytest.fail(f"{TRAJECTORIES_ENV}={SETTING} is not a directory: point it at the recorded trajectories or unset it",
                pytrace=False)
CORPUS: Path = SETTING
FILES = sorted(p for p in CORPUS.glob("*.json") if p.name != "manifest.json")
FENCED = [p for p in FILES if p.name.endswith(".fenced.json")]


def load(path: Path) -> dict[str, Any]:
    conversation: dict[str, Any] = json.loads(path.read_text())
    conversation.pop("_source", None)
    return conversation


@functools.cache
def steps_of(path: Path, window: int) -> list[ReplayStep]:
    """A run replayed through the app once per window: the 32k check reads the same replay."""
    return replayed(load(path), window)


def test_the_corpus_is_whole() -> None:
    """Every file its manifest lists is there (a copy cut short would replay fewer runs and still pass)."""
    manifest = CORPUS / "manifest.json"
    listed = {row["file"] for row in json.loads(manifest.read_text())} if manifest.exists() else set()
    assert FILES, f"no *.json under {CORPUS}"
    assert listed <= {p.name for p in FILES}, sorted(listed - {p.name for p in FILES})


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_a_recorded_run_replays_within_budget_and_intact(path: Path, window: int) -> None:
    assert_replays_within_budget_and_intact(load(path), window, steps_of(path, window))


def test_at_32k_no_recorded_run_is_refused() -> None:
    refused = {f.name: summarize(steps_of(f, 32768)).refused for f in FILES}
    assert not any(refused.values()), refused


@pytest.mark.parametrize("path", FENCED, ids=[p.name for p in FENCED])
def test_every_results_message_of_a_recorded_run_is_found_and_only_those(path: Path) -> None:
    messages = load(path)["messages"]
    found = find_results(messages)
    answers = [i for i, m in enumerate(messages)
               if m["role"] == "user" and i and messages[i - 1]["role"] == "assistant"]
    assert {r.index for r in found} <= set(answers)  # never the task, the demonstration, a person's opening
    assert len(found) >= len(answers) - 1  # mini-swe-agent's last user message is the submitted diff, not a result
    for result in found:
        content = messages[result.index]["content"]
        assert result.round == sum(1 for m in messages[: result.index] if m["role"] == "assistant")
        for segment in result.segments:
            assert 0 <= segment.start <= segment.end <= len(content)
    assert route_of(messages, None, "auto") == "fenced"
