"""One driver for both paths (``proxy.engine.driver``): the same scripted context-tool rounds, buffered and
streamed, send the same upstream requests and journal the same rows; only the way the answer travels differs."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx

from ctxproxy.config import load_settings
from tests.conftest import app_client
from tests.fakes import FakeUpstream, Reply, completion, stream_chunks, stream_tool_answer, tool_answer

AGENT_TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
ROUNDS = [("context_drop", {"handles": ["call_1"]}), ("context_status", {})]


def history() -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                  {"role": "user", "content": "Please free up your context, then go on."}]
    for k in range(3):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{k}", "content": f"result {k} " * 400})
    return msgs


def run(tmp_path: Path, stream: bool) -> tuple[list[dict[str, Any]], list[Any], list[Any], httpx.Response]:
    fake = FakeUpstream()
    for call in ROUNDS:
        fake.enqueue(Reply(sse=stream_tool_answer(call)) if stream else Reply(body=tool_answer(call)))
    fake.enqueue(Reply(sse=stream_chunks("All done.")) if stream else Reply(body=completion("All done.")))
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "131072", "CTXPROXY_SPILL_CHARS": "100000"})
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        answer = client.post("/v1/chat/completions", json={
            "model": "m", "tools": AGENT_TOOLS, "messages": history(), "stream": stream})
    db = sqlite3.connect(tmp_path / "journal.db")
    responses = db.execute("SELECT attempt, outcome, status FROM responses ORDER BY id").fetchall()
    ops = db.execute("SELECT op, ok, tokens_freed FROM context_ops ORDER BY id").fetchall()
    return [_comparable(r.json()) for r in fake.chats], responses, ops, answer


def _comparable(body: dict[str, Any]) -> dict[str, Any]:
    """An upstream request without what only says how the answer travels: ``stream``, and the text the model
    said before its calls (a stream carries ``null`` as no text, a buffered answer ``""``, as ever)."""
    messages = [{**m, "content": m["content"] or None} if m.get("tool_calls") and m["role"] == "assistant" else m
                for m in body["messages"]]
    return {k: v for k, v in body.items() if k != "stream"} | {"messages": messages}


def test_buffered_and_streamed_rounds_send_and_journal_the_same(tmp_path: Path) -> None:
    buffered = run(tmp_path / "buffered", stream=False)
    streamed = run(tmp_path / "streamed", stream=True)
    assert buffered[0] == streamed[0] and len(buffered[0]) == 3, "the same upstream requests, in order"
    assert buffered[1] == streamed[1] == [(0, "context_round", 200), (1, "context_round", 200), (2, "ok", 200)]
    assert buffered[2] == streamed[2] and [op for op, _, _ in buffered[2]] == ["drop", "status"]
    assert buffered[3].headers["x-ctx-internal-rounds"] == "2"
    assert buffered[3].json()["choices"][0]["message"]["content"] == "All done."
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in streamed[3].text.splitlines() if line.startswith("data: {"))
    assert text == "All done. " and "total_prompt_tokens" in streamed[3].text
