"""A fenced session whose results come in a wrapper no preset knows: never a fold while a block could be cut.

Issue #11: a results message in an unknown wrapper was taken for the person's words and stayed whole, so the proxy
folded every earlier round instead, the assistant's own text just before it included. The message's largest block
(fenced, tag-delimited, or between its first and last line) is now cut like a result, the words around it kept;
the newest round is never folded to make room for it.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.gen_fenced import build
from ctxproxy.config import load_settings
from ctxproxy.proxy.commands.replay import replay, summarize
from ctxproxy.proxy.core import Rules, message_hash, violations
from ctxproxy.proxy.core.fenced import builtin_presets, find_results
from ctxproxy.proxy.core.project import project
from ctxproxy.proxy.core.tokens import MessageCounter
from ctxproxy.proxy.engine.budgets import budget_for

COUNTER = MessageCounter()
TASK = {"role": "user", "content": "Fix the failing test in the repository, then submit."}


def thought(n: int, size: int = 300) -> dict[str, Any]:
    words = " ".join(f"step{n}-reason{k}" for k in range(size // 15))
    return {"role": "assistant", "content": f"THOUGHT: {words}\n\n```bash\nrun --step {n}\n```"}


def known(n: int, size: int = 200) -> dict[str, Any]:
    return {"role": "user", "content": "<returncode>0</returncode>\n<output>\n" + f"ok {n}\n" * (size // 5)
            + "</output>"}


def unknown(n: int, size: int) -> dict[str, Any]:
    """A wrapper no preset knows: a status line, the output in tags, a closing hint."""
    body = "".join(f"log {n}.{k}: checked module_{k} against fixture_{n} in suite {k * n}\n" for k in range(size // 60))
    return {"role": "user", "content": f"Command `run --step {n}` was stopped after 60 s.\n<log>\n{body}</log>\n"
                                       "Try a shorter command."}


def projected(messages: list[dict[str, Any]], window: int) -> Any:
    rules = Rules(budget_for(load_settings(env={}), window), fenced=builtin_presets())
    return project(messages, [message_hash(m) for m in messages], [], rules, COUNTER, seen=0)


def test_a_large_result_in_an_unknown_wrapper_is_cut_not_the_rounds_before_it() -> None:
    messages = [{"role": "system", "content": "You are an agent."}, TASK]
    for n in range(1, 4):
        messages += [thought(n), known(n)]
    messages += [thought(4, 4200), unknown(4, 25_600)]
    assert len(messages[-1]["content"]) > load_settings(env={}).paste_chars
    p = projected(messages, 4096)
    kinds = [d.kind for d in p.new]
    assert "fold" not in kinds and not p.report.over_budget, (kinds, p.report)
    out = p.messages[-1]["content"]
    assert out.startswith("Command `run --step 4` was stopped after 60 s.\n<log>\n")
    assert out.endswith("</log>\nTry a shorter command.") and "read_overflow id=" in out
    assert p.messages[-2] == messages[-2]  # the assistant's 4.2k characters just before it reach the model
    assert violations(messages, p.messages, fenced={i: r.segments for i, r in p.state.fenced.items()}) == []


def test_old_unknown_results_are_elided_before_any_round_is_folded() -> None:
    messages = [TASK]
    for n in range(1, 31):
        messages += [thought(n), unknown(n, 2200)]  # under spill_chars at 32k: nothing spilled on arrival
    assert all(len(m["content"]) < budget_for(load_settings(env={}), 32768).spill_chars for m in messages[2::2])
    p = projected(messages, 32768)
    kinds = [d.kind for d in p.new]
    assert "fold" not in kinds and kinds.count("elide") >= 3, kinds
    assert all(m == o for m, o in zip(messages, p.messages, strict=True) if m["role"] == "assistant")


def test_a_fold_keeps_the_newest_round_whole() -> None:
    messages = [TASK]
    for n in range(1, 7):  # nothing cuttable: only a fold can make room, and the newest round alone nearly fills it
        messages += [thought(n, 2000 if n < 6 else 5600), known(n)]
    p = projected(messages, 4096)
    assert not p.report.over_budget
    assert {d.kind for d in p.new} == {"fold"}
    assert p.messages[-2:] == messages[-2:]


@pytest.mark.parametrize("window", [4096, 8192, 16384])
def test_a_generated_run_no_preset_knows_replays_within_the_window_with_nothing_lost(window: int) -> None:
    """bench/gen_fenced.py's run (40 rounds, seed 11): results in tags, fenced blocks, paragraphs and bare lines."""
    conversation = build(40, 11)
    assert find_results(conversation["messages"]) == []  # no preset knows any of its results
    settings = load_settings(env={"CTXPROXY_ROUTE": "fenced"})
    steps = list(replay(conversation, settings, window, COUNTER))
    summary = summarize(steps)
    assert summary.requests == 41 and summary.refused == 0
    projected = max(s.tokens_out - s.tokens_notices for s in steps)  # the proxy's own lines come on top
    assert projected <= budget_for(settings, window).budget < window and summary.over_window == 0
    assert summary.violations == 0  # pairs whole, assistant and person text unchanged, wrappers intact
    assert summary.newest_lost == 0 and summary.unrestorable == 0
    assert summary.reuse > 0.65, summary


def test_only_a_request_that_could_not_be_sent_otherwise_folds_the_newest_thought() -> None:
    """The system prompt and the task fill most of a 4k budget: keeping the newest assistant text would mean a
    refusal, so it is folded (restorably) instead; the results it asked for still reach the model."""
    head = [{"role": "system", "content": " ".join(f"rule{k} applies" for k in range(300))},
            {"role": "user", "content": " ".join(f"detail{k} matters" for k in range(400))}]
    messages = [*head, thought(1, 1500), known(1), thought(2, 3000), known(2)]
    p = projected(messages, 4096)
    assert not p.report.over_budget, p.report
    assert p.messages[-1] == messages[-1] and p.messages[-2]["content"].startswith("[folded id=")
