"""``POST /v1/messages`` in process, translated to the chat upstream: buffered and streamed, tool calls, the
context tools taken out of the answer, sessions from Claude Code's header, errors in Anthropic's shape, and the
official ``anthropic`` SDK against it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from fastapi.testclient import TestClient

from ctxproxy.config import load_settings
from tests.conftest import app_client
from tests.fakes import FakeUpstream, Reply, completion, stream_chunks, stream_tool_answer, tool_answer

BIG = "SECRET_TOKEN=needle-4471\n" + "".join(f"line {i}: some output of the tool\n" for i in range(1500))
BASH = {"name": "Bash", "description": "Run a command", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


@pytest.fixture
def client(roomy_client: TestClient) -> TestClient:
    return roomy_client


def body(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "claude-test", "max_tokens": 256, "messages": list(messages), **fields}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def tool_round(i: int, output: str) -> list[dict[str, Any]]:
    """An assistant's Bash call and the user's tool_result for it, as Claude Code sends them."""
    return [{"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "c2ln"},
                {"type": "tool_use", "id": f"toolu_{i}", "name": "Bash", "input": {"command": f"ls {i}"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": output,
                                          "cache_control": {"type": "ephemeral"}}]}]


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def test_a_buffered_request_is_translated_to_chat_and_the_answer_back(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=completion("hello there", prompt_tokens=42)))
    system = [{"type": "text", "text": "You are Claude Code."},
              {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    answer = client.post("/v1/messages?beta=true", json=body(user("hi"), system=system, stop_sequences=["X"],
                                                               metadata={"user_id": "u1"}, temperature=0.5))
    assert answer.status_code == 200
    sent = fake.last_chat
    assert sent.query == "" and sent.json() == {
        "model": "claude-test", "messages": [{"role": "system", "content": "You are Claude Code.\n\nBe brief."},
                                             {"role": "user", "content": "hi"}],
        "max_tokens": 256, "temperature": 0.5, "stop": ["X"], "user": "u1"}
    got = answer.json()
    assert got["type"] == "message" and got["role"] == "assistant" and got["model"] == "claude-test"
    assert got["content"] == [{"type": "text", "text": "hello there"}] and got["stop_reason"] == "end_turn"
    assert got["usage"]["input_tokens"] == 42 and got["usage"]["output_tokens"] == 2


def test_tool_use_and_tool_results_map_both_ways(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=tool_answer(("Bash", {"command": "pwd"}), content="Let me look.")))
    answer = client.post("/v1/messages", json=body(user("where am I?"), *tool_round(0, "a.py"),
                                                   tools=[BASH], tool_choice={"type": "auto"}))
    sent = fake.last_chat.json()
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "Bash", "parameters": BASH["input_schema"], "description": "Run a command"}}]
    assert sent["tool_choice"] == "auto"
    assert sent["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "toolu_0", "type": "function", "function": {
            "name": "Bash", "arguments": '{"command":"ls 0"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_0", "content": "a.py"}]
    got = answer.json()
    assert got["stop_reason"] == "tool_use"
    assert got["content"] == [{"type": "text", "text": "Let me look."},
                              {"type": "tool_use", "id": "ctx_0_Bash", "name": "Bash", "input": {"command": "pwd"}}]


def test_a_streamed_answer_becomes_anthropic_events(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(sse=stream_tool_answer(("Bash", {"command": "ls -la"}), content="Looking now",
                                              usage={"prompt_tokens": 70, "completion_tokens": 9})))
    answer = client.post("/v1/messages", json=body(user("list"), tools=[BASH], stream=True))
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert fake.last_chat.json()["stream_options"] == {"include_usage": True}
    got = events(answer.text)
    assert [e["type"] for e in got] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", *["content_block_delta"] * 3, "content_block_stop", "message_delta", "message_stop"]
    assert got[5]["content_block"] == {"type": "tool_use", "id": "ctx_0_Bash", "name": "Bash", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in got[6:9]) == '{"command": "ls -la"}'
    assert got[-2]["delta"]["stop_reason"] == "tool_use" and got[-2]["usage"]["input_tokens"] == 70


def test_the_context_tools_run_inside_the_proxy_and_the_agent_sees_one_answer(
        client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=tool_answer(("context_drop", {"handles": ["toolu_1"]}))))
    fake.enqueue(Reply(body=completion("tidied")))
    history = [user("Please free up your context, then go on."), *tool_round(0, "small"), *tool_round(1, BIG)]
    answer = client.post("/v1/messages", json=body(*history, tools=[BASH]))
    assert answer.json()["content"] == [{"type": "text", "text": "tidied"}]
    assert "context_drop" in [t["function"]["name"] for t in fake.chats[-2].json()["tools"]]
    dropped = next(m for m in fake.last_chat.json()["messages"] if m.get("tool_call_id") == "toolu_1")
    assert dropped["content"].startswith("[overflow id=")


def test_the_context_tools_are_taken_out_of_a_stream_too(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(sse=stream_tool_answer(("context_drop", {"handles": ["toolu_1"]}), content="Tidying.")))
    fake.enqueue(Reply(sse=stream_chunks("all done", usage={"prompt_tokens": 5, "completion_tokens": 2})))
    history = [user("Please free up your context, then go on."), *tool_round(0, "small"), *tool_round(1, BIG)]
    answer = client.post("/v1/messages", json=body(*history, tools=[BASH], stream=True))
    got = events(answer.text)
    assert [e["type"] for e in got].count("message_start") == 1 and got[-1]["type"] == "message_stop"
    text = "".join(e["delta"].get("text", "") for e in got if e["type"] == "content_block_delta")
    assert text == "Tidying. all done " and "context_drop" not in answer.text.split(": context_op")[0]
    assert all(e["content_block"]["type"] == "text" for e in got if e["type"] == "content_block_start")


def test_claude_codes_run_and_conversation_name_the_session(client: TestClient, fake: FakeUpstream) -> None:
    """Claude Code sends its run's id on every request, its sub-agents' and side calls' too: one session per run
    serialised parallel sub-agents on its lock and gave the main agent's notices to a side call."""
    def session(messages: dict[str, Any], **headers: str) -> str:
        sent = client.post("/v1/messages", json=messages, headers={"X-Claude-Code-Session-Id": "cc-123", **headers})
        return str(sent.headers["x-ctx-session"])

    main = session(body(user("hi")))
    assert main.startswith("cc-123:") and session(body(user("hi"), user("more"))) == main
    assert session(body(user("hi"), system="Write a title.")) not in (main, "cc-123")  # a side call
    agents = {session(body(user("look into it")), **{"X-Claude-Code-Agent-Id": agent}) for agent in ("a1", "a2")}
    assert len(agents) == 2 and main not in agents
    assert client.get(f"/ctx/sessions/{main}").json()["requests"] == 2


