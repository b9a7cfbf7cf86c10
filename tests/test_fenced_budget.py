"""What the context tools cost on the fenced route: the note it is sent, not the schemas it never is."""

from __future__ import annotations

from pathlib import Path

import httpx

from ctxproxy.config import load_settings
from ctxproxy.proxy.core.tokens import MessageCounter
from tests.conftest import app_client
from tests.fakes import FakeUpstream


def fenced_history(rounds: int) -> list[dict[str, str]]:
    """A mini-swe-agent text-mode run of small results (each under the 600 characters that always stay)."""
    messages = [{"role": "system", "content": "You are a helpful assistant that can interact with a computer."},
                {"role": "user", "content": "Please solve this issue: the tests fail."}]
    for i in range(rounds):
        messages.append({"role": "assistant", "content": f"THOUGHT: look at part {i}.\n\n```bash\ncat part{i}.py\n```"})
        output = "".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(14))
        messages.append({"role": "user", "content": f"<returncode>0</returncode>\n<output>\n{output}</output>"})
    return messages


def test_a_fenced_route_budgets_the_note_it_is_sent_not_the_schemas_it_never_is(tmp_path: Path) -> None:
    """The fenced route is told the block syntax in a note (151 tokens); the native schemas (735) never go to it.
    Budgeting the schemas there cut or refused requests that fit: at 4k, 66 of the recorded fenced requests
    instead of 15. This history fits the 3072-token budget with the note, and would not with the schemas."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "4096", "CTXPROXY_OFFER_ROUND": "0"})
    fake = FakeUpstream()
    counter = MessageCounter()
    messages = fenced_history(11)
    used = sum(counter.count(m) for m in messages)
    assert 3072 - 735 < used < 3072 - 151 - 100, used  # fits with the note, not with the schemas
    body = {"model": "fake-model", "messages": messages}
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    sent = fake.last_chat.json()["messages"]
    assert sent[:len(messages)] == messages  # nothing cut: only the proxy's own lines follow
    assert all(m["role"] == "system" and m["content"].startswith("[ctxproxy]") for m in sent[len(messages):])


def native_history(rounds: int) -> list[dict[str, object]]:
    """A native tool-calling run of small results (each under the 600 characters that always stay)."""
    messages: list[dict[str, object]] = [{"role": "system", "content": "You are a coding agent."},
                                         {"role": "user", "content": "Please solve this issue: the tests fail."}]
    for i in range(rounds):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": f'{{"cmd": "cat p{i}"}}'}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        output = "".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(14))
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": output})
    return messages


BASH = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}


def test_at_a_small_window_only_read_overflow_is_budgeted_and_the_request_fits(tmp_path: Path) -> None:
    """At 4k the full set of schemas (735 tokens) would take a quarter of the 3,072-token budget: the server
    refused 226 of the 319 recorded native requests where the core alone refused 126. Below a fifth of the budget
    the full set is neither budgeted nor offered; ``read_overflow`` alone is, so a cut stays restorable."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "4096", "CTXPROXY_OFFER_ROUND": "0",
                                  "CTXPROXY_OFFER_PCT": "0"})
    fake = FakeUpstream()
    counter = MessageCounter()
    messages = native_history(13)
    used = sum(counter.count(m) for m in messages) + counter.count_tools([BASH])
    assert 3072 - 735 < used < 3072 - 200, used  # fits beside read_overflow's schema, not beside the full set
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        answer = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": messages,
                                                           "tools": [BASH]})
    assert answer.status_code == 200, answer.text
    sent = fake.last_chat.json()
    assert sent["messages"][:len(messages)] == messages  # nothing cut
    assert [t["function"]["name"] for t in sent["tools"]] == ["bash"]  # offer due (0%), but the full set does not fit
