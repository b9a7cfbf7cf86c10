"""``POST /v1/responses`` through the real app, in front of the scripted chat-completions upstream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from ctxproxy.config import load_settings
from ctxproxy.proxy.edge.app import create_app
from ctxproxy.proxy.upstream.sse import sse_lines
from ctxproxy.store import Journal
from tests.fakes import FakeUpstream, Reply, completion, serve_in_thread, stream_chunks, stream_tool_answer, tool_answer

SHELL = {"type": "function", "name": "exec_command", "description": "Run a shell command.",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}


def events_of(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in sse_lines(text) if line.startswith("data: ")]


def journal_of(client: TestClient) -> Journal:
    return Journal(client.app.state.ctx.settings.data_path / "journal.db")  # type: ignore[attr-defined]


def test_a_buffered_request_is_served_as_a_response(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=completion("hello there", prompt_tokens=21)))
    got = client.post("/v1/responses", json={"model": "fake-model", "input": "hi", "instructions": "Be terse."})
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["object"] == "response" and body["status"] == "completed"
    assert body["output"][0]["content"][0]["text"] == "hello there"
    assert body["usage"]["input_tokens"] == 21
    sent = fake.last_chat.json()
    assert sent["messages"] == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    assert got.headers["x-ctx-session"]


def test_a_streamed_request_gets_responses_events(client: TestClient, fake: FakeUpstream) -> None:
    usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
    fake.enqueue(Reply(sse=stream_chunks("hello there", usage=usage)))
    got = client.post("/v1/responses", json={"model": "fake-model", "input": "hi", "stream": True})
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/event-stream")
    events = events_of(got.text)
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["usage"]["output_tokens"] == 2
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "hello there "
    assert fake.last_chat.json()["stream_options"] == {"include_usage": True}


def test_the_agents_function_call_goes_out_as_a_function_call_item(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(sse=stream_tool_answer(("exec_command", {"cmd": "ls"}))))
    got = client.post("/v1/responses", json={"model": "fake-model", "input": "list", "tools": [SHELL],
                                             "stream": True})
    output = events_of(got.text)[-1]["response"]["output"]
    assert [(i["type"], i["name"], json.loads(i["arguments"])) for i in output] == [
        ("function_call", "exec_command", {"cmd": "ls"})]
    assert fake.last_chat.json()["tools"][0]["function"]["name"] == "exec_command"


def test_codex_session_headers_name_the_session(client: TestClient, fake: FakeUpstream) -> None:
    got = client.post("/v1/responses", json={"model": "fake-model", "input": "hi"},
                      headers={"session-id": "codex-thread-1", "thread-id": "other"})
    assert got.headers["x-ctx-session"] == "codex-thread-1"
    keyed = client.post("/v1/responses", json={"model": "fake-model", "input": "hi", "prompt_cache_key": "pck-7"})
    assert keyed.headers["x-ctx-session"] == "pck-7"
    journal = journal_of(client)
    [row] = journal.session_journal("codex-thread-1")
    assert (journal.request(row["request_id"]) or {})["path"] == "/v1/responses"  # the protocol spoken


def test_a_built_in_tool_is_refused_before_anything_is_forwarded(client: TestClient, fake: FakeUpstream) -> None:
    got = client.post("/v1/responses", json={"model": "fake-model", "input": "hi",
                                             "tools": [{"type": "web_search", "external_web_access": False}]})
    assert got.status_code == 400
    assert got.json()["error"]["param"] == "tools[0].type" and not fake.chats


def test_an_upstream_error_is_relayed_in_the_error_envelope(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(status=500, body={"error": {"message": "boom", "type": "server_error", "code": None}}))
    got = client.post("/v1/responses", json={"model": "fake-model", "input": "hi"})
    assert got.status_code == 500 and got.json()["error"]["message"] == "boom"


def test_a_context_tool_round_on_a_stream_is_one_coherent_response(roomy_client: TestClient,
                                                                   fake: FakeUpstream) -> None:
    """The model calls the proxy's context tool first: the proxy runs it, asks again, and the agent reads one
    response with the final answer only."""
    history = [{"type": "message", "role": "user", "content": "run it"},
               {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": "{\"cmd\":\"x\"}"},
               {"type": "function_call_output", "call_id": "call_1", "output": "line\n" * 400},
               {"type": "message", "role": "user", "content": "now summarise"}]
    fake.enqueue(Reply(sse=stream_tool_answer(("context_drop", {"handles": ["call_1"]}))))
    fake.enqueue(Reply(sse=stream_chunks("all done", usage={"prompt_tokens": 5, "completion_tokens": 2,
                                                            "total_tokens": 7})))
    got = roomy_client.post("/v1/responses", json={"model": "fake-model", "input": history, "tools": [SHELL],
                                                   "stream": True})
    events = events_of(got.text)
    kinds = [e["type"] for e in events]
    assert kinds.count("response.created") == 1 and kinds.count("response.completed") == 1
    output = events[-1]["response"]["output"]
    assert [i["type"] for i in output] == ["message"] and output[0]["content"][0]["text"] == "all done "
    assert len(fake.chats) == 2 and "context_drop" in fake.chats[1].body.decode()  # the round, spliced
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_context_tool_round_buffered_answers_with_the_final_response(roomy_client: TestClient,
                                                                       fake: FakeUpstream) -> None:
    history = [{"type": "message", "role": "user", "content": "run it"},
               {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "call_1", "output": "out"}]
    fake.enqueue(Reply(body=tool_answer(("context_drop", {"handles": ["call_1"]}))))
    fake.enqueue(Reply(body=completion("finished")))
    got = roomy_client.post("/v1/responses", json={"model": "fake-model", "input": history, "tools": [SHELL]})
    assert got.json()["output"][0]["content"][0]["text"] == "finished"
    assert got.headers["x-ctx-internal-rounds"] == "1"


@pytest.fixture
def proxy_url(tmp_path: Path, fake: FakeUpstream) -> Iterator[str]:
    with serve_in_thread(fake) as direct:
        settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"),
                                      "CTXPROXY_UPSTREAM": direct + "/v1"})
        with serve_in_thread(create_app(settings)) as proxy:
            yield proxy


@pytest.mark.e2e
def test_the_openai_sdk_creates_responses_through_the_proxy(proxy_url: str, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=tool_answer(("exec_command", {"cmd": "ls"}))))
    fake.enqueue(Reply(body=completion("two files")))
    with openai.OpenAI(base_url=proxy_url + "/v1", api_key="sk-test", max_retries=0) as sdk:
        first = sdk.responses.create(model="fake-model", input="list the files", tools=[SHELL])  # type: ignore[list-item]
        call = first.output[0]
        assert call.type == "function_call" and call.name == "exec_command"
        second = sdk.responses.create(model="fake-model", tools=[SHELL], input=[  # type: ignore[list-item]
            {"role": "user", "content": "list the files"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt b.txt"}])
    assert second.output_text == "two files" and second.usage is not None and second.usage.input_tokens == 10
    assert fake.last_chat.json()["messages"][-1] == {"role": "tool", "tool_call_id": call.call_id,
                                                      "content": "a.txt b.txt"}


@pytest.mark.e2e
def test_the_openai_sdk_streams_responses_through_the_proxy(proxy_url: str, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(sse=stream_tool_answer(("exec_command", {"cmd": "ls"}), content="Looking")))
    with (openai.OpenAI(base_url=proxy_url + "/v1", api_key="sk-test", max_retries=0) as sdk,
          sdk.responses.stream(model="fake-model", input="list", tools=[SHELL]) as stream):  # type: ignore[list-item]
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Looking "
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == json.dumps({"cmd": "ls"})  # type: ignore[union-attr]


def test_a_previous_response_id_chain_sends_the_whole_conversation(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=completion("Paris.")))
    first = client.post("/v1/responses", json={"model": "fake-model", "input": "Capital of France?",
                                               "instructions": "Be terse."}).json()
    fake.enqueue(Reply(body=completion("About 2 million.")))
    second = client.post("/v1/responses", json={"model": "fake-model", "input": "Population?",
                                                "previous_response_id": first["id"]})
    assert second.json()["previous_response_id"] == first["id"]
    assert fake.last_chat.json()["messages"] == [
        {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Population?"}]  # instructions are per request, as OpenAI's are
    fake.enqueue(Reply(body=completion("Yes.")))
    client.post("/v1/responses", json={"model": "fake-model", "input": "Sure?", "previous_response_id":
                                       second.json()["id"]})
    assert [m["content"] for m in fake.last_chat.json()["messages"]] == [
        "Capital of France?", "Paris.", "Population?", "About 2 million.", "Sure?"]


def test_a_streamed_function_call_chains_to_its_output(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(sse=stream_tool_answer(("exec_command", {"cmd": "ls"}))))
    got = client.post("/v1/responses", json={"model": "fake-model", "input": "list", "tools": [SHELL],
                                             "stream": True})
    first = events_of(got.text)[-1]["response"]
    call = first["output"][0]
    client.post("/v1/responses", json={"model": "fake-model", "tools": [SHELL], "previous_response_id": first["id"],
                                       "input": [{"type": "function_call_output", "call_id": call["call_id"],
                                                  "output": "a.txt"}]})
    sent = fake.last_chat.json()["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert sent[1]["tool_calls"][0]["id"] == sent[2]["tool_call_id"] == call["call_id"]


def test_a_response_not_kept_cannot_be_continued(client: TestClient, fake: FakeUpstream) -> None:
    unkept = client.post("/v1/responses", json={"model": "fake-model", "input": "hi", "store": False}).json()
    chats = len(fake.chats)
    for previous in (unkept["id"], "resp_unknown"):
        got = client.post("/v1/responses", json={"model": "fake-model", "input": "more",
                                                 "previous_response_id": previous})
        assert got.status_code == 400
        assert got.json()["error"]["code"] == "previous_response_not_found"
        assert got.json()["error"]["param"] == "previous_response_id"
    assert len(fake.chats) == chats


@pytest.mark.e2e
def test_the_openai_sdk_chains_responses_through_the_proxy(proxy_url: str, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(sse=stream_chunks("Paris.")))
    fake.enqueue(Reply(body=completion("About 2 million.")))
    with openai.OpenAI(base_url=proxy_url + "/v1", api_key="sk-test", max_retries=0) as sdk:
        with sdk.responses.stream(model="fake-model", input="Capital of France?") as stream:
            first = stream.get_final_response()
        second = sdk.responses.create(model="fake-model", input="Population?", previous_response_id=first.id)
    assert second.output_text == "About 2 million."
    assert [m["content"] for m in fake.last_chat.json()["messages"]] == [
        "Capital of France?", "Paris. ", "Population?"]