@pytest.mark.parametrize(("payload", "param"), [
    (body({"role": "user", "content": [{"type": "document", "source": {}}]}), "messages[0].content[0]"),
    (body(user("hi"), tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (body(user("hi"), mcp_servers=[]), "mcp_servers"),
    (body({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "document", "source": {}}]}]}), "messages[0].content[0].content[0]"),
])
def test_what_cannot_be_translated_is_refused_in_anthropics_shape(
        client: TestClient, fake: FakeUpstream, payload: dict[str, Any], param: str) -> None:
    answer = client.post("/v1/messages", json=payload)
    assert answer.status_code == 400 and not fake.chats
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "cannot translate" in error["error"]["message"]


def test_errors_take_anthropics_shape(client: TestClient, fake: FakeUpstream) -> None:
    assert client.post("/v1/messages", content=b"{nope").json()["error"]["type"] == "invalid_request_error"
    assert client.post("/v1/messages", json={"model": "m", "messages": []}).status_code == 400
    fake.enqueue(Reply(status=503, body={"error": {"message": "model loading", "type": "server_error"}}))
    answer = client.post("/v1/messages", json=body(user("hi")))
    assert answer.status_code == 503
    assert answer.json() == {"type": "error", "error": {"type": "api_error", "message": "model loading"}}


def test_images_a_tool_returned_follow_its_result(client: TestClient, fake: FakeUpstream) -> None:
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_0", "content": [{"type": "text", "text": "saved"}, shot]}
    client.post("/v1/messages", json=body(user("shoot"), tool_round(0, "")[0],
                                          {"role": "user", "content": [result, {"type": "text", "text": "what?"}]}))
    assert fake.last_chat.json()["messages"][2:] == [
        {"role": "tool", "tool_call_id": "toolu_0",
         "content": "saved\n[1 image(s) returned by this tool follow in the next user message]"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
                                     {"type": "text", "text": "what?"}]}]


