"""Codex CLI, unmodified and offline, completes a scripted task through ctxproxy's ``/v1/responses``.

The binary comes from npm (``@openai/codex``, pinned in ``scripts/test-deps``, which ``make test`` runs) into the
test cache; without it (no npm) the test is skipped and says how to get it. Codex talks to the proxy on loopback
(a model provider with ``wire_api = "responses"``), always streamed, and the proxy translates to a scripted fake
chat-completions model: the model calls Codex's shell tool (``exec_command``), Codex runs the command and sends
its output back as a ``function_call_output``, the model answers. The journal shows the session, named by Codex's
own ``session-id`` header. A second run asks to free up the context: the model's ``context_drop`` runs inside the
proxy, Codex never sees it, and the cut output is restorable byte for byte.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxproxy.config import load_settings
from ctxproxy.proxy.edge.app import create_app
from ctxproxy.store import Journal
from tests.fakes import FakeUpstream, Reply, serve_in_thread, stream_chunks, stream_tool_answer

pytestmark = pytest.mark.e2e
CACHE = Path(os.environ.get("CTXPROXY_TEST_CACHE") or Path.home() / ".cache" / "ctxproxy-test")
CODEX = CACHE / "codex" / "node_modules" / ".bin" / "codex"
USAGE = {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105}
CONFIG = """\
model = "fake-model"
model_provider = "ctxproxy"
web_search = "disabled"

[model_providers.ctxproxy]
name = "ctxproxy"
base_url = "{proxy}/v1"
wire_api = "responses"
env_key = "CTXPROXY_TEST_KEY"
"""
"""The config the README gives: a provider whose base URL is the proxy, speaking the Responses API. Web search
is a built-in tool a chat-completions model cannot run, so it is turned off (the proxy refuses it, saying so)."""


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[FakeUpstream, str]]:
    if not CODEX.exists():
        pytest.skip(f"Codex CLI is not installed at {CODEX}: run scripts/test-deps (needs npm)")
    fake = FakeUpstream()
    with serve_in_thread(fake) as upstream:
        settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"),
                                      "CTXPROXY_UPSTREAM": upstream + "/v1", "CTXPROXY_CTX_WINDOW": "131072"})
        with serve_in_thread(create_app(settings)) as proxy:
            yield fake, proxy


def codex(proxy: str, prompt: str, home: Path) -> list[dict[str, Any]]:
    """``codex exec --json`` as the issue runs it: offline, a scratch HOME and CODEX_HOME, no sandbox (the test
    machine may have no user namespaces); its JSONL events."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(CONFIG.format(proxy=proxy))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(codex_home),
           "CTXPROXY_TEST_KEY": "sk-test"}
    done = subprocess.run([str(CODEX), "exec", "--skip-git-repo-check", "--json", "-c", "analytics.enabled=false",
                           "--dangerously-bypass-approvals-and-sandbox", prompt], env=env, cwd=home,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_codex_runs_a_shell_command_and_answers_through_the_proxy(stack: tuple[FakeUpstream, str],
                                                                  tmp_path: Path) -> None:
    fake, proxy = stack
    fake.enqueue(Reply(sse=stream_tool_answer(("exec_command", {"cmd": "echo hello-from-codex"}), usage=USAGE)))
    fake.enqueue(Reply(sse=stream_chunks("It printed hello-from-codex.", usage=USAGE)))
    events = codex(proxy, "Run echo hello-from-codex and tell me what it printed.", tmp_path / "home")
    thread = next(e["thread_id"] for e in events if e["type"] == "thread.started")
    said = [e["item"]["text"] for e in events if e["type"] == "item.completed"
            and e["item"]["type"] == "agent_message"]
    assert said and said[-1].strip() == "It printed hello-from-codex."
    first, second = fake.chats
    assert "exec_command" in {t["function"]["name"] for t in first.json()["tools"]}
    assert first.json()["messages"][0]["role"] == "system"  # Codex's developer message
    output = next(m for m in second.json()["messages"] if m["role"] == "tool")
    assert output["tool_call_id"] == "ctx_0_exec_command" and "hello-from-codex" in output["content"]
    session = httpx.get(f"{proxy}/ctx/sessions/{thread}").json()
    assert session["named"] == 1 and session["requests"] == 2


def test_codexs_context_is_freed_inside_the_proxy(stack: tuple[FakeUpstream, str], tmp_path: Path) -> None:
    fake, proxy = stack
    fake.enqueue(Reply(sse=stream_tool_answer(("exec_command", {"cmd": "seq 1 4000"}), usage=USAGE)))
    fake.enqueue(Reply(sse=stream_tool_answer(("context_drop", {"handles": ["ctx_0_exec_command"]}), usage=USAGE)))
    fake.enqueue(Reply(sse=stream_chunks("Counted, and the output is put away.", usage=USAGE)))
    events = codex(proxy, "Run seq 1 4000, then free up your context.", tmp_path / "home")
    thread = next(e["thread_id"] for e in events if e["type"] == "thread.started")
    said = [e["item"]["text"] for e in events if e["type"] == "item.completed"
            and e["item"]["type"] == "agent_message"]
    assert said[-1].strip() == "Counted, and the output is put away."
    assert "context_drop" in {t["function"]["name"] for t in fake.chats[1].json()["tools"]}
    stub = next(m for m in fake.chats[2].json()["messages"]
                if m.get("tool_call_id") == "ctx_0_exec_command")["content"]
    oid = re.search(r"id=([0-9a-f]{64})", stub).group(1)  # type: ignore[union-attr]
    restored = httpx.get(f"{proxy}/ctx/sessions/{thread}/overflow/{oid}").text
    assert restored.startswith("Chunk ID:") and "Process exited with code 0" in restored  # Codex's own output
    assert restored.rstrip().endswith("3999\n4000") and "[overflow id=" not in restored
    assert httpx.get(f"{proxy}/ctx/sessions/{thread}").json()["requests"] == 2


def test_codex_with_web_search_on_is_told_how_to_turn_it_off(stack: tuple[FakeUpstream, str], tmp_path: Path) -> None:
    """Codex offers its built-in web search unless told not to: a chat model cannot run it, so the proxy refuses
    the request before anything is forwarded, and the message reaches the person with the fix."""
    fake, proxy = stack
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(CONFIG.format(proxy=proxy).replace('web_search = "disabled"\n', ""))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home / ".codex"),
           "CTXPROXY_TEST_KEY": "sk-test"}
    done = subprocess.run([str(CODEX), "exec", "--skip-git-repo-check", "--json", "-c", "analytics.enabled=false",
                           "say hi"], env=env, cwd=home, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=180, check=False)
    assert "web_search=disabled" in done.stdout + done.stderr and not fake.chats


