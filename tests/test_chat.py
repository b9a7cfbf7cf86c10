"""The chat route in process: a faithful forward, journaled, with sessions resolved and returned."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import orjson
from fastapi.testclient import TestClient

from ctxproxy.config import Settings, load_settings
from ctxproxy.store import Journal
from tests.conftest import app_client, chat
from tests.fakes import FakeUpstream, Reply, stream_chunks, stream_tool_answer, tool_answer


def journal_of(settings: Settings) -> Journal:
    return Journal(settings.data_path / "journal.db")


def test_the_body_goes_upstream_byte_for_byte(client: TestClient, fake: FakeUpstream) -> None:
    raw = (b'{ "messages": [{"role":"user", "content": "hi \\u00e9"}],\n "model":"m", "reasoning_effort": "high",'
           b' "chat_template_kwargs": {"enable_thinking": false}, "stream_options": null, "x_unknown": [1, 2.50]}')
    response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert fake.last_chat.body == raw
    assert fake.last_chat.path == "/v1/chat/completions"


def test_auth_and_unknown_headers_pass_our_own_do_not(client: TestClient, fake: FakeUpstream) -> None:
    client.post("/v1/chat/completions", json=chat("hi"), headers={
        "Authorization": "Bearer sk-abc", "OpenAI-Organization": "org-1", "X-Custom": "yes",
        "X-Session-Id": "mine", "X-Ctx-Incognito": "0"})
    sent = fake.last_chat.headers
    assert sent["authorization"] == "Bearer sk-abc"
    assert sent["openai-organization"] == "org-1" and sent["x-custom"] == "yes"
    assert "x-session-id" not in sent and "x-ctx-incognito" not in sent


def test_the_answer_comes_back_as_the_upstream_sent_it(client: TestClient, fake: FakeUpstream) -> None:
    raw = (b'{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}],  '
           b'"usage":{"prompt_tokens":7}}')
    fake.enqueue(Reply(raw=raw, headers={"x-upstream": "llama"}))
    response = client.post("/v1/chat/completions", json=chat("hi"))
    assert response.content == raw
    assert response.headers["x-upstream"] == "llama"
    assert response.headers["x-ctx-session"].startswith("s-")


def test_each_request_is_journaled_with_its_session_and_answer(client: TestClient, settings: Settings) -> None:
    first = client.post("/v1/chat/completions", json=chat("hi"))
    second = client.post("/v1/chat/completions", json=chat("hi", "echo: hi", "more"))
    session = first.headers["x-ctx-session"]
    assert second.headers["x-ctx-session"] == session
    entries = journal_of(settings).session_journal(session)
    assert [(e["messages"], e["new_messages"], e["outcome"], e["status"]) for e in entries] == [
        (2, 2, "ok", 200), (4, 2, "ok", 200)]
    assert entries[1]["prompt_tokens"] == second.json()["usage"]["prompt_tokens"]


def test_a_named_session_is_used_and_returned(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json=chat("hi"), headers={"X-Session-Id": "run-42"})
    assert response.headers["x-ctx-session"] == "run-42"
    assert client.get("/ctx/sessions/run-42").json()["requests"] == 1


def test_a_second_run_with_the_same_opening_is_a_child_session(client: TestClient) -> None:
    a = client.post("/v1/chat/completions", json=chat("task", "step one", "go")).headers["x-ctx-session"]
    b = client.post("/v1/chat/completions", json=chat("task", "a different step", "go")).headers["x-ctx-session"]
    assert a != b
    assert client.get(f"/ctx/sessions/{b}").json()["parent_id"] == a


def test_a_streamed_answer_is_relayed_and_its_usage_journaled(client: TestClient, fake: FakeUpstream,
                                                               settings: Settings) -> None:
    usage = {"prompt_tokens": 21, "completion_tokens": 2, "total_tokens": 23}
    fake.enqueue(Reply(sse=stream_chunks("hello there", usage=usage)))
    response = client.post("/v1/chat/completions", json=chat("hi", stream=True))
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]
                   if json.loads(e)["choices"])
    assert text == "hello there "
    (entry,) = journal_of(settings).session_journal(response.headers["x-ctx-session"])
    assert entry["prompt_tokens"] == 21 and entry["outcome"] == "ok"


def test_incognito_requests_leave_nothing_on_disk(client: TestClient, settings: Settings) -> None:
    response = client.post("/v1/chat/completions", json=chat("secret plans"), headers={"X-Ctx-Incognito": "1"})
    assert response.status_code == 200
    raw = b"".join(p.read_bytes() for p in Path(settings.data_path).iterdir())
    assert b"secret plans" not in raw
    assert client.get("/ctx/sessions").json()["sessions"] == []


def test_other_v1_routes_pass_through(client: TestClient, fake: FakeUpstream) -> None:
    assert client.get("/v1/models").json()["data"][0]["id"] == "fake-model"
    response = client.post("/v1/embeddings?x=1", json={"input": "hi", "model": "e"},
                           headers={"Authorization": "Bearer k"})
    assert response.status_code == 200
    assert fake.last.path == "/v1/embeddings" and fake.last.query == "x=1"
    assert fake.last.headers["authorization"] == "Bearer k"
    assert orjson.loads(fake.last.body) == {"input": "hi", "model": "e"}
    assert client.post("/v1/moderations", json={"input": "x"}).json()["path"] == "/v1/moderations"


def test_healthz(client: TestClient) -> None:
    assert client.get("/healthz").json()["status"] == "ok"



def _null_content_history() -> bytes:
    call = {"id": "c1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "ls"},
                                                    {"role": "assistant", "content": None, "tool_calls": [call]},
                                                    {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}]})


def test_null_content_is_kept_unless_the_upstream_needs_it_empty(tmp_path: Path, fake: FakeUpstream) -> None:
    for mode, expected in (("keep", None), ("empty", "")):
        settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / mode), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                      "CTXPROXY_NULL_CONTENT": mode})
        with app_client(settings, httpx.ASGITransport(app=fake)) as client:
            raw = _null_content_history()
            assert client.post("/v1/chat/completions", content=raw).status_code == 200
        sent = json.loads(fake.last_chat.body)
        assert sent["messages"][1]["content"] == expected
        assert sent["messages"][0] == {"role": "user", "content": "ls"} and len(sent["messages"]) == 3
        assert (fake.last_chat.body == raw) == (mode == "keep")  # keep: nothing rewritten, byte for byte
        journaled = journal_of(settings).request(1)
        assert journaled is not None and journaled["messages"][1]["content"] is None  # the client's own, as sent


OVERFLOW = Reply(status=400, body={"error": {
    "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 6047, "n_ctx": 4096,
    "message": "the request exceeds the available context size"}})


def test_the_journal_shows_what_the_client_got_not_the_first_attempt(
        client: TestClient, fake: FakeUpstream, settings: Settings) -> None:
    """Issue #10 item 10: the client got 200 after a retry, `show` said context_overflow 400 (and the reverse)."""
    fake.enqueue(OVERFLOW)
    retried = client.post("/v1/chat/completions", json=chat("one"))
    fake.enqueue(Reply(body=tool_answer(("context_status", {}))))
    fake.enqueue(Reply(status=500, body={"error": {"message": "the follow-up failed"}}))
    failed = client.post("/v1/chat/completions", json=chat("one", retried.json()["choices"][0]["message"]["content"],
                                                          "two"))
    assert (retried.status_code, failed.status_code) == (200, 500)
    entries = journal_of(settings).session_journal(retried.headers["x-ctx-session"])
    assert [(e["outcome"], e["status"], e["attempts"]) for e in entries] == [("ok", 200, 2), ("upstream_error", 500, 2)]
    request = journal_of(settings).request(entries[0]["request_id"])
    attempts = [(r["outcome"], r["status"]) for r in (request or {})["responses"]]
    assert attempts == [("context_overflow", 400), ("ok", 200)]  # each attempt is still there, in its own row
    fake.enqueue(Reply(sse=stream_tool_answer(("context_status", {}))))
    fake.enqueue(Reply(status=500, body={"error": {"message": "the follow-up failed"}}))
    streamed = client.post("/v1/chat/completions", json=chat("one", "two", "three", stream=True))
    assert streamed.status_code == 200 and "upstream_follow_up_failed" in streamed.text
    (entry,) = journal_of(settings).session_journal(streamed.headers["x-ctx-session"], entries[-1]["request_id"])
    assert (entry["outcome"], entry["status"]) == ("follow_up_failed", 200)
