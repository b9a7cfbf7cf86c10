"""The stream filter on its own: what reaches the agent of a streamed answer, however the upstream slices it."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from ctxproxy.proxy.upstream.streaming import StreamFilter
from tests.fakes import stream_tool_answer


def sse(chunks: list[Any], newline: bytes = b"\n") -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + newline * 2 for c in chunks) + b"data: [DONE]" + newline * 2


def run(data: bytes, cuts: list[int], agent_tools: frozenset[str] = frozenset({"read_file"}),
        blocks: bool = False) -> tuple[StreamFilter, list[Any]]:
    filtered, out = StreamFilter(agent_tools, blocks), []
    edges = sorted({0, len(data), *[c % (len(data) + 1) for c in cuts]})
    for a, b in itertools.pairwise(edges):
        out += list(filtered.feed(data[a:b]))
    out += list(filtered.flush())
    events = [json.loads(e[6:]) for e in b"".join(out).split(b"\n\n") if e.startswith(b"data: {")]
    return filtered, events


def agent_calls(events: list[Any]) -> list[Any]:
    return [c for e in events for ch in e.get("choices", []) for c in ch.get("delta", {}).get("tool_calls") or []]


@example(cuts=[598], crlf=True)  # a CRLF cut between two chunks once made a blank line of it
@given(st.lists(st.integers(0, 5000), max_size=12), st.booleans())
def test_any_slicing_and_either_line_ending_gives_the_same_result(cuts: list[int], crlf: bool) -> None:
    data = sse(stream_tool_answer(("context_drop", {"handles": ["c1"]}), ("read_file", {"path": "a.py"}),
                                  content="some text"), b"\r\n" if crlf else b"\n")
    filtered, events = run(data, cuts)
    calls = agent_calls(events)
    assert {c["index"] for c in calls} == {0} and calls[0]["function"]["name"] == "read_file"
    assert "".join(c["function"].get("arguments", "") for c in calls) == '{"path": "a.py"}'
    assert [c["function"]["name"] for c in filtered.context_calls] == ["context_drop"]
    assert json.loads(filtered.context_calls[0]["function"]["arguments"]) == {"handles": ["c1"]}
    assert filtered.text == "some text " and filtered.finish is not None


def test_a_name_sent_in_pieces_is_judged_whole() -> None:
    base = {"object": "chat.completion.chunk"}
    pieces = [{"index": 0, "id": "x", "function": {"name": "context_", "arguments": ""}},
              {"index": 0, "function": {"name": "drop"}}, {"index": 0, "function": {"arguments": "{}"}}]
    chunks = [base | {"choices": [{"index": 0, "delta": {"tool_calls": [p]}}]} for p in pieces]
    filtered, events = run(sse(chunks), [])
    assert agent_calls(events) == [] and filtered.context_calls[0]["function"]["name"] == "context_drop"


def test_an_agent_tool_whose_name_starts_like_ours_stays_the_agents() -> None:
    chunks = stream_tool_answer(("context_status_v2", {"x": 1}))
    filtered, events = run(sse(chunks), [], agent_tools=frozenset({"context_status_v2"}))
    assert [c["function"]["name"] for c in agent_calls(events) if "name" in c["function"]] == ["context_status_v2"]
    assert filtered.context_calls == []


@given(st.lists(st.integers(1, 120), min_size=1, max_size=30))
def test_a_context_block_in_streamed_text_never_reaches_the_agent(sizes: list[int]) -> None:
    said = ('Tidying first.\n```context\n{"tool": "context_drop", "handles": ["r2.1"]}\n```\n'
            "Now the fix.\n```bash\nls\n```")
    pieces, at = [], 0
    for size in sizes * 10:
        if at >= len(said):
            break
        pieces.append(said[at:at + size])
        at += size
    if at < len(said):
        pieces.append(said[at:])
    base = {"object": "chat.completion.chunk"}
    chunks = [base | {"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
    chunks.append(base | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    filtered, events = run(sse(chunks), [], agent_tools=frozenset(), blocks=True)
    shown = "".join(c.get("delta", {}).get("content") or "" for e in events for c in e.get("choices", []))
    assert shown == "Tidying first.\nNow the fix.\n```bash\nls\n```" == filtered.forwarded
    assert [c["function"]["name"] for c in filtered.context_calls] == ["context_drop"]


def test_an_unclosed_block_never_reaches_the_agent_and_a_lookalike_fence_does() -> None:
    def shown(text: str) -> str:
        chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
        _, events = run(sse([chunk]), [], agent_tools=frozenset(), blocks=True)
        return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])

    assert shown("Cut off here ```context\n{\"tool\": \"context_dr") == "Cut off here "
    assert shown("```contextual\nsome notes\n```") == "```contextual\nsome notes\n```"


def test_a_payload_holding_a_unicode_line_break_is_read_as_one_event() -> None:
    """JSON carries U+0085 and U+2028 unescaped inside strings; ``str.splitlines`` broke such an event in two (the
    fuzz found it), so the usage after it was lost. Only CR, LF and CRLF end an SSE line."""
    from ctxproxy.proxy.upstream.sse import data_events, last_usage

    text = ('data: {"choices": [{"index": 0, "delta": {"content": "a\u0085b\u2028c"}}]}\n\n'
            'data: {"choices": [], "usage": {"prompt_tokens": 7}}\r\n\r\ndata: [DONE]\n\n')
    events = list(data_events(text))
    assert events[0]["choices"][0]["delta"]["content"] == "a\u0085b\u2028c"
    assert last_usage(text) == {"prompt_tokens": 7}
