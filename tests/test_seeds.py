"""The seeds' exact behaviours (issue #11): the offer on both routes, the agent's round in events, whole-word
phrases, ``ctx clear`` masks that select by themselves, and ``ctx status`` naming the mirror and its revision."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from ctxproxy.config import load_settings
from ctxproxy.proxy.core.fenced import builtin_presets
from ctxproxy.proxy.core.identity import message_hash
from ctxproxy.proxy.core.project import PASTE, project
from ctxproxy.proxy.core.state import Rules
from ctxproxy.proxy.tools.blocks import NOTE
from ctxproxy.proxy.tools.offer import person_asked, turn_in, turn_of
from ctxproxy.proxy.tools.schemas import TOOL_NAMES
from tests.conftest import app_client, session_mirror
from tests.fakes import FakeUpstream, Reply, completion, tool_answer
from tests.test_project import CharCounter, budget
from tests.transcripts import FORMATS, PERSON, transcript

AGENT_TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]


@pytest.fixture
def client(tmp_path: Path, fake: FakeUpstream) -> Iterator[TestClient]:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "131072", "CTXPROXY_SPILL_CHARS": "100000",
                                  "CTXPROXY_OFFER_ROUND": "4", "CTXPROXY_MIRROR_DIR": str(tmp_path / "ws")})
    with app_client(settings, httpx.ASGITransport(app=fake)) as test_client:
        yield test_client


def native(rounds: int, ask: str = "Fix the bug.", tool: str = "read", size: int = 20) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": ask}]
    for k in range(rounds):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{k}", "type": "function",
                     "function": {"name": tool, "arguments": json.dumps({"path": f"f{k}.py"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{k}", "content": f"result {k} " * size})
    return msgs


def fenced(rounds: int, ask: str = "Fix the bug.") -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Reply with one ```bash``` block."},
                                  {"role": "user", "content": ask}]
    for k in range(rounds):
        msgs.append({"role": "assistant", "content": f"Step {k}.\n```bash\ncat f{k}.py\n```"})
        msgs.append({"role": "user", "content": f"<returncode>0</returncode>\n<output>\nline {k}\n</output>"})
    return msgs


def names(fake: FakeUpstream) -> list[str]:
    return [t["function"]["name"] for t in fake.chats[-1].json().get("tools") or []]


# --- the offer counts the agent's rounds on both routes ----------------------------------------------------------

def test_the_offer_round_counts_native_tool_rounds(client: TestClient, fake: FakeUpstream) -> None:
    client.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": native(2)})
    assert names(fake) == ["read"]  # answering round 3
    client.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": native(3)})
    assert "context_drop" in names(fake)  # answering round 4 = offer_round


def test_the_offer_round_counts_fenced_rounds(client: TestClient, fake: FakeUpstream) -> None:
    client.post("/v1/chat/completions", json={"model": "m", "messages": fenced(2)})
    assert all(m["content"] != NOTE for m in fake.chats[-1].json()["messages"])
    client.post("/v1/chat/completions", json={"model": "m", "messages": fenced(3)})
    assert any(m["content"] == NOTE for m in fake.chats[-1].json()["messages"])


def test_a_turn_counts_results_messages_as_rounds() -> None:
    messages = fenced(5)
    assert turn_of(messages).rounds == 0  # without the results found, each results message looks like a person's
    assert turn_of(messages, {5 + 2 * k for k in range(4)}).rounds == 4  # the first is the person's
    assert turn_of(messages, {3 + 2 * k for k in range(5)}).round == 6


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_projected_request_s_turn_is_read_from_its_state_as_from_its_messages(fmt: str) -> None:
    """``turn_in`` reads the turn from the projection's indices of user messages and calls; it is the turn that
    walking the messages finds, for each request of a run, with the person's messages between rounds."""
    messages = transcript(fmt, rounds=8).messages
    messages = [*messages[:5], {"role": "user", "content": PERSON}, *messages[5:]]
    rules = Rules(budget(32768), fenced=() if fmt == "native" else builtin_presets())
    turns = set()
    for end in range(1, len(messages) + 1):
        sent = messages[:end]
        state = project(sent, [message_hash(m) for m in sent], [], rules, CharCounter()).state
        results = {i for i, r in state.fenced.items() if r.command != PASTE}
        assert turn_in(sent, state) == turn_of(sent, results), end
        turns.add(turn_of(sent, results))
    assert len({t.start for t in turns}) >= 2 and max(t.rounds for t in turns) >= 4  # the person's message counted


# --- events carry the agent's round -------------------------------------------------------------------------------

