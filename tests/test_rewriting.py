"""The rewrite through the real app: what reaches the upstream, what the journal keeps, how overflows are handled.

The upstream here is ``CountingUpstream``: it counts every prompt as a model server would and refuses (like
llama.cpp) any prompt over its window.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from ctxproxy.config import Settings, load_settings
from ctxproxy.proxy.core import violations
from ctxproxy.proxy.edge.app import create_app
from ctxproxy.store import Journal
from tests.conftest import app_client
from tests.fakes import CountingUpstream, Reply, serve_in_thread
from tests.workloads import NEEDLE
from tests.workloads import conversation as workload

STUB_ID = re.compile(r"\[overflow id=([0-9a-f]{64}) ")


def settings_for(tmp_path: Path, **env: str) -> Settings:
    return load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                              **env})


@pytest.fixture
def conversation() -> dict[str, Any]:
    """The 60-round, 630 KB workload (``tests/workloads.py``): call_002's result opens with the needle."""
    return workload(rounds=60)


def requests_of(conversation: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The agent's requests: the history through each tool result."""
    messages = conversation["messages"]
    for end in (i + 1 for i, m in enumerate(messages) if m["role"] == "tool"):
        yield {"model": "m", "tools": conversation["tools"], "messages": messages[:end]}


def drive(client: TestClient, conversation: dict[str, Any], limit: int = 60, **extra: Any) -> list[httpx.Response]:
    out = []
    for n, body in enumerate(requests_of(conversation)):
        if n == limit:
            break
        out.append(client.post("/v1/chat/completions", json=body | extra))
    return out


def test_every_request_fits_and_the_stubs_reach_the_upstream(tmp_path: Path, conversation: dict[str, Any]) -> None:
    upstream = CountingUpstream(window=32768)
    with app_client(settings_for(tmp_path, CTXPROXY_CTX_WINDOW="32768"), httpx.ASGITransport(app=upstream)) as c:
        answers = drive(c, conversation)
    assert [a.status_code for a in answers] == [200] * 60
    assert upstream.over_window == 0 and max(upstream.counts) <= 24576  # the budget: window - reserve
    last = upstream.last_chat.json()
    assert violations(conversation["messages"], last["messages"]) == []
    assert sum("[overflow id=" in (m.get("content") or "") for m in last["messages"]) > 30


def test_what_was_cut_is_restorable_byte_for_byte(tmp_path: Path, conversation: dict[str, Any]) -> None:
    upstream = CountingUpstream(window=32768)
    with app_client(settings_for(tmp_path, CTXPROXY_CTX_WINDOW="32768"), httpx.ASGITransport(app=upstream)) as c:
        session = drive(c, conversation, limit=10)[-1].headers["x-ctx-session"]
        sent = upstream.last_chat.json()["messages"]
        originals = {m["tool_call_id"]: m["content"] for m in conversation["messages"] if m["role"] == "tool"}
        cut = [m for m in sent if m["role"] == "tool" and STUB_ID.match(m["content"])]
        assert cut
        for m in cut:
            oid = STUB_ID.match(m["content"]).group(1)  # type: ignore[union-attr]
            restored = c.get(f"/ctx/sessions/{session}/overflow/{oid}")
            assert restored.status_code == 200 and restored.content == originals[m["tool_call_id"]].encode()
        needle = next(m for m in sent if m.get("tool_call_id") == "call_002")
        oid = STUB_ID.match(needle["content"]).group(1)  # type: ignore[union-attr]
        assert NEEDLE.encode() in c.get(f"/ctx/sessions/{session}/overflow/{oid}").content
        assert c.get(f"/ctx/sessions/other/overflow/{oid}").status_code == 404  # scoped to its session


def test_an_upstream_that_counts_more_stops_overflowing_within_two_requests(
        tmp_path: Path, conversation: dict[str, Any]) -> None:
    upstream = CountingUpstream(window=8192, ratio=1.3)
    settings = settings_for(tmp_path, CTXPROXY_CTX_WINDOW="8192", CTXPROXY_CONTEXT_RESERVE="0")  # no headroom
    with app_client(settings, httpx.ASGITransport(app=upstream)) as c:
        answers = drive(c, conversation, limit=30)
    assert all(a.status_code == 200 for a in answers)
    overflowing = [i for i, count in enumerate(upstream.counts) if count > upstream.window]
    chats_per_request = len(upstream.counts) - len(answers)  # retries
    assert len(overflowing) == chats_per_request <= 2
    assert not overflowing or overflowing[-1] <= 2


def test_a_llama_cpp_overflow_is_retried_smaller_and_the_client_gets_its_answer(
        tmp_path: Path, conversation: dict[str, Any]) -> None:
    upstream = CountingUpstream(window=100_000)
    upstream.enqueue(Reply(status=400, body={"error": {"code": 400, "type": "exceed_context_size_error",
                                                       "message": "the request exceeds the available context size",
                                                       "n_prompt_tokens": 9000, "n_ctx": 8192}}))
    body = next(b for n, b in enumerate(requests_of(conversation)) if n == 5)
    with app_client(settings_for(tmp_path), httpx.ASGITransport(app=upstream)) as c:
        answer = c.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "fits"
        assert c.post("/v1/chat/completions", json=body).status_code == 200  # the learned window holds
    first, retry = upstream.chats[0].body, upstream.chats[1].body
    assert len(retry) < len(first) and upstream.counts[1] <= 8192 - 2048  # cut to the upstream's own window
    rows = Journal(tmp_path / "data" / "journal.db").conn.execute(
        "SELECT attempt, outcome FROM responses WHERE request_id = 1 ORDER BY attempt").fetchall()
    assert rows == [(0, "context_overflow"), (1, "ok")]


def test_two_overflows_in_a_row_end_in_a_clear_error(tmp_path: Path) -> None:
    upstream = CountingUpstream(window=100)  # refuses everything
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 500}]}
    with app_client(settings_for(tmp_path), httpx.ASGITransport(app=upstream)) as c:
        answer = c.post("/v1/chat/completions", json=body)
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["code"] == "context_length_exceeded"
        assert "message 0 (user" in error["message"]
        assert answer.headers["x-ctx-session"]
        assert c.post("/v1/chat/completions", json=body).status_code == 400  # and again, never a 500
    rows = Journal(tmp_path / "data" / "journal.db").conn.execute(
        "SELECT request_id, attempt, outcome FROM responses ORDER BY request_id, attempt").fetchall()
    assert [r[1:] for r in rows if r[0] == 1] == [(0, "context_overflow"), (1, "context_too_large")]


