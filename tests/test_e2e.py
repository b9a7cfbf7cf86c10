"""End to end: real uvicorn servers on 127.0.0.1 — the proxy in front of a fake upstream — driven by the
official openai SDK and by the ``ctxproxy`` command itself."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ctxproxy.config import Settings, load_settings
from ctxproxy.proxy.edge.app import create_app
from ctxproxy.store import Journal
from tests.fakes import FakeUpstream, Reply, completion, serve_in_thread, stream_chunks, stream_tool_answer, tool_answer

pytestmark = pytest.mark.e2e
CTXPROXY = str(Path(sys.executable).with_name("ctxproxy"))
MESSAGES: list[Any] = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


@dataclass
class Stack:
    proxy: str
    direct: str
    fake: FakeUpstream
    settings: Settings
    clients: list[openai.OpenAI] = field(default_factory=list)

    def sdk(self, via_proxy: bool = True) -> openai.OpenAI:
        """An SDK client, closed with the stack (an unclosed one's socket warns when collected, in any test)."""
        client = openai.OpenAI(base_url=(self.proxy if via_proxy else self.direct) + "/v1", api_key="sk-test",
                               max_retries=0)
        self.clients.append(client)
        return client

    def journal(self) -> Journal:
        return Journal(self.settings.data_path / "journal.db")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    fake = FakeUpstream()
    with serve_in_thread(fake) as direct:
        settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": direct + "/v1"})
        with serve_in_thread(create_app(settings)) as proxy:
            stack = Stack(proxy, direct, fake, settings)
            yield stack
            for client in stack.clients:
                client.close()


def test_the_sdk_gets_the_same_answer_through_the_proxy(stack: Stack) -> None:
    direct = stack.sdk(via_proxy=False).chat.completions.create(model="fake-model", messages=MESSAGES)
    proxied = stack.sdk().chat.completions.create(model="fake-model", messages=MESSAGES)
    assert proxied.model_dump() == direct.model_dump()
    assert stack.fake.chats[0].body == stack.fake.chats[1].body


def test_the_sdk_gets_the_same_stream_through_the_proxy(stack: Stack) -> None:
    def collect(client: openai.OpenAI) -> list[Any]:
        stream = client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True,
                                                stream_options={"include_usage": True})
        return [chunk.model_dump() for chunk in stream]

    direct, proxied = collect(stack.sdk(via_proxy=False)), collect(stack.sdk())
    assert proxied == direct and len(proxied) > 3
    assert proxied[-1]["usage"]["prompt_tokens"] > 0


def test_the_async_sdk_with_tool_calls_and_a_named_session(stack: Stack) -> None:
    tools = [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object", "properties": {}}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "sh", "arguments": '{"cmd": "ls"}'}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "README.md"}]

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=stack.proxy + "/v1", api_key="k", max_retries=0) as client:
            return await client.chat.completions.with_raw_response.create(
                model="fake-model", messages=history, tools=tools, extra_headers={"X-Session-Id": "agent-1"},
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})

    raw = asyncio.run(run())
    assert raw.headers["x-ctx-session"] == "agent-1"
    sent = stack.fake.last_chat.json()
    assert sent["tools"] == tools and sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent["messages"] == history


def test_each_request_is_in_the_journal_and_ctxproxy_show_prints_it(stack: Stack) -> None:
    client = stack.sdk()
    first = client.chat.completions.with_raw_response.create(model="fake-model", messages=MESSAGES)
    follow = [*MESSAGES, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "Again."}]
    client.chat.completions.create(model="fake-model", messages=follow)
    session = first.headers["x-ctx-session"]
    assert [e["messages"] for e in stack.journal().session_journal(session)] == [2, 4]
    env = {**os.environ, "CTXPROXY_DATA_DIR": str(stack.settings.data_path)}
    listing = subprocess.run([CTXPROXY, "sessions"], env=env, capture_output=True, text=True, check=True).stdout
    assert session in listing
    shown = subprocess.run([CTXPROXY, "show", session], env=env, capture_output=True, text=True, check=True).stdout
    assert "fake-model" in shown and "ok" in shown
    assert len([line for line in shown.splitlines() if line.strip().startswith(("1 ", "2 "))]) == 2


def test_a_stream_is_relayed_chunk_by_chunk(stack: Stack) -> None:
    gate = threading.Event()
    stack.fake.enqueue(Reply(sse=stream_chunks("one two three"), chunk_gate=gate))
    try:
        with httpx.Client(timeout=5) as client, client.stream(
                "POST", stack.proxy + "/v1/chat/completions",
                json={"model": "fake-model", "messages": MESSAGES, "stream": True}) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert '"role": "assistant"' in first and not gate.is_set()  # arrived while upstream still holds the rest
            gate.set()
            rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and len(rest) == 5
    finally:
        gate.set()


