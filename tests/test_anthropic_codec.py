"""The Anthropic codec alone, pure: decoding for a native upstream and encoding back is the identity for what the
proxy did not touch (byte for byte), a cut keeps its block's keys, and the stream translators give the same
events however the bytes are split."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import example, given
from hypothesis import strategies as st

from ctxproxy.proxy.edge.fronts.anthropic.chatstream import ChatFromAnthropic
from ctxproxy.proxy.edge.fronts.anthropic.native import native_body, native_chat
from ctxproxy.proxy.edge.fronts.anthropic.stream import AnthropicStream
from tests.fakes import stream_tool_answer

text = st.text(max_size=30)
cache = st.sampled_from([{}, {"cache_control": {"type": "ephemeral"}}])
text_block = st.builds(lambda t, c: {"type": "text", "text": t, **c}, text, cache)
image = st.builds(lambda d: {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": d}},
                  st.text("abcXYZ09+/=", min_size=1, max_size=12))
thinking = st.builds(lambda t, s: {"type": "thinking", "thinking": t, "signature": s}, text, text)
odd = st.fixed_dictionaries({"type": st.sampled_from(["document", "redacted_thinking", "server_tool_use"]),
                             "data": text})


@st.composite
def conversation(draw: st.DrawFn) -> dict[str, Any]:
    """A Claude Code-like body: system blocks, user turns, assistant turns with thinking and tool_use, results."""
    messages: list[Any] = [{"role": "user", "content": draw(st.one_of(text, st.lists(
        st.one_of(text_block, image, odd), min_size=1, max_size=3)))}]
    for n in range(draw(st.integers(0, 4))):
        ids = [f"toolu_{n}_{k}" for k in range(draw(st.integers(0, 2)))]
        head = draw(st.lists(st.one_of(thinking, text_block), max_size=2))
        calls = [{"type": "tool_use", "id": i, "name": "Bash", "input": {"command": draw(text)}} for i in ids]
        messages.append({"role": "assistant", "content": head + calls or [{"type": "text", "text": "ok"}]})
        results = [{"type": "tool_result", "tool_use_id": i, "content": draw(st.one_of(text, st.lists(
            text_block, min_size=1, max_size=2))), **draw(cache)} for i in ids]
        extra = draw(st.lists(text_block, max_size=1))
        messages.append({"role": "user", "content": results + extra or draw(text)})
    body = {"model": "m", "max_tokens": 100, "messages": messages, "thinking": {"type": "adaptive"},
            "metadata": {"user_id": draw(text)}}
    if draw(st.booleans()):
        body = {"system": draw(st.one_of(text, st.lists(text_block, min_size=1, max_size=2))), **body}
    return body


@given(conversation())
@example({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
def test_an_untouched_body_is_encoded_back_byte_for_byte(body: dict[str, Any]) -> None:
    chat = json.loads(orjson.dumps(native_chat(body)))  # as the engine reads and writes it
    assert orjson.dumps(native_body(chat, body)) == orjson.dumps(body)


@given(conversation(), st.data())
def test_a_cut_result_keeps_its_keys_and_nothing_else_moves(body: dict[str, Any], data: st.DataObject) -> None:
    chat = native_chat(body)
    tools = [n for n, m in enumerate(chat["messages"]) if m["role"] == "tool"]
    if not tools:
        return
    n = data.draw(st.sampled_from(tools))
    chat["messages"][n] = {**chat["messages"][n], "content": "[overflow id=abc] stub"}
    out = native_body(chat, body)
    changed = [i for i, (a, b) in enumerate(zip(out["messages"], body["messages"], strict=True)) if a != b]
    assert len(changed) == 1
    before, after = body["messages"][changed[0]]["content"], out["messages"][changed[0]]["content"]
    [cut] = [b for b in after if b.get("content") == "[overflow id=abc] stub"]
    [was] = [b for b in before if b.get("tool_use_id") == cut["tool_use_id"]]
    assert cut == {**was, "content": "[overflow id=abc] stub"}
    assert [b for b in after if b is not cut] == [b for b in before if b is not was]


def chat_stream() -> bytes:
    pieces = stream_tool_answer(("Bash", {"command": "ls -la"}), content="Looking at it",
                                usage={"prompt_tokens": 70, "completion_tokens": 9})
    return b"".join(b"data: " + orjson.dumps(p) + b"\n\n" for p in pieces) + b": context_op {}\n\ndata: [DONE]\n\n"


def fed(translator: AnthropicStream | ChatFromAnthropic, data: bytes, cuts: list[int]) -> bytes:
    out, start = b"", 0
    for cut in sorted(set(cuts)):
        out += translator.feed(data[start:cut])
        start = cut
    return out + translator.feed(data[start:]) + translator.close()


@given(st.lists(st.integers(0, len(chat_stream())), max_size=8))
def test_a_chat_stream_translates_the_same_however_it_is_split(cuts: list[int]) -> None:
    data = chat_stream()
    assert fed(AnthropicStream("m"), data, cuts) == fed(AnthropicStream("m"), data, [])


def anthropic_stream() -> bytes:
    events = [{"type": "message_start", "message": {"id": "msg_1", "model": "m", "usage": {"input_tokens": 3}}},
              {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
              {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "hm"}},
              {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "S="}},
              {"type": "content_block_stop", "index": 0}, {"type": "ping"},
              {"type": "content_block_start", "index": 1, "content_block": {"type": "redacted_thinking",
                                                                            "data": "xyz"}},
              {"type": "content_block_stop", "index": 1},
              {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}},
              {"type": "message_stop"}]
    return b"".join(b"event: " + e["type"].encode() + b"\r\ndata: " + orjson.dumps(e) + b"\r\n\r\n" for e in events)


@given(st.lists(st.integers(0, len(anthropic_stream())), max_size=8))
def test_an_anthropic_stream_reads_the_same_however_it_is_split(cuts: list[int]) -> None:
    data = anthropic_stream()
    assert fed(ChatFromAnthropic(), data, cuts) == fed(ChatFromAnthropic(), data, [])


def test_a_native_stream_round_trips_its_blocks_signatures_and_usage() -> None:
    out = fed(AnthropicStream("m"), fed(ChatFromAnthropic(), anthropic_stream(), []), [])
    events = [json.loads(line[5:]) for line in out.decode().splitlines() if line.startswith("data:")]
    assert events[0]["message"] == {"id": "msg_1", "model": "m", "usage": {"input_tokens": 3}}
    assert [e["content_block"] for e in events if e["type"] == "content_block_start"] == [
        {"type": "thinking", "thinking": "", "signature": ""}, {"type": "redacted_thinking", "data": "xyz"}]
    assert {"type": "signature_delta", "signature": "S="} in [e.get("delta") for e in events]
    assert events[-2]["usage"] == {"input_tokens": 3, "output_tokens": 2}
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


@given(conversation())
def test_the_proxys_notice_stands_alone_and_the_clients_messages_stay_whole(body: dict[str, Any]) -> None:
    """A notice joined to the client's last message would change that message for this request only: the next
    request's prompt cache would lose it."""
    chat = native_chat(body)
    chat["messages"].append({"role": "system", "content": "[ctxproxy] Applied since your last request: x"})
    out = native_body(chat, body)
    assert out["messages"][:-1] == body["messages"]
    assert out["messages"][-1] == {"role": "user", "content": [
        {"type": "text", "text": "[ctxproxy] Applied since your last request: x"}]}