def test_an_empty_stream_is_asked_about_and_an_overflow_is_retried_to_fit(
        tmp_path: Path, conversation: dict[str, Any]) -> None:
    """llama.cpp's streamed overflow: a 200 that ends before its first byte. The same prompt, not streamed and for
    one token, gets the server's counts; the window is learned and the retry fits it."""
    upstream = CountingUpstream(window=4096)  # streamed and over the window: an empty 200
    body = next(b for n, b in enumerate(requests_of(conversation)) if n == 5) | {"stream": True}
    with app_client(settings_for(tmp_path), httpx.ASGITransport(app=upstream)) as c:
        answer = c.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200 and "fits" in answer.text and answer.text.rstrip().endswith("[DONE]")
    stream, probe, _ = (r.json() for r in upstream.chats)
    assert probe["messages"] == stream["messages"] and not probe["stream"] and probe["max_tokens"] == 1
    assert upstream.counts[0] > 4096 and upstream.counts[1] > 4096 >= upstream.counts[2]


def test_an_empty_stream_of_a_prompt_that_fits_is_a_502_and_teaches_nothing(
        tmp_path: Path, conversation: dict[str, Any]) -> None:
    upstream = CountingUpstream(window=100_000)
    upstream.enqueue(Reply(raw=b"", headers={"content-type": "text/event-stream"}))
    body = next(b for n, b in enumerate(requests_of(conversation)) if n == 5) | {"stream": True}
    with app_client(settings_for(tmp_path), httpx.ASGITransport(app=upstream)) as c:
        answer = c.post("/v1/chat/completions", json=body)
        assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_disconnected"
        again = c.post("/v1/chat/completions", json=body)
    assert again.status_code == 200 and "fits" in again.text
    assert [r.json()["stream"] for r in upstream.chats] == [True, False, True]
    assert upstream.chats[2].json()["messages"] == upstream.chats[0].json()["messages"]  # no window was learned


