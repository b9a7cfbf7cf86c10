"""``POST /v1/messages`` with ``anthropic_upstream = "native"``: the upstream speaks Anthropic Messages itself.

What the proxy does not own reaches the upstream byte for byte (the body's fields in their order, thinking blocks
and their signatures, ``cache_control``, the query and the ``anthropic-*`` headers); what the upstream answers
reaches the agent with its own blocks, signatures, usage and stop reason, buffered and streamed; the context
tools run inside the proxy, and a stubbed result keeps its ``cache_control``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from fastapi.testclient import TestClient

from ctxproxy.config import load_settings
from tests.conftest import app_client
from tests.fakes import FakeUpstream, Reply

BIG = "SECRET_TOKEN=needle-4471\n" + "".join(f"line {i}: some output of the tool\n" for i in range(1500))
BASH = {"name": "Bash", "description": "Run a command", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14,context-1m",
           "x-api-key": "sk-ant-test"}
USAGE = {"input_tokens": 12, "cache_read_input_tokens": 3000, "cache_creation_input_tokens": 40, "output_tokens": 9}


@pytest.fixture
def client(tmp_path: Path, fake: FakeUpstream) -> Iterator[TestClient]:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "131072", "CTXPROXY_SPILL_CHARS": "100000",
                                  "CTXPROXY_ANTHROPIC_UPSTREAM": "native"})
    with app_client(settings, httpx.ASGITransport(app=fake)) as test_client:
        yield test_client


def claude_code_body(*extra: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """The shape Claude Code sends: system blocks with cache_control, thinking, context_management, metadata,
    thinking blocks with signatures, tool results with cache_control."""
    return {"model": "claude-test-native", "max_tokens": 32000,
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "list the files"}]},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "I should run ls.", "signature": "EqQBCkYIBxgCKkA="},
                             {"type": "text", "text": "Listing."},
                             {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "ls"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                                       "content": "a.py\nb.py",
                                                       "cache_control": {"type": "ephemeral"}}]},
                         *extra],
            "tools": [BASH], "thinking": {"type": "enabled", "budget_tokens": 4000},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "user_abc"}, "output_config": {"effort": "high"}, **fields}


def answer(*blocks: dict[str, Any], stop: str = "end_turn") -> dict[str, Any]:
    return {"id": "msg_01XYZ", "type": "message", "role": "assistant", "model": "claude-test-native",
            "content": list(blocks), "stop_reason": stop, "stop_sequence": None, "usage": USAGE}


THINKING = {"type": "thinking", "thinking": "Two files.", "signature": "Sig+/=="}


def sse(message: dict[str, Any]) -> list[bytes]:
    """An Anthropic event stream of ``message``: each block started, its pieces, stopped."""
    def ev(name: str, **data: Any) -> bytes:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()

    start = {**message, "content": [], "stop_reason": None, "usage": {**USAGE, "output_tokens": 1}}
    out = [ev("message_start", message=start), ev("ping")]
    for i, block in enumerate(message["content"]):
        kind = block["type"]
        empty = {"thinking": {**block, "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""},
                 "tool_use": {**block, "input": {}}}[kind]
        out.append(ev("content_block_start", index=i, content_block=empty))
        if kind == "thinking":
            out += [ev("content_block_delta", index=i, delta={"type": "thinking_delta", "thinking": block["thinking"]}),
                    ev("content_block_delta", index=i, delta={"type": "signature_delta",
                                                              "signature": block["signature"]})]
        elif kind == "text":
            out += [ev("content_block_delta", index=i, delta={"type": "text_delta", "text": word})
                    for word in re.split(r"(?<= )", block["text"])]
        else:
            text = json.dumps(block["input"])
            out += [ev("content_block_delta", index=i,
                       delta={"type": "input_json_delta", "partial_json": text[k:k + 5]})
                    for k in range(0, len(text), 5)]
        out.append(ev("content_block_stop", index=i))
    out += [ev("message_delta", delta={"stop_reason": message["stop_reason"], "stop_sequence": None},
               usage={"output_tokens": 9}), ev("message_stop")]
    return out


def test_what_the_proxy_does_not_own_goes_upstream_byte_for_byte(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=answer(THINKING, {"type": "text", "text": "a.py and b.py"})), path="/messages")
    sent = orjson.dumps(claude_code_body())
    got = client.post("/v1/messages?beta=true", content=sent, headers=HEADERS)
    assert got.status_code == 200, got.text
    upstream = fake.last
    assert upstream.path == "/v1/messages" and upstream.query == "beta=true" and not fake.chats
    assert upstream.body == sent
    assert {k: upstream.headers[k] for k in HEADERS} == HEADERS
    assert got.json() == answer(THINKING, {"type": "text", "text": "a.py and b.py"})


def test_a_native_stream_reaches_the_agent_with_its_signatures_and_usage(client: TestClient,
                                                                           fake: FakeUpstream) -> None:
    message = answer(THINKING, {"type": "text", "text": "Running it now"},
                     {"type": "tool_use", "id": "toolu_02", "name": "Bash", "input": {"command": "wc -l a.py"}},
                     stop="tool_use")
    fake.enqueue(Reply(sse=sse(message)), path="/messages")
    sdk = anthropic.Anthropic(base_url=str(client.base_url), api_key="sk-ant-test", http_client=client,
                              max_retries=0)
    body = claude_code_body()
    with sdk.messages.stream(**{k: v for k, v in body.items() if k not in ("context_management", "output_config")},
                             extra_body={"context_management": body["context_management"],
                                         "output_config": body["output_config"]}) as stream:
        final = stream.get_final_message()
    assert json.loads(fake.last.body)["stream"] is True
    assert final.model_dump(exclude_none=True)["content"] == message["content"]
    assert final.stop_reason == "tool_use" and final.usage.cache_read_input_tokens == 3000
    assert final.usage.input_tokens == 12 and final.usage.output_tokens == 9


def test_the_context_tools_run_inside_the_proxy_and_keep_the_cache_breakpoints(
        client: TestClient, fake: FakeUpstream) -> None:
    asked = [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_02", "name": "Bash",
                                                "input": {"command": "cat big.log"}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_02", "content": BIG,
                  "cache_control": {"type": "ephemeral"}},
                 {"type": "text", "text": "Please free up your context, then go on."}]}]
    drop = {"type": "tool_use", "id": "toolu_ctx", "name": "context_drop", "input": {"handles": ["toolu_02"]}}
    fake.enqueue(Reply(body=answer(THINKING, drop, stop="tool_use")), path="/messages")
    fake.enqueue(Reply(body=answer({"type": "text", "text": "Freed."})), path="/messages")
    got = client.post("/v1/messages", json=claude_code_body(*asked), headers=HEADERS)
    assert got.json()["content"] == [{"type": "text", "text": "Freed."}]
    first, follow_up = (json.loads(r.body) for r in fake.received if r.path == "/v1/messages")
    assert [t["name"] for t in first["tools"]][:1] == ["Bash"] and "context_drop" in [t["name"] for t in
                                                                                      first["tools"]]
    assert first["tools"][1]["input_schema"]["type"] == "object" and first["thinking"]
    stubbed = follow_up["messages"][4]["content"][0]
    assert stubbed["content"].startswith("[overflow id=") and stubbed["cache_control"] == {"type": "ephemeral"}
    assert follow_up["messages"][:2] == first["messages"][:2] == claude_code_body()["messages"][:2]
    assert follow_up["messages"][-2]["content"][-1]["name"] == "context_drop"
    assert follow_up["messages"][-1]["content"][0]["tool_use_id"] == "toolu_ctx"
    assert "thinking" not in follow_up  # the spliced round has no thinking block before its tool_use
    assert first["context_management"] == claude_code_body()["context_management"]
    assert "context_management" not in follow_up  # its clear_thinking edit, refused without thinking (a 400)


def test_an_upstream_error_keeps_its_status_and_message(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(status=529, body={"type": "error", "error": {"type": "overloaded_error",
                                                                    "message": "Overloaded"}}), path="/messages")
    got = client.post("/v1/messages", json=claude_code_body())
    assert got.status_code == 529
    assert got.json() == {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}


def test_an_upstream_error_mid_stream_keeps_its_type(client: TestClient, fake: FakeUpstream) -> None:
    """Claude Code retries an ``overloaded_error`` its own way: the event once said ``api_error`` whatever came."""
    started = sse(answer({"type": "text", "text": "Hel"}))[:4]  # message_start, ping, the block started, one delta
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    failed = b"event: error\ndata: " + json.dumps(overloaded).encode() + b"\n\n"
    fake.enqueue(Reply(sse=[*started, failed]), path="/messages")
    got = client.post("/v1/messages", json=claude_code_body(stream=True))
    errors = [json.loads(line[6:]) for line in got.text.splitlines() if line.startswith("data: {\"type\":\"error")]
    assert errors == [overloaded]


def test_anthropic_usage_calibrates_the_budget(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=answer({"type": "text", "text": "ok"})), path="/messages")
    got = client.post("/v1/messages", json=claude_code_body(), headers={"X-Claude-Code-Session-Id": "s1"})
    assert got.status_code == 200
    session = client.get(f"/ctx/sessions/{got.headers['x-ctx-session']}").json()
    assert session["last_prompt_tokens"] == 12 + 3000 + 40  # fresh, read from and written to the cache


def test_a_streamed_context_call_is_taken_out_and_the_agent_sees_one_message(
        client: TestClient, fake: FakeUpstream) -> None:
    asked = [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_02", "name": "Bash",
                                                "input": {"command": "cat big.log"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_02", "content": BIG},
                                          {"type": "text", "text": "Please free up your context, then go on."}]}]
    drop = {"type": "tool_use", "id": "toolu_ctx", "name": "context_drop", "input": {"handles": ["toolu_02"]}}
    fake.enqueue(Reply(sse=sse(answer(THINKING, {"type": "text", "text": "Tidying first."}, drop,
                                      stop="tool_use"))), path="/messages")
    fake.enqueue(Reply(sse=sse(answer({"type": "text", "text": "Freed."}))), path="/messages")
    got = client.post("/v1/messages", json=claude_code_body(*asked, stream=True))
    events = [json.loads(line[5:]) for line in got.text.splitlines() if line.startswith("data:")]
    names = [e["type"] for e in events]
    assert names.count("message_start") == 1 and names.count("message_stop") == 1 and names[-1] == "message_stop"
    blocks = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert blocks == ["thinking", "text"] and "context_drop" not in got.text.split(": context_op")[0]
    signature = [e["delta"]["signature"] for e in events
                 if e["type"] == "content_block_delta" and e["delta"]["type"] == "signature_delta"]
    assert signature == ["Sig+/=="]
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == "Tidying first.Freed."
    assert events[-2]["delta"]["stop_reason"] == "end_turn"