def test_context_op_events_carry_the_agents_round_not_the_proxys_attempt(client: TestClient,
                                                                         fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=tool_answer(("context_status", {}))))
    fake.enqueue(Reply(body=tool_answer(("context_status", {}))))
    fake.enqueue(Reply(body=completion("ok")))
    client.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": native(6)})
    fake.enqueue(Reply(body=completion("```context\n{\"tool\": \"context_status\"}\n```\n")))
    fake.enqueue(Reply(body=completion("ok\n```bash\nls\n```")))
    client.post("/v1/chat/completions", json={"model": "m", "messages": fenced(8)})
    events = list(client.app.state.ctx.events.recent)  # type: ignore[attr-defined]
    assert [e["round"] for e in events] == [7, 7, 9]


# --- phrases match whole words ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "asked"), [
    ("Please free up your context.", True),
    ("Run ctx clear on the old reads.", True),
    ("Use context_drop on the logs", True),
    ("ctxproxy crashed again", False),
    ("rename the variable `ctx` to `context`", False),
    ("ctx.state is None in plan_forward", False),
    ("fix my_context_drop_helper", False),
    ("the context windows of both models", False),
])
def test_offer_phrases_and_tool_names_match_whole_words(text: str, asked: bool) -> None:
    messages = [{"role": "user", "content": text}]
    assert person_asked(messages, turn_of(messages), ["free up your context", "context window"]) is asked
    assert "ctx" in TOOL_NAMES


def test_a_person_asking_in_text_parts_is_heard() -> None:
    """Claude Code (and chat clients sending parts) put the person's words in text parts, after a reminder."""
    parts = [{"type": "text", "text": "<system-reminder>notes</system-reminder>"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
             {"type": "text", "text": "Run the tests, then free up your context."}]
    messages = [{"role": "user", "content": parts}]
    assert person_asked(messages, turn_of(messages), ["free up your context"]) is True
    assert person_asked([{"role": "user", "content": parts[:2]}], turn_of(messages), ["free up your context"]) is False


# --- ctx clear: the seed's own example ----------------------------------------------------------------------------

def results_of(fake: FakeUpstream) -> list[str]:
    return [m["content"] for m in fake.chats[-1].json()["messages"] if m.get("tool_call_id", "").startswith("ctx_")]


def test_the_seeds_clear_example_clears_every_read_but_the_last_three(client: TestClient, fake: FakeUpstream) -> None:
    msgs = native(7, size=100)
    msgs[6]["tool_calls"][0]["function"]["name"] = "grep"  # call_2 is a grep: not a read
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "clear", "keep_last": 3, "tool": "read"}))))
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "clear", "keep_last": 3, "tool": "read"}))))
    fake.enqueue(Reply(body=completion("ok")))
    client.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": msgs})
    first, again = results_of(fake)
    assert "clear: applied to call_0, call_1, call_3." in first
    assert "nothing to clear" in again
    sent = {m.get("tool_call_id"): m["content"] for m in fake.chats[-1].json()["messages"] if m["role"] == "tool"}
    assert [k for k, v in sent.items() if v.startswith("[overflow id=")] == ["call_0", "call_1", "call_3"]


def test_clear_masks_narrow_a_selection_when_one_is_given(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "clear", "before": "call_4", "keep_last": 1}))))
    fake.enqueue(Reply(body=completion("ok")))
    client.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": native(7, size=100)})
    assert "clear: applied to call_0, call_1, call_2." in results_of(fake)[0]


# --- ctx status -----------------------------------------------------------------------------------------------------

def test_ctx_status_names_the_mirror_and_the_last_accepted_revision(client: TestClient, tmp_path: Path,
                                                                    fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "status"}))))
    fake.enqueue(Reply(body=completion("ok")))
    client.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": native(5)})
    status = results_of(fake)[0]
    assert f"Mirror: {session_mirror(tmp_path / 'ws', native(5))} (last accepted none yet" in status
    assert "budget " in status and "cuts stop at " in status


# --- the way back is always listed --------------------------------------------------------------------------------

@pytest.fixture
def spilling(tmp_path: Path, fake: FakeUpstream) -> Iterator[TestClient]:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "131072", "CTXPROXY_SPILL_CHARS": "3000"})
    with app_client(settings, httpx.ASGITransport(app=fake)) as test_client:
        yield test_client


def test_read_overflow_is_listed_from_the_first_stub_on_byte_stable(spilling: TestClient, fake: FakeUpstream) -> None:
    spilling.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": native(2)})
    assert names(fake) == ["read"]  # nothing cut yet: nothing to list
    msgs = native(3)
    msgs[-1]["content"] = "x " * 4000  # spilled on arrival
    spilling.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": msgs})
    assert "[overflow id=" in fake.chats[-1].json()["messages"][-1]["content"]
    assert names(fake) == ["read", "read_overflow"]
    first = fake.chats[-1].json()["tools"]
    msgs += native(4)[-2:]
    spilling.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": msgs})
    assert fake.chats[-1].json()["tools"] == first