def test_images_map_to_image_urls(client: TestClient, fake: FakeUpstream) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}
    client.post("/v1/messages", json=body({"role": "user", "content": [image, {"type": "text", "text": "what?"}]}))
    assert fake.last_chat.json()["messages"][0]["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}}, {"type": "text", "text": "what?"}]


def sdk(client: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=str(client.base_url), api_key="sk-test", http_client=client, max_retries=0)


def test_the_anthropic_sdk_works_buffered_with_tool_calls(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=tool_answer(("Bash", {"command": "pwd"}))))
    message = sdk(client).messages.create(model="claude-test", max_tokens=100, tools=[BASH],  # type: ignore[list-item]
                                          messages=[{"role": "user", "content": "where?"}])
    assert message.stop_reason == "tool_use"
    call = message.content[0]
    assert call.type == "tool_use" and call.input == {"command": "pwd"}
    fake.enqueue(Reply(body=completion("/work")))
    final = sdk(client).messages.create(model="claude-test", max_tokens=100, tools=[BASH],  # type: ignore[list-item]
                                        messages=[{"role": "user", "content": "where?"},
                                                  {"role": "assistant", "content": message.content},
                                                  {"role": "user", "content": [{
                                                      "type": "tool_result", "tool_use_id": call.id,
                                                      "content": "/work"}]}])
    assert final.content[0].type == "text" and final.content[0].text == "/work"


def test_the_anthropic_sdk_works_streamed_with_tool_calls(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(sse=stream_tool_answer(("Bash", {"command": "ls"}), content="Checking",
                                              usage={"prompt_tokens": 30, "completion_tokens": 4})))
    with sdk(client).messages.stream(model="claude-test", max_tokens=100, tools=[BASH],  # type: ignore[list-item]
                                     messages=[{"role": "user", "content": "list"}]) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert text == "Checking "
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[1].input == {"command": "ls"}  # type: ignore[union-attr]
    assert message.usage.input_tokens == 30 and message.usage.output_tokens == 4


def count(client: TestClient, payload: dict[str, Any], **headers: str) -> int:
    answer = client.post("/v1/messages/count_tokens?beta=true", json=payload, headers=headers)
    assert answer.status_code == 200, answer.text
    tokens: int = answer.json()["input_tokens"]
    return tokens


def test_count_tokens_answers_with_the_session_projection(client: TestClient, fake: FakeUpstream) -> None:
    history = [user("Please free up your context, then go on."), *tool_round(0, "small"), *tool_round(1, BIG)]
    payload = {"model": "claude-test", "messages": history, "tools": [BASH]}
    before = count(client, payload, **{"X-Claude-Code-Session-Id": "cc-9"})
    assert before > 10_000 and not fake.received  # nothing forwarded, nothing journaled
    fake.enqueue(Reply(body=tool_answer(("context_drop", {"handles": ["toolu_1"]}))))
    fake.enqueue(Reply(body=completion("tidied")))
    client.post("/v1/messages", json=body(*history, tools=[BASH]), headers={"X-Claude-Code-Session-Id": "cc-9"})
    after = count(client, payload, **{"X-Claude-Code-Session-Id": "cc-9"})
    assert after < 1_000 < before  # the model dropped the big result: the agent is told what the model now sees
    assert count(client, payload) == before  # another session has not dropped it


def test_count_tokens_counts_what_fits_the_window(tmp_path: Path, fake: FakeUpstream) -> None:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "32768"})
    history = [user("go on"), *[m for i in range(8) for m in tool_round(i, BIG + str(i))]]
    with app_client(settings, httpx.ASGITransport(app=fake)) as small:
        projected = count(small, {"model": "claude-test", "messages": history})
        sent = sum(len(BIG) for _ in range(8)) // 4
    assert projected <= 32768 < sent


