"""The Responses codec, pure: requests decoded into chat bodies, chat answers (whole and streamed) encoded back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from ctxproxy.proxy.edge.fronts.responses.decode import decode_request, input_items, namespaced
from ctxproxy.proxy.edge.fronts.responses.encode import Frame, encode_completion
from ctxproxy.proxy.edge.fronts.responses.events import StreamEncoder
from ctxproxy.proxy.errors import BadRequest
from ctxproxy.proxy.upstream.sse import sse_lines
from tests.fakes import completion, stream_chunks, stream_tool_answer, tool_answer


def decoded(**body: Any) -> dict[str, Any]:
    return decode_request(body, input_items(body))


def events_of(stream: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in sse_lines(stream.decode()) if line.startswith("data: ")]


def sse(chunks: list[Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_a_string_input_with_instructions_is_a_system_and_a_user_message() -> None:
    chat = decoded(model="m", input="hi", instructions="Be terse.", max_output_tokens=50, stream=True)
    assert chat == {"model": "m", "stream": True, "max_tokens": 50, "stream_options": {"include_usage": True},
                    "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]}


def test_codex_items_become_chat_messages_with_calls_and_results() -> None:
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque=="},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": "{\"cmd\":\"ls\"}"},
        {"type": "function_call", "call_id": "call_2", "name": "spawn", "namespace": "agents", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "ok"}]},
    ]
    chat = decoded(model="m", input=items, tool_choice="auto", parallel_tool_calls=True, store=False,
                   include=["reasoning.encrypted_content"], prompt_cache_key="k", client_metadata={"a": "b"})
    assert chat["messages"] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "exec_command", "arguments": "{\"cmd\":\"ls\"}"}},
            {"id": "call_2", "type": "function", "function": {"name": "agents__spawn", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "call_2", "content": "ok"},
    ]
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is True
    assert not {"store", "include", "prompt_cache_key", "client_metadata"} & chat.keys()


def test_reasoning_text_rides_on_the_next_assistant_message() -> None:
    items = [{"type": "message", "role": "user", "content": "q"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    assert decoded(input=items)["messages"][1] == {
        "role": "assistant", "content": None, "reasoning_content": "think",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_reasoning_between_an_answers_text_and_its_call_stays_with_that_answer() -> None:
    """The order this front streams after a context-tool round: reasoning, text, reasoning, the agent's call. The
    second reasoning once waited for the next assistant message, the turn's final answer, and rode on it."""
    think = [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": t}]}
             for t in ("R1", "R2", "R3")]
    items = [{"type": "message", "role": "user", "content": "q"}, think[0],
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "looking"}]},
             think[1], {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c", "output": "two files"}, think[2],
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]
    messages = decoded(input=items)["messages"]
    assert [(m["role"], m.get("reasoning_content")) for m in messages] == [
        ("user", None), ("assistant", "R1\n\nR2"), ("tool", None), ("assistant", "R3")]


def test_images_and_several_text_parts_stay_parts() -> None:
    content = [{"type": "input_text", "text": "what is"}, {"type": "input_text", "text": " this"},
               {"type": "input_image", "image_url": "data:image/png;base64,AAA", "detail": "low"}]
    message = decoded(input=[{"role": "user", "content": content}])["messages"][0]
    assert message["content"] == [{"type": "text", "text": "what is"}, {"type": "text", "text": " this"},
                                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA",
                                                                      "detail": "low"}}]


def test_function_and_namespace_tools_are_mapped_and_flattened() -> None:
    tools = [{"type": "function", "name": "exec_command", "description": "run", "strict": False,
              "parameters": {"type": "object"}},
             {"type": "namespace", "name": "agents", "description": "subagents",
              "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}]}]
    chat = decoded(input="x", tools=tools, tool_choice={"type": "function", "name": "exec_command"})
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "exec_command", "description": "run", "strict": False,
                                          "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "agents__spawn", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "exec_command"}}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "tools": [{"type": "web_search", "external_web_access": False}]}, "tools[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": 3}, "input"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
])
def test_what_a_chat_upstream_cannot_take_is_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        decoded(**body)
    assert refused.value.param == param


def test_the_web_search_refusal_says_how_to_turn_it_off_in_codex() -> None:
    with pytest.raises(BadRequest, match="web_search=disabled"):
        decoded(input="x", tools=[{"type": "web_search"}])


def test_a_json_schema_format_becomes_a_response_format() -> None:
    chat = decoded(input="x", text={"format": {"type": "json_schema", "name": "n", "schema": {}, "strict": True}},
                   reasoning={"effort": "low", "summary": "auto"})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "n", "schema": {},
                                                                              "strict": True}}
    assert chat["reasoning_effort"] == "low"


def test_a_completion_becomes_a_response_with_usage() -> None:
    frame = Frame.of({"model": "fake-model", "instructions": "Be terse.", "store": False})
    response = encode_completion(frame, completion("hello there", prompt_tokens=12))
    assert response["object"] == "response" and response["status"] == "completed"
    assert response["output"] == [{"id": frame.item_id("msg", 0), "type": "message", "role": "assistant",
                                   "status": "completed",
                                   "content": [{"type": "output_text", "text": "hello there", "annotations": []}]}]
    assert response["usage"]["input_tokens"] == 12 and response["usage"]["output_tokens"] == 2
    assert response["instructions"] == "Be terse." and response["store"] is False