def test_a_client_that_disconnects_mid_stream_is_journaled_and_frees_the_session(stack: Stack) -> None:
    gate = threading.Event()
    stack.fake.enqueue(Reply(sse=stream_chunks("never finished"), chunk_gate=gate))
    headers = {"X-Session-Id": "dropper"}
    body = {"model": "fake-model", "messages": MESSAGES, "stream": True}
    try:
        with httpx.Client(timeout=5) as client, client.stream(
                "POST", stack.proxy + "/v1/chat/completions", json=body, headers=headers) as response:
            next(response.iter_lines())
        # the upstream is still holding its answer: only the disconnect can have ended the exchange
        outcome = _wait_for(lambda: stack.journal().conn.execute("SELECT outcome FROM responses").fetchone())
        assert outcome[0] == "client_disconnected"
    finally:
        gate.set()
    answer = httpx.post(stack.proxy + "/v1/chat/completions", headers=headers, timeout=5,
                        json={"model": "fake-model", "messages": MESSAGES})
    assert answer.status_code == 200  # the session's lock was released


def _wait_for(probe: Any, seconds: float = 5.0) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ctxproxy_serve_runs_from_flags(tmp_path: Path, stack: Stack) -> None:
    port = _free_port()
    log = (tmp_path / "serve.log").open("wb")
    process = subprocess.Popen([CTXPROXY, "serve", "--upstream", stack.direct + "/v1", "--port", str(port),
                                "--data-dir", str(tmp_path / "d")], stdout=log, stderr=subprocess.STDOUT)
    try:
        health = _wait_for(lambda: _get(f"http://127.0.0.1:{port}/healthz"), seconds=20)
        assert health["upstream"] == stack.direct + "/v1"
        answer = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        assert answer.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content
        assert (tmp_path / "d" / "journal.db").exists()
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()


def _get(url: str) -> Any:
    try:
        return httpx.get(url, timeout=1).json()
    except httpx.TransportError:
        return None