def test_a_stream_without_usage_reports_the_projected_prompt(client: TestClient, fake: FakeUpstream) -> None:
    """llama-cpp-python sends no usage in a stream; Claude Code reads its context size from it."""
    fake.enqueue(Reply(sse=stream_chunks("fine")))
    history = [user("go on"), *tool_round(0, BIG)]
    answer = client.post("/v1/messages", json=body(*history, stream=True),
                         headers={"X-Claude-Code-Session-Id": "cc-5"})
    delta = next(e for e in events(answer.text) if e["type"] == "message_delta")
    projected = count(client, {"model": "claude-test", "messages": history}, **{"X-Claude-Code-Session-Id": "cc-5"})
    assert delta["usage"]["input_tokens"] == projected > 5000 and events(answer.text)[-1]["type"] == "message_stop"


def test_refusals_before_the_engine_take_anthropics_shape_too(tmp_path: Path, fake: FakeUpstream) -> None:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_MAX_BODY_BYTES": "2048"})
    with app_client(settings, httpx.ASGITransport(app=fake)) as small:
        answer = small.post("/v1/messages", json=body(user("x" * 4000)))
        assert answer.status_code == 413 and not fake.received
        assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "request_too_large"
        assert small.post("/v1/messages", json=body(user("hi")), headers={"X-Ctx-Incognito": "maybe"}).json()[
            "error"]["type"] == "invalid_request_error"


def test_a_follow_up_that_fails_ends_the_stream_with_an_error_event(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(sse=stream_tool_answer(("context_drop", {"handles": ["toolu_1"]}), content="Tidying.")))
    fake.enqueue(Reply(status=500, body={"error": {"message": "model crashed", "type": "server_error"}}))
    history = [user("Please free up your context, then go on."), *tool_round(0, "small"), *tool_round(1, BIG)]
    answer = client.post("/v1/messages", json=body(*history, tools=[BASH], stream=True))
    got = events(answer.text)
    kinds = [e["type"] for e in got]
    assert kinds[0] == "message_start" and "error" in kinds and kinds[-1] == "message_stop"
    error = got[kinds.index("error")]
    assert error["error"]["type"] == "api_error" and "model crashed" in error["error"]["message"]


def test_count_tokens_finds_a_credential_scoped_session(tmp_path: Path, fake: FakeUpstream) -> None:
    """Under session_scope = "credential" Claude Code's session is namespaced by its key: so is the lookup."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "131072", "CTXPROXY_SPILL_CHARS": "100000",
                                  "CTXPROXY_SESSION_SCOPE": "credential"})
    history = [user("Please free up your context, then go on."), *tool_round(0, "small"), *tool_round(1, BIG)]
    headers = {"X-Claude-Code-Session-Id": "cc-7", "x-api-key": "sk-a"}
    with app_client(settings, httpx.ASGITransport(app=fake)) as scoped:
        fake.enqueue(Reply(body=tool_answer(("context_drop", {"handles": ["toolu_1"]}))))
        fake.enqueue(Reply(body=completion("tidied")))
        scoped.post("/v1/messages", json=body(*history, tools=[BASH]), headers=headers)
        payload = {"model": "claude-test", "messages": history, "tools": [BASH]}
        assert count(scoped, payload, **headers) < 1_000 < count(scoped, payload, **(headers | {"x-api-key": "b"}))


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_the_upstream_names_is_reported_as_one(client: TestClient, fake: FakeUpstream,
                                                                stream: bool) -> None:
    """vLLM names the stop string that ended the answer (``stop_reason``); one the client asked for is Anthropic's
    ``stop_sequence``. Any other (a server's own, a stop token's id) stays ``end_turn``."""
    for matched in ("STOP", "OTHER", 7):
        if stream:
            chunks = stream_chunks("1, 2, 3", usage={"prompt_tokens": 5, "completion_tokens": 3})
            chunks[-2]["choices"][0]["stop_reason"] = matched
            fake.enqueue(Reply(sse=chunks))
        else:
            answer = completion("1, 2, 3")
            answer["choices"][0]["stop_reason"] = matched
            fake.enqueue(Reply(body=answer))
        got = client.post("/v1/messages", json=body(user("count"), stop_sequences=["STOP"], stream=stream))
        said = next(e for e in events(got.text) if e["type"] == "message_delta")["delta"] if stream else got.json()
        expected = ("stop_sequence", "STOP") if matched == "STOP" else ("end_turn", None)
        assert (said["stop_reason"], said["stop_sequence"]) == expected
