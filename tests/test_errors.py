"""Every failure path answers in the OpenAI envelope, with its status, and leaves the journal whole."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from ctxproxy.config import Settings, load_settings
from ctxproxy.store import Journal
from tests.conftest import app_client, chat
from tests.fakes import FakeUpstream, Reply


def assert_envelope(response: httpx.Response, status: int, type_: str, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_ and body["error"]["param"] == param
    assert "Traceback" not in response.text and body["error"]["message"]
    return body["error"]  # type: ignore[no-any-return]


def rows(settings: Settings, table: str) -> int:
    path = settings.data_path / "journal.db"
    return Journal(path).conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] if path.exists() else 0


BAD_BODIES = [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'{"model": "m"}', "messages"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": "hi"}', "messages"),
    (b'{"messages": [{"content": "hi"}]}', "messages[0].role"),
    (b'{"messages": ["hi"]}', "messages[0]"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    (b'{"messages": [{"role": "tool", "content": "x"}]}', "messages[0].tool_call_id"),
    (b'{"messages": [{"role": "assistant", "tool_calls": {}}]}', "messages[0].tool_calls"),
    (b'{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]}',
     "messages[0].tool_calls[0].id"),
    (b'{"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}]}',
     "messages[0].tool_calls[0].function.name"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "model": 3}', "model"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "stream"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "tools": {}}', "tools"),
    # issue #10 item 2: each of these was accepted, then ended in a 500 (some after the upstream was called)
    (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": "f"}]}',
     "tools[0].function"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "tools": [{"function": []}]}',
     "tools[0].function"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": {"name": 3}}]}',
     "tools[0].function.name"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "tools": ["f"]}', "tools[0]"),
    (b'{"messages": [{"role": "user", "content": [{"type": ["text"], "text": "hi"}]}]}',
     "messages[0].content[0].type"),
    (b'{"messages": [{"role": "user", "content": [7]}]}', "messages[0].content[0]"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 300 + b"]" * 300 + b"}",
     "x" + "[0]" * 253),
    (b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 2000 + b"]" * 2000 + b"}", None),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}], "x": ' + b"[" * 2000 + b"]" * 2000 + b"}", None),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}], "n": 123456789012345678901234567890}', "n"),
]


@pytest.mark.parametrize(("raw", "param"), BAD_BODIES)
def test_bad_input_is_a_400_naming_the_field_and_is_not_journaled(
        client: TestClient, fake: FakeUpstream, settings: Settings, raw: bytes, param: str | None) -> None:
    response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert_envelope(response, 400, "invalid_request_error", param)
    assert fake.chats == [] and rows(settings, "requests") == 0


def test_a_lone_surrogate_in_a_key_is_taken_like_one_in_a_value(
        client: TestClient, fake: FakeUpstream, settings: Settings) -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi", "\\udc00x": "\\ud83d"}]}'
    response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert rows(settings, "responses") == 1 and len(fake.chats) == 1


def test_a_body_over_the_limit_is_a_413(tmp_path: Any, fake: FakeUpstream) -> None:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_MAX_BODY_BYTES": "2048",
                                  "CTXPROXY_UPSTREAM": "http://u.test/v1"})
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        error = assert_envelope(client.post("/v1/chat/completions", json=chat("x" * 5000)), 413,
                                "invalid_request_error")
        assert "max_body_bytes" in error["message"]
        assert client.post("/v1/chat/completions", json=chat("small")).status_code == 200
        chunked = client.post("/v1/chat/completions", content=iter([b"x" * 1500, b"y" * 1500]))
        assert_envelope(chunked, 413, "invalid_request_error")
    assert fake.chats[0].json()["messages"][1]["content"] == "small" and len(fake.chats) == 1


def raising(exc: Exception) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc
    return httpx.MockTransport(handler)


@pytest.mark.parametrize(("exc", "status", "outcome"), [
    (httpx.ConnectError("connection refused"), 502, "unreachable"),
    (httpx.ReadTimeout("slow"), 504, "timeout"),
    (httpx.ConnectTimeout("slow"), 504, "timeout"),
    (httpx.RemoteProtocolError("peer closed"), 502, "unreachable"),
])
def test_upstream_failures_are_502_or_504_and_journaled_whole(
        settings: Settings, exc: Exception, status: int, outcome: str) -> None:
    with app_client(settings, raising(exc)) as client:
        for stream in (False, True):
            response = client.post("/v1/chat/completions", json=chat("hi", stream=stream))
            assert_envelope(response, status, "upstream_error")
            assert "upstream" in response.json()["error"]["message"]
    journal = Journal(settings.data_path / "journal.db")
    outcomes = journal.conn.execute("SELECT outcome, status FROM responses").fetchall()
    assert outcomes == [(outcome, status), (outcome, status)] and rows(settings, "requests") == 2


UPSTREAM_ERROR = {"error": {"code": 404, "message": "model 'gpt-9' not found", "type": "invalid_request_error"}}


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_error_is_relayed_with_its_status_and_body(
        client: TestClient, fake: FakeUpstream, settings: Settings, stream: bool) -> None:
    fake.enqueue(Reply(status=404, body=UPSTREAM_ERROR))
    response = client.post("/v1/chat/completions", json=chat("hi", stream=stream))
    assert response.status_code == 404 and response.json() == UPSTREAM_ERROR
    journal = Journal(settings.data_path / "journal.db")
    assert journal.conn.execute("SELECT outcome, status FROM responses").fetchall() == [("upstream_error", 404)]


def test_an_unexpected_failure_is_a_500_envelope_without_traceback(settings: Settings) -> None:
    with app_client(settings, raising(RuntimeError("boom in transport"))) as client:
        error = assert_envelope(client.post("/v1/chat/completions", json=chat("hi")), 500, "server_error")
        assert "boom" not in error["message"]
        # the session lock was released: the next request of the same session is answered too
        assert client.post("/v1/chat/completions", json=chat("hi")).status_code == 500


def test_unknown_routes_and_sessions_are_404_envelopes(client: TestClient) -> None:
    assert_envelope(client.get("/nowhere"), 404, "not_found_error")
    assert_envelope(client.get("/ctx/sessions/nope"), 404, "not_found_error")
    assert_envelope(client.get("/ctx/sessions/nope/journal"), 404, "not_found_error")
    assert_envelope(client.get("/ctx/requests/99"), 404, "not_found_error")


def test_bad_query_parameters_are_400_envelopes(client: TestClient) -> None:
    client.post("/v1/chat/completions", json=chat("hi"), headers={"X-Session-Id": "s"})
    assert_envelope(client.get("/ctx/sessions/s/journal?after=abc"), 400, "invalid_request_error", "after")


def test_the_operator_api_needs_the_token_when_one_is_set(tmp_path: Any, fake: FakeUpstream) -> None:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_ADMIN_TOKEN": "t0k",
                                  "CTXPROXY_UPSTREAM": "http://u.test/v1"})
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        assert_envelope(client.get("/ctx/sessions"), 401, "authentication_error")
        assert_envelope(client.get("/ctx/sessions", headers={"Authorization": "Bearer nope"}), 401,
                        "authentication_error")
        assert client.get("/ctx/sessions", headers={"Authorization": "Bearer t0k"}).status_code == 200
        assert client.post("/v1/chat/completions", json=chat("hi")).status_code == 200  # the proxy itself is open