def test_tool_calls_become_function_call_items_and_namespaces_split_back() -> None:
    frame = Frame.of({"model": "m", "tools": [{"type": "namespace", "name": "agents", "tools": []}]})
    answer = tool_answer(("exec_command", {"cmd": "ls"}), ("agents__spawn", {}), content="Let me look.")
    output = encode_completion(frame, answer)["output"]
    assert [item["type"] for item in output] == ["message", "function_call", "function_call"]
    assert output[1] | {"id": ""} == {"id": "", "type": "function_call", "status": "completed",
                                      "call_id": "ctx_0_exec_command", "name": "exec_command",
                                      "arguments": "{\"cmd\": \"ls\"}"}
    assert (output[2]["namespace"], output[2]["name"]) == ("agents", "spawn")


def test_a_namespace_with_the_separator_in_its_name_is_split_at_its_own_end() -> None:
    """Codex names its MCP servers' namespaces ``mcp__<server>``: split at the first ``__``, a call to one named a
    namespace no tool list had, and Codex could not route it."""
    offered = [{"type": "namespace", "name": n, "tools": []} for n in ("mcp__probe", "mcp__probe__deep", "mcp")]
    frame = Frame.of({"model": "m", "tools": offered})
    names = ("mcp__probe__echo", "mcp__probe__deep__echo", "mcp__other", "mcp__", "unknown__x")
    output = encode_completion(frame, tool_answer(*[(n, {}) for n in names]))["output"]
    assert [(item.get("namespace"), item["name"]) for item in output] == [
        ("mcp__probe", "echo"), ("mcp__probe__deep", "echo"), ("mcp", "other"), (None, "mcp__"), (None, "unknown__x")]
    assert [namespaced(n, {"mcp__probe"}) for n in ("mcp__probe__a__b", "mcp__probe")] == [("mcp__probe", "a__b"), None]


def test_a_length_finish_makes_the_response_incomplete() -> None:
    answer = completion("cut")
    answer["choices"][0]["finish_reason"] = "length"
    response = encode_completion(Frame.of({"model": "m"}), answer)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_text_stream_becomes_the_responses_events_in_order() -> None:
    encoder = StreamEncoder(Frame.of({"model": "m"}))
    usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    events = events_of(encoder.feed(sse(stream_chunks("hello there", usage=usage))) + encoder.close())
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[6]["text"] == "hello there "
    completed = events[-1]["response"]
    assert completed["output"][0]["content"][0]["text"] == "hello there "
    assert completed["usage"]["input_tokens"] == 7 and completed["status"] == "completed"


def test_a_refusal_is_a_refusal_part_whole_and_streamed_alike() -> None:
    """Chat's ``message.refusal`` (``delta.refusal`` streamed) was dropped: the client got an empty output."""
    frame = Frame.of({"model": "m"})
    answer = completion("")
    answer["choices"][0]["message"] |= {"content": None, "refusal": "I can't help with that."}
    whole = encode_completion(frame, answer)["output"]
    assert [item["content"] for item in whole] == [[{"type": "refusal", "refusal": "I can't help with that."}]]
    encoder = StreamEncoder(frame)
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "refusal": part}}]} for part in
              ("I can't ", "help with that.")] + [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    events = events_of(encoder.feed(sse(chunks)) + encoder.close())
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.content_part.added", "response.refusal.delta",
        "response.refusal.delta", "response.refusal.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert events[3]["part"] == {"type": "refusal", "refusal": ""} and events[6]["refusal"] == "I can't help with that."
    assert events[-1]["response"]["output"] == whole


def test_a_streamed_tool_call_becomes_function_call_events() -> None:
    encoder = StreamEncoder(Frame.of({"model": "m"}))
    chunks = stream_tool_answer(("exec_command", {"cmd": "ls -la /tmp"}), content="Looking now")
    events = events_of(encoder.feed(sse(chunks)) + encoder.close())
    kinds = [e["type"] for e in events]
    assert kinds.count("response.function_call_arguments.delta") > 1
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert json.loads(done["arguments"]) == {"cmd": "ls -la /tmp"} and done["name"] == "exec_command"
    output = events[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert output[1]["call_id"] == "ctx_0_exec_command"


def test_comments_pass_and_an_error_event_fails_the_response() -> None:
    encoder = StreamEncoder(Frame.of({"model": "m"}))
    chunks = stream_chunks("partial")[:2]
    error = {"error": {"message": "the follow-up failed", "type": "server_error", "param": None, "code": "x"}}
    out = encoder.feed(sse(chunks)[:-len(b"data: [DONE]\n\n")] + b": context_op {}\n\n")
    out += encoder.feed(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n") + encoder.close()
    assert b": context_op {}\n" in out
    kinds = [e["type"] for e in events_of(out)]
    assert kinds[-2:] == ["error", "response.failed"] and kinds.count("response.failed") == 1


def test_a_stream_that_ends_without_done_fails_the_response() -> None:
    encoder = StreamEncoder(Frame.of({"model": "m"}))
    out = encoder.feed(sse(stream_chunks("half"))[:-len(b"data: [DONE]\n\n")]) + encoder.close()
    assert events_of(out)[-1]["type"] == "response.failed"


words = st.lists(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8), max_size=6)


@given(words, st.integers(1, 40))
@example(["\x85"], 1)  # U+0085 inside JSON: SSE breaks lines on CR and LF only
def test_a_stream_split_anywhere_encodes_to_what_the_whole_completion_does(parts: list[str], cut: int) -> None:
    """Property: however the chat stream's bytes are split, the closing response's output equals the one
    ``encode_completion`` gives for the same answer whole."""
    text = " ".join(parts)
    frame = Frame.of({"model": "m"})
    raw = sse(stream_chunks(text))
    encoder = StreamEncoder(frame)
    out = b"".join(encoder.feed(raw[i:i + cut]) for i in range(0, len(raw), cut)) + encoder.close()
    streamed = events_of(out)[-1]["response"]
    whole = encode_completion(frame, completion("".join(word + " " for word in text.split(" "))))
    assert streamed["output"] == whole["output"]
