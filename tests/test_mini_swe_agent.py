"""mini-swe-agent, unmodified, runs a short task through the proxy: in its tool-calling mode (``LitellmModel``,
the package's own ``mini.yaml``) and in its text mode (``LitellmTextbasedModel``, ``mini_textbased.yaml``), with a
``LocalEnvironment`` in a scratch directory and a scripted fake upstream behind real uvicorn servers on loopback.

The proxy is wrapped in a recorder that keeps what mini-swe-agent sends (headers, bytes) before handing the
request on untouched, so the test can compare it with what the upstream received."""

from __future__ import annotations

import asyncio
import importlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import openai
import pytest
import yaml
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ctxproxy.config import Settings, load_settings
from ctxproxy.proxy.edge.app import create_app
from ctxproxy.store import Journal
from tests.fakes import (
    CountingUpstream,
    FakeUpstream,
    Received,
    Reply,
    completion,
    serve_in_thread,
    tool_answer,
)

pytestmark = pytest.mark.e2e
TASK = "Write hello into out.txt in the current directory, then submit."
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class Recorder:
    """ASGI middleware: records each HTTP request (headers and raw body) and replays it to ``app`` as it came."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.received: list[Received] = []

    @property
    def chats(self) -> list[Received]:
        return [r for r in self.received if r.path.endswith("/chat/completions")]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.received.append(Received(scope["method"], scope["path"], scope["query_string"].decode(),
                                      {k.decode().lower(): v.decode() for k, v in scope["headers"]}, body))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


@dataclass
class Stack:
    proxy: str
    fake: FakeUpstream
    recorder: Recorder
    settings: Settings


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    fake = FakeUpstream()
    with serve_in_thread(fake) as direct:
        settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": direct + "/v1"})
        recorder = Recorder(create_app(settings))
        with serve_in_thread(recorder) as proxy:
            yield Stack(proxy, fake, recorder, settings)


@pytest.fixture
def mswea(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """mini-swe-agent's package, imported offline and quiet: no start-up banner, no user config (its global
    config dir is a scratch one), litellm's bundled price map instead of a download, no price needed for a fake
    model, and a failed call fails at once instead of after ten backed-off retries.

    litellm's blocking ``completion`` runs its logging hooks on ``asyncio.get_event_loop()``, which would leave a
    new, never-closed loop set on this thread, and it caches its OpenAI clients with their keep-alive sockets:
    the test owns that loop and closes both, so no ResourceWarning surfaces later in another test."""
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    monkeypatch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path / "mswea-config"))
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("MSWEA_COST_TRACKING", "ignore_errors")
    monkeypatch.setenv("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        yield importlib.import_module("minisweagent")
    finally:
        import litellm

        cache = litellm.in_memory_llm_clients_cache
        for key, client in list(cache.cache_dict.items()):
            if isinstance(client, openai.OpenAI):
                client.close()
                cache.delete_cache(key)
        asyncio.set_event_loop(None)
        loop.close()


def run_agent(mswea: ModuleType, stack: Stack, workdir: Path, *, textbased: bool) -> dict[str, Any]:
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    name = "mini_textbased.yaml" if textbased else "mini.yaml"
    config = yaml.safe_load((Path(mswea.package_dir) / "config" / name).read_text())
    model_class = LitellmTextbasedModel if textbased else LitellmModel
    model = model_class(**config["model"] | {
        "model_name": "openai/fake-model",
        "model_kwargs": config["model"]["model_kwargs"] | {"api_base": stack.proxy + "/v1", "api_key": "sk-mswea"},
    })
    env = LocalEnvironment(**config["environment"] | {"cwd": str(workdir)})
    agent_config = {k: v for k, v in config["agent"].items() if k != "mode"}  # `mode` is the CLI's, not the agent's
    agent = DefaultAgent(model, env, **agent_config | {"step_limit": 5, "output_path": workdir.parent / "traj.json"})
    result: dict[str, Any] = agent.run(TASK)
    return result


def bash_call(call_id: str, command: str) -> dict[str, Any]:
    answer = tool_answer(("bash", {"command": command}), content="Running it.")
    answer["choices"][0]["message"]["tool_calls"][0]["id"] = call_id
    return answer


def fenced(command: str) -> dict[str, Any]:
    return completion(f"THOUGHT: one command at a time.\n\n```mswea_bash_command\n{command}\n```")


def assert_one_session_without_a_header(stack: Stack, requests: int) -> None:
    assert all("x-session-id" not in r.headers for r in stack.recorder.chats)
    sessions = httpx.get(stack.proxy + "/ctx/sessions").json()["sessions"]
    assert len(sessions) == 1, sessions
    assert sessions[0]["requests"] == requests and not sessions[0]["named"] and sessions[0]["parent_id"] is None
    rows = Journal(stack.settings.data_path / "journal.db").session_journal(sessions[0]["id"])
    assert [(r["outcome"], r["status"]) for r in rows] == [("ok", 200)] * requests


def assert_passed_through(stack: Stack) -> list[dict[str, Any]]:
    """What mini-swe-agent sent reached the upstream unchanged: the same bytes, its own headers kept."""
    sent, got = stack.recorder.chats, stack.fake.chats
    assert len(sent) == len(got)
    for out, up in zip(sent, got, strict=True):
        assert up.body == out.body  # nothing was rewritten, so byte for byte
        for header in ("user-agent", "authorization", "content-type", "accept"):
            assert up.headers.get(header) == out.headers.get(header), header
        stainless = {k: v for k, v in out.headers.items() if k.startswith("x-stainless-")}
        assert stainless and {k: up.headers.get(k) for k in stainless} == stainless
    assert sent[0].headers["authorization"] == "Bearer sk-mswea"
    assert sent[0].headers["user-agent"].startswith("OpenAI/Python")
    return [r.json() for r in sent]


def test_mini_swe_agent_with_tool_calls_finishes_through_the_proxy(
        mswea: ModuleType, stack: Stack, tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    stack.fake.enqueue(Reply(body=bash_call("call_write", "echo hello > out.txt")))
    stack.fake.enqueue(Reply(body=bash_call("call_submit", SUBMIT)))

    result = run_agent(mswea, stack, workdir, textbased=False)

    assert result["exit_status"] == "Submitted" and result["submission"] == ""
    assert (workdir / "out.txt").read_text() == "hello\n"
    bodies = assert_passed_through(stack)
    assert len(bodies) == 2
    assert all(set(b) == {"model", "messages", "tools"} for b in bodies)
    assert all(b["model"] == "fake-model" and b["tools"][0]["function"]["name"] == "bash" for b in bodies)
    first, second = bodies
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    assert TASK in first["messages"][1]["content"]
    assert second["messages"][:2] == first["messages"]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "tool"]
    assert second["messages"][2]["tool_calls"][0]["id"] == "call_write"
    assert second["messages"][3]["tool_call_id"] == "call_write"
    assert json.loads(second["messages"][3]["content"]) == {"returncode": 0, "output": ""}
    assert_one_session_without_a_header(stack, requests=2)


def test_mini_swe_agent_in_text_mode_finishes_through_the_proxy(
        mswea: ModuleType, stack: Stack, tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    stack.fake.enqueue(Reply(body=fenced("echo hello > out.txt")))
    stack.fake.enqueue(Reply(body=fenced("cat out.txt")))
    stack.fake.enqueue(Reply(body=fenced(SUBMIT)))

    result = run_agent(mswea, stack, workdir, textbased=True)

    assert result["exit_status"] == "Submitted" and result["submission"] == ""
    assert (workdir / "out.txt").read_text() == "hello\n"
    bodies = assert_passed_through(stack)
    assert len(bodies) == 3
    assert all(set(b) == {"model", "messages"} for b in bodies)  # no tools: the command is in a fenced block
    last = bodies[-1]["messages"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert last[3]["content"] == "<returncode>0</returncode>\n<output>\n</output>"
    assert last[5]["content"] == "<returncode>0</returncode>\n<output>\nhello\n</output>"
    assert_one_session_without_a_header(stack, requests=3)


class WindowedScript(CountingUpstream):
    """The scripted answers, from a model server with a real window: a prompt over it is refused as llama.cpp does
    (400 ``exceed_context_size_error``), one that fits gets the next scripted answer, its usage this server's own
    count. Like llama-cpp-python, it reports its window nowhere (``/models`` has none, ``/props`` is unknown)."""

    def _next(self, got: Received) -> Reply:
        queue = self.replies.get("/chat/completions")
        if not got.path.endswith("/chat/completions") or not queue:
            return super()._next(got)
        verdict = self._echo(got)  # counts the prompt; a refusal when it is over the window
        if verdict.status >= 400:
            return verdict
        reply = queue.popleft()
        counted = self.counts[-1]
        return Reply(body=reply.body | {"usage": {"prompt_tokens": counted, "completion_tokens": 9,
                                                  "total_tokens": counted + 9}})


def test_mini_swe_agent_in_text_mode_with_long_outputs_fits_a_4k_window(
        mswea: ModuleType, tmp_path: Path) -> None:
    """#11: unmodified mini-swe-agent in text mode, each command printing more than 10 000 characters (its
    long-output form, head and tail), against a 4k model that reports no window, with no ``ctx_window``: the
    proxy learns the window from the first refusal, re-cuts what it had sized for the fallback, and the agent
    never sees a 400; it finishes its task."""
    fake = WindowedScript(window=4096)
    commands = [f"seq {k} {k + 3999}" for k in range(1, 5)]  # about 19 000 characters each
    for command in [*commands, SUBMIT]:
        fake.enqueue(Reply(body=fenced(command)))
    workdir = tmp_path / "work"
    workdir.mkdir()
    with serve_in_thread(fake) as direct:
        settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": direct + "/v1"})
        recorder = Recorder(create_app(settings))
        with serve_in_thread(recorder) as proxy:
            result = run_agent(mswea, Stack(proxy, fake, recorder, settings), workdir, textbased=True)
            sessions = httpx.get(proxy + "/ctx/sessions").json()["sessions"]

    assert result["exit_status"] == "Submitted", result
    assert len(recorder.chats) == 5 and not fake.replies["/chat/completions"]  # every step answered, none retried
    sent = [r.json()["messages"] for r in recorder.chats]
    assert all("<output_head>" in m[-1]["content"] for m in sent[1:])  # the long-output form is what it sends
    journal, deadline = Journal(settings.data_path / "journal.db"), time.monotonic() + 10
    while len(answers := [journal.request(r["request_id"])["responses"]  # type: ignore[index]
                          for r in journal.session_journal(sessions[0]["id"])]) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)  # the last answer is journaled after its last byte left
    assert len(sessions) == 1 and [a[-1]["status"] for a in answers] == [200] * 5  # the agent never got a 400
    assert fake.over_window <= 1  # refused once, before the window was known; never after