def shell_call(call_id: str, cmd: str) -> list[Any]:
    """A streamed call of Codex's shell tool under its own call id (no usage: a made-up count would teach the
    proxy's calibration that the prompt is tiny)."""
    chunks = stream_tool_answer(("exec_command", {"cmd": cmd}))
    for chunk in chunks:
        for call in chunk["choices"][0]["delta"].get("tool_calls", []) if chunk["choices"] else []:
            if "id" in call:
                call["id"] = call_id
    return chunks


def test_a_long_codex_run_stays_inside_a_small_window_every_cut_restorable(tmp_path: Path) -> None:
    """Six rounds of large shell output (about 5k tokens each, kept whole on arrival), a 24k window: Codex's last
    request holds more than the window, every request the model gets fits (about 15k), and the cuts the last one
    carries are restorable from the journal."""
    if not CODEX.exists():
        pytest.skip(f"Codex CLI is not installed at {CODEX}: run scripts/test-deps (needs npm)")
    from ctxproxy.proxy.core.tokens import MessageCounter

    window, fake = 24576, FakeUpstream()
    for n in range(6):
        fake.enqueue(Reply(sse=shell_call(f"call_{n}", f"seq {n * 10000} {n * 10000 + 2500}")))
    fake.enqueue(Reply(sse=stream_chunks("All six counted.")))
    with serve_in_thread(fake) as upstream:
        settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"),
                                      "CTXPROXY_UPSTREAM": upstream + "/v1", "CTXPROXY_CTX_WINDOW": str(window),
                                      "CTXPROXY_SPILL_CHARS": "100000"})  # the outputs arrive whole: cut later
        with serve_in_thread(create_app(settings)) as proxy:
            events = codex(proxy, "Run the six counts, then tell me you are done.", tmp_path / "home")
            thread = next(e["thread_id"] for e in events if e["type"] == "thread.started")
            stubs = [m["content"] for m in fake.chats[-1].json()["messages"] if m.get("role") == "tool"]
            ids = [re.search(r"id=([0-9a-f]{64})", s).group(1) for s in stubs if "[overflow id=" in s]  # type: ignore[union-attr]
            restored = [httpx.get(f"{proxy}/ctx/sessions/{thread}/overflow/{oid}") for oid in ids]
    counter = MessageCounter()
    sizes = [sum(counter.count(m) for m in c.json()["messages"]) + counter.count_tools(c.json().get("tools"))
             for c in fake.chats]
    journal = Journal(settings.data_path / "journal.db")
    last = journal.request(journal.session_journal(thread)[-1]["request_id"]) or {}
    sent_by_codex = sum(counter.count(m) for m in last["messages"])
    assert sent_by_codex > window  # what Codex sent at the end would not fit, what the model got does
    assert len(fake.chats) == 7 and max(sizes) < window, sizes
    assert ids and all(r.status_code == 200 and r.text.startswith("Chunk ID:") for r in restored)
