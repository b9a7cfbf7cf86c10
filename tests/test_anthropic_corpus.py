"""The recorded agent runs, converted to Anthropic Messages, keep the chat route's guarantees (``bench/fronts.py``).

Skipped unless ``CTXPROXY_TRAJECTORIES`` names the shared trajectories (as ``tests/test_corpus.py``). Each native
run's requests go to ``/v1/messages``, translated and native: nothing over the window, no pair broken, and the
requests refused (cannot fit) are the chat route's own.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from bench.fronts import run
from ctxproxy.proxy.core.tokens import MessageCounter
from tests.workloads import TRAJECTORIES_ENV, trajectories_dir

SETTING = trajectories_dir()
if SETTING is None or not SETTING.is_dir():
    pytest.skip(f"{TRAJECTORIES_ENV} is not set: the recorded trajectories are not replayed", allow_module_level=True)
FILES = sorted(SETTING.glob("*.native.json"))
COUNTER = MessageCounter()


def replayed(path: Path, mode: str) -> dict[str, Any]:
    return asyncio.run(run(json.loads(path.read_text()), 8192, mode, COUNTER))


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_a_recorded_run_through_the_anthropic_front_keeps_the_guarantees(path: Path) -> None:
    chat = replayed(path, "chat")
    for mode in ("anthropic translated", "anthropic native"):
        got = replayed(path, mode)
        assert got["over_window"] == got["broken_pairs"] == 0, (mode, got)
        assert got["requests"] == chat["requests"] and got["refused"] == chat["refused"], (mode, got, chat)
