"""``POST /v1/responses`` in native mode: the upstream speaks the Responses API itself (a scripted fake of one)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from ctxproxy.config import load_settings
from ctxproxy.proxy.edge.fronts.responses.native import ChatFromResponses, ResponsesUpstream, chat_completion
from ctxproxy.proxy.upstream.sse import sse_lines
from tests.conftest import app_client
from tests.fakes import FakeUpstream, Reply

REASONING = {"type": "reasoning", "id": "rs_up", "summary": [], "encrypted_content": "c2VhbGVk/+=="}
HISTORY = [
    {"type": "message", "id": "msg_dev", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "b3BhcXVl"},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command",
     "arguments": "{\"cmd\":\"ls\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
]
TOOLS = [{"type": "function", "name": "exec_command", "strict": False, "parameters": {"type": "object"}},
         {"type": "web_search", "external_web_access": False}]
USAGE = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 8}, "output_tokens": 3,
         "output_tokens_details": {"reasoning_tokens": 1}, "total_tokens": 43}


def upstream_response(*output: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"id": "resp_up", "object": "response", "status": status, "model": "gpt-up", "output": list(output),
            "usage": USAGE}


def said(text: str) -> dict[str, Any]:
    return {"type": "message", "id": "msg_up", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def upstream_events(text: str, *before: dict[str, Any]) -> list[Any]:
    """A Responses stream as an OpenAI endpoint sends it (named events), ``before`` items first."""
    events: list[dict[str, Any]] = [{"type": "response.created", "response": upstream_response(status="in_progress")}]
    for i, item in enumerate(before):
        events += [{"type": "response.output_item.added", "output_index": i, "item": item},
                   {"type": "response.output_item.done", "output_index": i, "item": item}]
    events += [{"type": "response.output_text.delta", "item_id": "msg_up", "delta": word + " "}
               for word in text.split()]
    events.append({"type": "response.completed", "response": upstream_response(*before, said(text))})
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events]


def events_of(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in sse_lines(text) if line.startswith("data: ")]


@pytest.fixture
def native(tmp_path: Path, fake: FakeUpstream) -> Iterator[TestClient]:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "131072", "CTXPROXY_RESPONSES_UPSTREAM": "native"})
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        yield client


def forwarded(fake: FakeUpstream) -> list[dict[str, Any]]:
    return [r.json() for r in fake.received if r.path.endswith("/responses")]


def test_native_forwards_the_clients_items_and_fields_as_they_came(native: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=upstream_response(REASONING, said("Two files."))), path="/responses")
    body = {"model": "gpt-up", "instructions": "Be terse.", "input": HISTORY, "tools": TOOLS, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k1", "reasoning": {"summary": "auto"}}
    got = native.post("/v1/responses", json=body)
    assert got.status_code == 200, got.text
    [sent] = forwarded(fake)
    assert sent["input"] == HISTORY  # the reasoning item's encrypted_content included, byte for byte
    assert sent["tools"] == TOOLS and sent["instructions"] == "Be terse." and sent["stream"] is False
    assert {k: sent[k] for k in ("include", "prompt_cache_key", "reasoning", "store")} == {
        k: body[k] for k in ("include", "prompt_cache_key", "reasoning", "store")}
    answer = got.json()
    assert answer["output"][0] == REASONING and answer["output"][1]["content"][0]["text"] == "Two files."
    assert answer["usage"]["input_tokens"] == 40 and answer["usage"]["input_tokens_details"]["cached_tokens"] == 8
    assert answer["usage"]["output_tokens_details"] == {"reasoning_tokens": 1}  # once always 0


def test_items_chat_has_no_word_for_reach_the_upstream_when_they_come_last(
        native: TestClient, fake: FakeUpstream) -> None:
    """Codex's freeform ``apply_patch`` call and its output end the input: they waited for a message to ride with,
    none came, and the model never saw that it had patched."""
    patched = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix the bug"}]},
               {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_p", "name": "apply_patch",
                "input": "*** Begin Patch\n*** End Patch"},
               {"type": "custom_tool_call_output", "call_id": "call_p", "output": "Success. Updated a.py"}]
    fake.enqueue(Reply(body=upstream_response(said("Patched."))), path="/responses")
    got = native.post("/v1/responses", json={"model": "gpt-up", "input": patched, "store": False, "tools": [
        {"type": "custom", "name": "apply_patch", "description": "patch", "format": {"type": "text"}}]})
    assert got.status_code == 200, got.text
    assert [sent["input"] for sent in forwarded(fake)] == [patched]


@pytest.mark.parametrize("stream", [False, True])
def test_a_native_refusal_reaches_the_client_as_a_refusal_part(native: TestClient, fake: FakeUpstream,
                                                                stream: bool) -> None:
    """The message item was rebuilt from its text parts alone: a refusal left the client an empty output."""
    refused = {"type": "message", "id": "msg_up", "role": "assistant", "status": "completed",
               "content": [{"type": "refusal", "refusal": "I can't help with that."}]}
    if stream:
        events = [{"type": "response.refusal.delta", "item_id": "msg_up", "delta": d} for d in ("I can't ",
                                                                                                "help with that.")]
        events.append({"type": "response.completed", "response": upstream_response(refused)})
        fake.enqueue(Reply(sse=[f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events]),
                     path="/responses")
    else:
        fake.enqueue(Reply(body=upstream_response(refused)), path="/responses")
    got = native.post("/v1/responses", json={"model": "gpt-up", "input": "do it", "stream": stream})
    output = events_of(got.text)[-1]["response"]["output"] if stream else got.json()["output"]
    assert [item["content"] for item in output] == [refused["content"]]


def test_native_streams_the_upstreams_items_back(native: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(sse=upstream_events("All done here", REASONING)), path="/responses")
    got = native.post("/v1/responses", json={"model": "gpt-up", "input": HISTORY, "tools": TOOLS, "stream": True})
    events = events_of(got.text)
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    final = events[-1]["response"]
    assert final["output"][0] == REASONING
    assert final["output"][1]["content"][0]["text"] == "All done here "
    assert final["usage"]["input_tokens"] == 40 and forwarded(fake)[0]["stream"] is True


def test_native_runs_a_context_round_and_sends_it_as_items(native: TestClient, fake: FakeUpstream) -> None:
    drop = {"type": "function_call", "id": "fc_d", "call_id": "call_d", "name": "context_drop",
            "arguments": json.dumps({"handles": ["call_1"]})}
    fake.enqueue(Reply(body=upstream_response(drop)), path="/responses")
    fake.enqueue(Reply(body=upstream_response(said("Dropped."))), path="/responses")
    got = native.post("/v1/responses", json={"model": "gpt-up", "input": HISTORY, "tools": TOOLS})
    assert [i["type"] for i in got.json()["output"]] == ["message"]
    first, second = forwarded(fake)
    assert first["input"] == HISTORY and second["input"][:2] == HISTORY[:2]  # untouched: the client's items
    kinds = [(i["type"], i.get("name") or i.get("call_id")) for i in second["input"][len(HISTORY) - 1:]]
    assert ("function_call", "context_drop") in kinds and ("function_call_output", "call_d") in kinds
    assert second["tools"] == TOOLS and "previous_response_id" not in second


def test_a_forward_adds_the_proxys_tools_and_encodes_changed_messages_afresh() -> None:
    upstream = ResponsesUpstream({"model": "m", "input": HISTORY, "tools": TOOLS, "previous_response_id": "r"},
                                 HISTORY, "")
    messages = [{"role": "system", "content": "rules"}, {"role": "user", "content": "list files"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "exec_command",
                                                                      "arguments": "{\"cmd\":\"ls\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "[overflow id=abc] a stub"}]
    tools = [{"type": "function", "function": {"name": "exec_command"}},
             {"type": "function", "function": {"name": "read_overflow", "parameters": {"type": "object"}}}]
    sent = json.loads(upstream.request(json.dumps({"messages": messages, "tools": tools, "max_tokens": 1,
                                                   "stream": False}).encode()))
    assert sent["input"][:4] == HISTORY[:4]  # unchanged: as the client sent them, reasoning item included
    assert sent["input"][4] == {"type": "function_call_output", "call_id": "call_1",
                                "output": "[overflow id=abc] a stub"}
    assert sent["tools"] == [*TOOLS, {"type": "function", "name": "read_overflow", "parameters": {"type": "object"}}]
    assert sent["max_output_tokens"] == 16 and "previous_response_id" not in sent


def test_a_responses_stream_reads_as_chat_chunks() -> None:
    call = {"type": "function_call", "id": "fc_9", "call_id": "call_9", "name": "spawn", "namespace": "agents",
            "arguments": ""}
    events = [{"type": "response.output_item.added", "item": call},
              {"type": "response.function_call_arguments.delta", "item_id": "fc_9", "delta": "{}"},
              {"type": "response.completed", "response": upstream_response(call)}]
    raw = b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)
    translator = ChatFromResponses({"agents"})
    out = b"".join(translator.feed(raw[i:i + 9]) for i in range(0, len(raw), 9)).decode()
    chunks = [json.loads(line[6:]) for line in sse_lines(out) if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "agents__spawn"
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls" and chunks[-1]["usage"]["prompt_tokens"] == 40
    assert out.endswith("data: [DONE]\n\n")


def test_an_incomplete_response_reads_as_a_length_finish() -> None:
    response = upstream_response(said("cut"), status="incomplete") | {
        "incomplete_details": {"reason": "max_output_tokens"}}
    assert chat_completion(response)["choices"][0]["finish_reason"] == "length"