def test_a_stream_that_breaks_off_is_asked_why_and_retried_to_fit(tmp_path: Path, conversation: dict[str, Any]) -> None:
    """llama-cpp-python's streamed overflow: the connection closes before the first byte. The proxy asks the
    server why (the same prompt, not streamed, one token), learns its window from the answer and retries."""
    upstream = CountingUpstream(window=4096)
    upstream.enqueue(Reply(break_off=True))
    body = next(b for n, b in enumerate(requests_of(conversation)) if n == 5) | {"stream": True}
    with serve_in_thread(upstream) as base, \
            TestClient(create_app(settings_for(tmp_path, CTXPROXY_UPSTREAM=base + "/v1"))) as c:
        answer = c.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200 and answer.text.rstrip().endswith("[DONE]"), answer.text
    assert [r.json().get("stream") for r in upstream.chats] == [True, False, True]
    assert upstream.counts[0] > 4096 >= upstream.counts[1]  # the probe (the first counted) was refused; the retry fit


def test_a_stream_that_breaks_off_for_another_reason_is_a_clear_502(tmp_path: Path) -> None:
    upstream = CountingUpstream(window=100_000)
    upstream.enqueue(Reply(break_off=True))
    with serve_in_thread(upstream) as base, \
            TestClient(create_app(settings_for(tmp_path, CTXPROXY_UPSTREAM=base + "/v1"))) as c:
        answer = c.post("/v1/chat/completions", json={"model": "m", "stream": True,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    error = answer.json()["error"]
    assert answer.status_code == 502 and error["code"] == "upstream_disconnected", error
    assert "closed the connection" in error["message"] and "Cannot reach" not in error["message"]
    assert [r.json().get("stream") for r in upstream.chats] == [True, False]  # asked why; it took the prompt


def test_an_upstream_that_is_not_there_is_a_502_that_says_so(tmp_path: Path) -> None:
    from tests.real.upstream import free_port

    with TestClient(create_app(settings_for(tmp_path, CTXPROXY_UPSTREAM=f"http://127.0.0.1:{free_port()}/v1"))) as c:
        answer = c.post("/v1/chat/completions", json={"model": "m", "stream": True,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_unreachable"
    assert "Cannot reach the upstream" in answer.json()["error"]["message"]


def test_a_request_that_cannot_fit_gets_a_clear_error(tmp_path: Path) -> None:
    upstream = CountingUpstream(window=100_000)
    body = {"model": "m", "messages": [{"role": "system", "content": " ".join(f"rule {i};" for i in range(1500))},
                                       {"role": "user", "content": "go"}]}
    with app_client(settings_for(tmp_path, CTXPROXY_CTX_WINDOW="4096"), httpx.ASGITransport(app=upstream)) as c:
        answer = c.post("/v1/chat/completions", json=body)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "message 0 (system" in error["message"] and "budget of 3072" in error["message"]
    assert answer.headers["x-ctx-session"] and upstream.chats == []


def test_an_operator_pin_keeps_a_result_whole(tmp_path: Path, conversation: dict[str, Any]) -> None:
    upstream = CountingUpstream(window=32768)
    with app_client(settings_for(tmp_path, CTXPROXY_CTX_WINDOW="32768"), httpx.ASGITransport(app=upstream)) as c:
        session = drive(c, conversation, limit=3)[-1].headers["x-ctx-session"]
        sent = {m.get("tool_call_id"): m for m in upstream.last_chat.json()["messages"]}
        assert sent["call_002"]["content"].startswith("[overflow")
        pinned = c.post(f"/ctx/sessions/{session}/pins", json={"snippet": NEEDLE})
        assert pinned.status_code == 201 and pinned.json()["pins"] == ["tool:call_002"]
        drive(c, conversation, limit=4)
        sent = {m.get("tool_call_id"): m for m in upstream.last_chat.json()["messages"]}
        assert sent["call_002"]["content"].startswith(NEEDLE)
        c.request("DELETE", f"/ctx/sessions/{session}/pins", json={"handle": "tool:call_002"})
        assert c.get(f"/ctx/sessions/{session}/pins").json()["pins"] == []


def test_decisions_survive_a_restart_byte_for_byte(tmp_path: Path, conversation: dict[str, Any]) -> None:
    settings = settings_for(tmp_path, CTXPROXY_CTX_WINDOW="16384")
    first, second = CountingUpstream(window=16384), CountingUpstream(window=16384)
    bodies = list(requests_of(conversation))
    with app_client(settings, httpx.ASGITransport(app=first)) as c:
        sessions = {c.post("/v1/chat/completions", json=b).headers["x-ctx-session"] for b in bodies[:25]}
    with app_client(settings, httpx.ASGITransport(app=second)) as c:  # a new process over the same journal
        resumed = c.post("/v1/chat/completions", json=bodies[25]).headers["x-ctx-session"]
    assert sessions == {resumed}  # the same session, resumed from the journal
    before, after = first.last_chat.json()["messages"], second.last_chat.json()["messages"]
    assert any(m["content"].startswith("[overflow id=") for m in before if m["role"] == "tool")
    assert after[: len(before)] == before  # the prefix cache of the upstream survives the restart


def test_incognito_cuts_stay_in_memory(tmp_path: Path) -> None:
    upstream = CountingUpstream(window=32768)
    secret = "incognito-only-output " * 2000
    messages = [{"role": "user", "content": "private task"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": secret}]
    with app_client(settings_for(tmp_path, CTXPROXY_CTX_WINDOW="32768"), httpx.ASGITransport(app=upstream)) as c:
        c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "public"}]})
        answer = c.post("/v1/chat/completions", headers={"X-Ctx-Incognito": "1"},
                        json={"model": "m", "messages": messages})
        assert answer.status_code == 200
    stub = upstream.last_chat.json()["messages"][2]["content"]
    assert "storage=memory-only (incognito)" in stub and "lost when ctxproxy stops" in stub
    on_disk = b"".join(p.read_bytes() for p in (tmp_path / "data").iterdir())
    assert b"incognito-only-output" not in on_disk and b"private task" not in on_disk


def test_pins_take_bare_call_ids_and_snippets_with_quotes(tmp_path: Path) -> None:
    upstream = CountingUpstream(window=100_000)
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": 'print("hello world")\n'}]
    with app_client(settings_for(tmp_path), httpx.ASGITransport(app=upstream)) as c:
        session = c.post("/v1/chat/completions", json={"model": "m", "messages": messages}).headers["x-ctx-session"]
        assert c.post(f"/ctx/sessions/{session}/pins", json={"handle": "c1"}).json()["pins"] == ["tool:c1"]
        assert c.post(f"/ctx/sessions/{session}/pins", json={"handle": "nope"}).status_code == 404
        by_snippet = c.post(f"/ctx/sessions/{session}/pins", json={"snippet": 'print("hello world")'})
        assert by_snippet.status_code == 201 and by_snippet.json()["pins"] == ["tool:c1"]


def test_an_error_field_that_refuses_a_streamed_prompt_is_read_as_the_overflow_it_is(
        tmp_path: Path, conversation: dict[str, Any]) -> None:
    """Older llama.cpp servers refuse a streamed prompt in a 200 whose first event is an SSE ``error:`` field, with
    the counts: relayed, the client got an event no SSE reader knows (the Anthropic SDK: a 200 with no event)."""
    upstream = CountingUpstream(window=4096)
    refusal = {"code": 400, "message": "the request exceeds the available context size, try increasing it",
               "type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 4096}
    upstream.enqueue(Reply(raw=b"error: " + json.dumps(refusal).encode() + b"\n\ndata: [DONE]\n\n",
                           headers={"content-type": "text/event-stream"}))
    body = next(b for n, b in enumerate(requests_of(conversation)) if n == 5) | {"stream": True}
    with app_client(settings_for(tmp_path), httpx.ASGITransport(app=upstream)) as c:
        answer = c.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200 and "fits" in answer.text
    assert [r.json()["stream"] for r in upstream.chats] == [True, True]  # no probe: the event said why
    assert upstream.counts[-1] <= 4096


def test_an_error_field_mid_stream_reaches_the_client_as_an_error_chunk(
        tmp_path: Path, conversation: dict[str, Any]) -> None:
    failure = {"code": 500, "message": "failed to decode the batch (KV cache full)", "type": "server_error"}
    upstream = CountingUpstream(window=100_000)
    upstream.enqueue(Reply(raw=b'data: {"choices": [{"index": 0, "delta": {"content": "Here is the fi"}}]}\n\n'
                           b"error: " + json.dumps(failure).encode() + b"\n\ndata: [DONE]\n\n",
                           headers={"content-type": "text/event-stream"}))
    body = next(b for n, b in enumerate(requests_of(conversation)) if n == 5) | {"stream": True}
    with app_client(settings_for(tmp_path), httpx.ASGITransport(app=upstream)) as c:
        answer = c.post("/v1/chat/completions", json=body)
    chunks = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1] == {"error": failure} and "error:" not in answer.text
