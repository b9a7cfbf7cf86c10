"""A malformed upstream answer is a 502 ``upstream_malformed`` (or, once a stream's 200 has left, an error event and
``[DONE]``), and its response row is written whatever the answer held (issue #10 item 3)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ctxproxy.config import Settings
from ctxproxy.proxy.errors import UpstreamMalformed
from ctxproxy.proxy.upstream.answers import check_chunk, check_completion, usage_figure
from ctxproxy.store import Journal
from tests.conftest import chat
from tests.fakes import FakeUpstream, Reply, completion, stream_chunks

CHUNK = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi "}}]}


def response_rows(settings: Settings) -> list[tuple[str, int]]:
    db = Journal(settings.data_path / "journal.db").conn
    return [(r[0], r[1]) for r in db.execute("SELECT outcome, status FROM responses ORDER BY id")]


def data_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("answer", [
    {"choices": ["x"]},
    {"choices": "x"},
    {"choices": [{"message": "x"}]},
    {"choices": [{"message": {"role": "assistant", "tool_calls": [{"id": "c", "function": "f"}]}}]},
    {"choices": [{"message": {"role": "assistant", "tool_calls": [{"function": {"name": ["f"]}}]}}]},
    {"choices": [{"message": {"role": "assistant", "content": "hi"}}], "usage": "many"},
    ["not", "an", "object"],
])
def test_a_malformed_answer_is_a_502_upstream_malformed_and_journaled(
        client: TestClient, fake: FakeUpstream, settings: Settings, answer: Any) -> None:
    fake.enqueue(Reply(body=answer))
    response = client.post("/v1/chat/completions", json=chat("hi"))
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "upstream_malformed" and error["type"] == "upstream_error"
    assert "can read" in error["message"]
    assert response_rows(settings) == [("upstream_malformed", 502)]


def test_a_2xx_answer_that_is_not_json_is_a_502(client: TestClient, fake: FakeUpstream, settings: Settings) -> None:
    fake.enqueue(Reply(raw=b"<html>gateway</html>"))
    response = client.post("/v1/chat/completions", json=chat("hi"))
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_malformed"
    assert "<html>" in response.json()["error"]["message"]
    assert response_rows(settings) == [("upstream_malformed", 502)]


@pytest.mark.parametrize("bad", [
    {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": "z", "id": "call_1", "function": {"name": "f", "arguments": ""}}]}}]},
    {"object": "chat.completion.chunk", "choices": "x"},
    {"object": "chat.completion.chunk", "choices": [], "usage": "x"},
    {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": ["x"]}]},
    b"data: {not json\n\n",  # every OpenAI client parses each event: relayed, it would break the client instead
])
def test_a_malformed_stream_ends_with_an_error_event_and_done(
        client: TestClient, fake: FakeUpstream, settings: Settings, bad: Any) -> None:
    fake.enqueue(Reply(sse=[CHUNK, bad, CHUNK]))
    response = client.post("/v1/chat/completions", json=chat("hi", stream=True))
    assert response.status_code == 200
    *_, error, done = data_lines(response.text)
    assert done == "data: [DONE]"
    assert error.startswith('data: {"error":') and '"upstream_malformed"' in error, response.text
    assert '"hi "' in response.text  # what came before the bad chunk reached the client
    assert response_rows(settings) == [("upstream_malformed", 200)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("figure", [-5, 1.5, 2 ** 70, "12", True])
def test_odd_usage_figures_are_unknown_and_the_row_is_still_written(
        client: TestClient, fake: FakeUpstream, settings: Settings, stream: bool, figure: Any) -> None:
    usage = {"prompt_tokens": figure, "completion_tokens": figure, "total_tokens": figure}
    fake.enqueue(Reply(sse=stream_chunks("fine", usage=usage)) if stream else
                 Reply(body=completion("fine") | {"usage": usage}))
    response = client.post("/v1/chat/completions", json=chat("hi", stream=stream))
    assert response.status_code == 200 and "fine" in response.text
    assert response_rows(settings) == [("ok", 200)]
    stored = Journal(settings.data_path / "journal.db").conn.execute("SELECT usage FROM responses").fetchone()[0]
    assert json.loads(stored) == usage  # kept as it came
    assert client.get("/metrics").status_code == 200
    client.post("/v1/chat/completions", json=chat("hi", "fine", "and then"))  # the session still works
    assert response_rows(settings)[-1] == ("ok", 200)


def test_usage_figure_takes_only_plausible_counts() -> None:
    assert [usage_figure({"n": v}, "n") for v in (0, 7, -1, True, 1.0, "3", 2 ** 60)] == [0, 7] + [None] * 5
    assert usage_figure("usage", "n") is None and usage_figure(None, "n") is None


def test_a_well_formed_answer_and_chunk_pass() -> None:
    check_completion(completion("hi"))
    for chunk in stream_chunks("a b", usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}):
        check_chunk(chunk)
    check_chunk("a non-object payload is not read by the proxy")
    with pytest.raises(UpstreamMalformed, match=r"choices\[0\]\.delta\.tool_calls\[0\]\.index"):
        check_chunk({"choices": [{"delta": {"tool_calls": [{"index": -1}]}}]})