def test_a_restart_lists_read_overflow_the_same(tmp_path: Path, fake: FakeUpstream) -> None:
    env = {"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": "http://u.test/v1",
           "CTXPROXY_CTX_WINDOW": "131072", "CTXPROXY_SPILL_CHARS": "3000"}
    msgs = native(3)
    msgs[-1]["content"] = "x " * 4000
    for _ in range(2):
        with app_client(load_settings(env=env), httpx.ASGITransport(app=fake)) as client:
            client.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": msgs})
        msgs = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
    assert fake.chats[-1].json()["tools"] == fake.chats[-2].json()["tools"]
    assert names(fake) == ["read", "read_overflow"]


def test_a_fenced_session_is_told_how_to_read_back_from_its_first_stub(spilling: TestClient,
                                                                       fake: FakeUpstream) -> None:
    from ctxproxy.proxy.tools.blocks import RESTORE_NOTE

    msgs = fenced(2)
    spilling.post("/v1/chat/completions", json={"model": "m", "messages": msgs})
    assert all(m["content"] != RESTORE_NOTE for m in fake.chats[-1].json()["messages"])
    msgs[-1]["content"] = "<returncode>0</returncode>\n<output>\n" + "y " * 4000 + "\n</output>"
    fake.enqueue(Reply(body=completion("```context\n{\"tool\": \"read_overflow\", \"id\": \"0\"}\n```\n")))
    fake.enqueue(Reply(body=completion("ok\n```bash\nls\n```")))
    spilling.post("/v1/chat/completions", json={"model": "m", "messages": msgs})
    sent = fake.chats[-2].json()["messages"]
    assert "[overflow id=" in sent[-2]["content"] and sent[-1]["content"] == RESTORE_NOTE
    assert "read_overflow: no cut content with id 0" in fake.chats[-1].json()["messages"][-1]["content"]


# --- files the agent can grep -------------------------------------------------------------------------------------

@pytest.fixture
def grep_dir(tmp_path: Path, fake: FakeUpstream) -> Iterator[tuple[TestClient, Path]]:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "131072", "CTXPROXY_SPILL_CHARS": "3000",
                                  "CTXPROXY_OVERFLOW_DIR": str(tmp_path / "ws" / ".overflow")})
    with app_client(settings, httpx.ASGITransport(app=fake)) as test_client:
        yield test_client, tmp_path / "ws" / ".overflow"


def test_with_overflow_dir_every_cut_body_is_a_file_the_stub_names(grep_dir: tuple[TestClient, Path],
                                                                   fake: FakeUpstream) -> None:
    import hashlib

    client, folder = grep_dir
    msgs = native(4, size=100)
    big = "".join(f"log line {i}\n" for i in range(600))
    msgs[-1]["content"] = big
    fake.enqueue(Reply(body=tool_answer(("context_drop", {"handles": ["call_0"]}))))
    fake.enqueue(Reply(body=completion("ok")))
    client.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": msgs})
    sent = {m.get("tool_call_id"): m["content"] for m in fake.chats[-1].json()["messages"] if m["role"] == "tool"}
    for call_id, body in (("call_3", big), ("call_0", msgs[3]["content"])):  # a spill, then the model's drop
        path = folder / f"{hashlib.sha256(body.encode()).hexdigest()}.out"
        assert path.read_text() == body
        assert f"[full output: {path}]" in sent[call_id].splitlines()
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"{hashlib.sha256(b.encode()).hexdigest()}.out" for b in (big, msgs[3]["content"]))  # no partial file


def test_a_fenced_spill_names_its_file_inside_the_wrapper(grep_dir: tuple[TestClient, Path],
                                                          fake: FakeUpstream) -> None:
    client, folder = grep_dir
    msgs = fenced(2)
    msgs[-1]["content"] = "<returncode>0</returncode>\n<output>\n" + "z " * 4000 + "\n</output>"
    client.post("/v1/chat/completions", json={"model": "m", "messages": msgs})
    content = fake.chats[-1].json()["messages"][-2]["content"]
    assert content.endswith("\n</output>") and "[full output: " in content
    (name,) = [p.name for p in folder.iterdir()]
    assert f"[full output: {folder / name}]" in content


def test_incognito_never_writes_to_overflow_dir(grep_dir: tuple[TestClient, Path], fake: FakeUpstream) -> None:
    client, folder = grep_dir
    msgs = native(3)
    msgs[-1]["content"] = "x " * 4000
    client.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": msgs},
                headers={"X-Ctx-Incognito": "1"})
    content = fake.chats[-1].json()["messages"][-1]["content"]
    assert "storage=memory-only (incognito)]" in content and "[full output:" not in content
    assert not folder.exists()
