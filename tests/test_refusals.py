"""A refusal (``context_length_exceeded``) that adds up: its total and its items in one unit, and the fixed part
named when that alone is over the budget."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx

from ctxproxy.config import load_settings
from ctxproxy.proxy.core.identity import message_hash
from ctxproxy.proxy.core.project import project
from ctxproxy.proxy.core.state import Rules
from ctxproxy.proxy.engine.refusals import describe_overflow
from tests.conftest import app_client
from tests.fakes import CountingUpstream
from tests.test_project import CharCounter, budget


def _over(messages: list[Any], rules: Rules) -> str:
    p = project(messages, [message_hash(m) for m in messages], [], rules, CharCounter())
    assert p.report.over_budget
    return describe_overflow(p, messages, rules)


def _numbers(text: str) -> tuple[int, list[int]]:
    total = int(re.search(r"about (\d+) tokens", text).group(1))  # type: ignore[union-attr]
    items = [int(n) for n in re.findall(r": (\d+) tokens\)", text)]
    return total, items


def test_the_items_add_up_to_the_total_when_the_ratio_is_not_one() -> None:
    messages = [{"role": "user", "content": "x" * 4000}, {"role": "user", "content": "y" * 4000}]
    text = _over(messages, Rules(budget(2048), k=1.8))
    total, items = _numbers(text)
    assert len(items) == 2 and abs(sum(items) - total) <= len(items)  # each item rounded up once, no more
    assert "× 1.80" in text  # the unit says it is the model's count, not ctxproxy's


def test_a_system_prompt_alone_over_the_budget_is_named_as_the_fixed_part() -> None:
    messages = [{"role": "system", "content": "rule " * 4000}, {"role": "user", "content": "go"}]
    text = _over(messages, Rules(budget(2048), tools_tokens=300))
    assert "The fixed part alone, the system prompt (" in text and "the tool definitions (300 tokens)" in text
    assert "no cut can make room" in text


def test_a_conversation_over_by_its_history_has_no_fixed_part_sentence() -> None:
    messages = [{"role": "system", "content": "short"}, {"role": "user", "content": "x" * 9000}]
    assert "fixed part" not in _over(messages, Rules(budget(2048)))


def test_the_proxy_refuses_a_system_prompt_bigger_than_the_budget_saying_so(tmp_path: Path) -> None:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "4096"})
    body = {"model": "m", "messages": [{"role": "system", "content": " ".join(f"rule {i};" for i in range(1500))},
                                       {"role": "user", "content": "go"}]}
    with app_client(settings, httpx.ASGITransport(app=CountingUpstream(window=100_000))) as c:
        error = c.post("/v1/chat/completions", json=body).json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "The fixed part alone, the system prompt (" in error["message"]