def test_ctxproxy_serve_refuses_a_public_bind_without_a_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXPROXY_")}
    result = subprocess.run([CTXPROXY, "serve", "--host", "0.0.0.0", "--data-dir", str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "CTXPROXY_ADMIN_TOKEN" in result.stderr


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("call", [("context_status", {}), ("context_pin", {"handles": ["call_1"]}),
                                  ("context_unpin", {"all": True}), ("context_drop", {"handles": ["call_1"]}),
                                  ("context_note", {"handles": ["call_1"], "note": "the log is fine"}),
                                  ("read_overflow", {"id": "0" * 64})])
def test_the_sdk_never_sees_a_context_tool_call(stack: Stack, call: tuple[str, dict[str, Any]],
                                                 stream: bool) -> None:
    history = [*MESSAGES[:1], {"role": "user", "content": "Free up your context window, please."},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "log line\n" * 300}]
    tools = [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object", "properties": {}}}}]
    if stream:
        stack.fake.enqueue(Reply(sse=stream_tool_answer(call)))
        stack.fake.enqueue(Reply(sse=stream_chunks("done")))
        chunks = list(stack.sdk().chat.completions.create(model="m", messages=history, tools=tools, stream=True))
        assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == "done"
    else:
        stack.fake.enqueue(Reply(body=tool_answer(call)))
        stack.fake.enqueue(Reply(body=completion("done")))
        answer = stack.sdk().chat.completions.create(model="m", messages=history, tools=tools)
        assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content == "done"
    assert len(stack.fake.chats) == 2  # the proxy answered the call and asked again
    follow_up = stack.fake.chats[-1].json()["messages"]
    assert follow_up[-1]["role"] == "tool" and follow_up[-1]["tool_call_id"].startswith("ctx_0_")
    result = next(m for m in follow_up if m.get("tool_call_id") == "call_1")["content"]
    effect = {"context_drop": result.startswith("[overflow id="),
              "context_note": result.startswith("the log is fine") and "[overflow id=" in result,
              "context_pin": '"tool:call_1"' in httpx.get(f"{stack.proxy}/ctx/sessions/"
                                                          f"{_session_of(stack)}/pins").text}
    assert effect.get(call[0], True)


def _session_of(stack: Stack) -> str:
    return str(httpx.get(stack.proxy + "/ctx/sessions").json()["sessions"][0]["id"])


@pytest.mark.parametrize("stream", [False, True])
def test_compact_returns_a_report_and_the_next_request_is_smaller(stack: Stack, stream: bool) -> None:
    tools = [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object", "properties": {}}}}]
    history: list[Any] = [*MESSAGES]
    for k in range(3):
        history += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": "sh", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": f"output {k}\n" * 400}]
    compact = [*history, {"role": "user", "content": "/compact keep what you learned about the build"}]
    drop = ("context_drop", {"handles": ["call_0", "call_1"]})
    stack.fake.enqueue(Reply(sse=stream_tool_answer(drop)) if stream else Reply(body=tool_answer(drop)))
    stack.fake.enqueue(Reply(sse=stream_chunks("Compacted.")) if stream else Reply(body=completion("Compacted.")))
    client = stack.sdk()
    if stream:
        chunks = client.chat.completions.create(model="m", messages=compact, tools=tools, stream=True)
        report = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        report = client.chat.completions.create(model="m", messages=compact, tools=tools).choices[0].message.content
    assert "Context compacted: about" in str(report) and "drop x1" in str(report)
    first = stack.fake.chats[0]
    assert "/compact" in first.body.decode() and "keep what you learned about the build" in first.body.decode()
    after = [*compact, {"role": "assistant", "content": str(report)}, {"role": "user", "content": "go on"}]
    client.chat.completions.create(model="m", messages=after, tools=tools)
    old = sum(len(m["content"] or "") for m in first.json()["messages"] if m["role"] == "tool")
    new = sum(len(m["content"] or "") for m in stack.fake.chats[-1].json()["messages"] if m["role"] == "tool")
    assert new < old / 2  # the next upstream request carries stubs where the dropped results were


def test_ctxproxy_doctor_checks_the_upstream_window_tokenizer_and_data_dir(tmp_path: Path, stack: Stack) -> None:
    stack.fake.enqueue(Reply(body={"data": [{"id": "m", "max_model_len": 32768}]}), path="/models")
    stack.fake.enqueue(Reply(body={"data": [{"id": "m", "max_model_len": 32768}]}), path="/models")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXPROXY_")}
    result = subprocess.run([CTXPROXY, "doctor", "--upstream", stack.direct + "/v1", "--model", "m", "--data-dir",
                             str(tmp_path / "d"), "--json"], env=env, capture_output=True, text=True, timeout=60)
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    assert result.returncode == 0, result.stdout
    assert checks["window detected"]["detail"] == "32768 tokens (vllm /models)"
    assert checks["tokenizer (offline)"]["ok"] and checks["data dir"]["ok"] and checks["upstream reachable"]["ok"]
    down = subprocess.run([CTXPROXY, "doctor", "--upstream", "http://127.0.0.1:9/v1", "--data-dir", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert down.returncode == 1 and "FAIL  upstream reachable" in down.stdout


def test_sync_stream_and_async_sdk_calls_of_one_run_are_one_session_without_a_header(stack: Stack) -> None:
    """What the SDK sends is recorded: its fields reach the upstream as sent, its own headers (user-agent,
    x-stainless-*) pass untouched, and three calls of one growing history, made three ways with no session
    header, are found to be one session."""
    history = [*MESSAGES, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "Again."}]
    with stack.sdk() as client:
        first = client.chat.completions.with_raw_response.create(model="fake-model", messages=MESSAGES,
                                                                 temperature=0)
        with client.chat.completions.with_streaming_response.create(model="fake-model", messages=history,
                                                                    stream=True) as streamed:
            streamed.read()
    history += [{"role": "assistant", "content": "hi again"}, {"role": "user", "content": "Once more."}]

    async def third() -> Any:
        async with openai.AsyncOpenAI(base_url=stack.proxy + "/v1", api_key="k", max_retries=0) as aclient:
            return await aclient.chat.completions.with_raw_response.create(model="fake-model", messages=history)

    last = asyncio.run(third())
    sessions = {r.headers["x-ctx-session"] for r in (first, streamed, last)}
    assert len(sessions) == 1
    sent = stack.fake.chats
    assert [sorted(r.json()) for r in sent] == [["messages", "model", "temperature"], ["messages", "model", "stream"],
                                                ["messages", "model"]]
    for got in sent:
        stainless = {k: v for k, v in got.headers.items() if k.startswith("x-stainless-")}
        assert got.headers["user-agent"].startswith(("OpenAI/Python", "AsyncOpenAI/Python")) and stainless
    assert sent[0].headers["x-stainless-async"] == "false" and sent[2].headers["x-stainless-async"] != "false"
