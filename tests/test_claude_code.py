"""Claude Code, unmodified and offline, completes a scripted task through ctxproxy's ``/v1/messages``.

The binary comes from npm (``@anthropic-ai/claude-code``, pinned in ``scripts/test-deps``, which ``make test``
runs) into the test cache; without it (no npm) the test is skipped and says how to get it. Claude Code talks to
the proxy on loopback (``ANTHROPIC_BASE_URL``), the proxy translates to a scripted fake chat-completions model:
the model calls Bash, Claude Code runs the command and sends its output back, the model answers. The journal
shows the session, named by Claude Code's own ``X-Claude-Code-Session-Id`` and the conversation's opening. A second
run asks to free up the context: the model's ``context_drop`` runs inside the proxy, Claude Code never sees it, and
the cut output is restorable byte for byte.
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
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ctxproxy.config import load_settings
from ctxproxy.proxy.core.tokens import MessageCounter
from ctxproxy.proxy.edge.app import create_app
from tests.fakes import FakeUpstream, Received, Reply, serve_in_thread, stream_chunks, stream_tool_answer
from tests.test_anthropic_native import answer, sse

pytestmark = pytest.mark.e2e
CACHE = Path(os.environ.get("CTXPROXY_TEST_CACHE") or Path.home() / ".cache" / "ctxproxy-test")
CLAUDE = CACHE / "claude-code" / "node_modules" / ".bin" / "claude"
USAGE = {"prompt_tokens": 100, "completion_tokens": 5}


class Recorder:
    """The proxy's app, keeping the body of each ``/v1/messages`` request as Claude Code sent it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app, self.bodies = app, list[bytes]()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/messages":
            return await self.app(scope, receive, send)
        parts: list[bytes] = []

        async def recording() -> Message:
            message = await receive()
            if message["type"] != "http.request":
                return message
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                self.bodies.append(b"".join(parts))
            return message

        return await self.app(scope, recording, send)


class SmallModel(FakeUpstream):
    """A scripted model with a real window: it counts each prompt and refuses one over ``window`` as llama.cpp
    does (a 400, or a stream that ends at once); it answers from the script, with its count as the usage."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window, self.counter, self.counts = window, MessageCounter(), list[int]()

    def _next(self, got: Received) -> Reply:
        if not got.path.endswith("/chat/completions"):
            return super()._next(got)
        request = got.json()
        counted = sum(self.counter.count(m) for m in request["messages"]) + self.counter.count_tools(
            request.get("tools"))
        self.counts.append(counted)
        if counted > self.window:
            return Reply(raw=b"", headers={"content-type": "text/event-stream"}) if request.get("stream") else Reply(
                status=400, body={"error": {"type": "exceed_context_size_error", "n_prompt_tokens": counted,
                                            "n_ctx": self.window, "message": "exceeds the available context size"}})
        reply = super()._next(got)
        usage = {"prompt_tokens": counted, "completion_tokens": 5, "total_tokens": counted + 5}
        return Reply(sse=[*[c for c in reply.sse or [] if c.get("choices")], {"choices": [], "usage": usage}])


def serve(tmp_path: Path, fake: FakeUpstream | None = None, **env: str) -> Iterator[tuple[FakeUpstream, str, Recorder]]:
    if not CLAUDE.exists():
        pytest.skip(f"Claude Code is not installed at {CLAUDE}: run scripts/test-deps (needs npm)")
    fake = fake or FakeUpstream()
    with serve_in_thread(fake) as upstream:
        settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"),
                                      "CTXPROXY_UPSTREAM": upstream + "/v1", "CTXPROXY_CTX_WINDOW": "131072"} | env)
        recorder = Recorder(create_app(settings))
        with serve_in_thread(recorder) as proxy:
            yield fake, proxy, recorder


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[FakeUpstream, str]]:
    for fake, proxy, _ in serve(tmp_path):
        yield fake, proxy


@pytest.fixture
def native(tmp_path: Path) -> Iterator[tuple[FakeUpstream, str, Recorder]]:
    yield from serve(tmp_path, CTXPROXY_ANTHROPIC_UPSTREAM="native")


def claude(proxy: str, prompt: str, home: Path) -> dict[str, Any]:
    """``claude -p`` as the issue runs it: offline, a scratch HOME, Bash allowed (as root: IS_SANDBOX=1)."""
    home.mkdir(exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": proxy, "ANTHROPIC_API_KEY": "sk-test",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "IS_SANDBOX": "1"}
    done = subprocess.run([str(CLAUDE), "-p", prompt, "--output-format", "json", "--allowedTools", "Bash",
                           "--dangerously-skip-permissions"], env=env, cwd=home, capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_claude_code_runs_a_tool_and_answers_through_the_proxy(stack: tuple[FakeUpstream, str],
                                                               tmp_path: Path) -> None:
    fake, proxy = stack
    fake.enqueue(Reply(sse=stream_tool_answer(("Bash", {"command": "echo hello-from-bash"}), usage=USAGE)))
    fake.enqueue(Reply(sse=stream_chunks("It printed hello-from-bash.", usage=USAGE)))
    result = claude(proxy, "Run echo hello-from-bash and tell me what it printed.", tmp_path / "home")
    assert result["is_error"] is False and result["result"].strip() == "It printed hello-from-bash."
    first, second = fake.chats
    assert {"Bash", "Read"} <= {t["function"]["name"] for t in first.json()["tools"]}
    assert first.headers["anthropic-version"] and first.query == ""
    output = next(m for m in second.json()["messages"] if m["role"] == "tool")
    assert output["tool_call_id"] == "ctx_0_Bash" and "hello-from-bash" in output["content"]
    session = httpx.get(f"{proxy}/ctx/sessions/{run_session(proxy, result)}").json()
    assert session["named"] == 1 and session["requests"] == 2 and session["model"]


def test_claude_codes_context_is_freed_inside_the_proxy(stack: tuple[FakeUpstream, str], tmp_path: Path) -> None:
    fake, proxy = stack
    fake.enqueue(Reply(sse=stream_tool_answer(("Bash", {"command": "seq 1 4000"}), usage=USAGE)))
    fake.enqueue(Reply(sse=stream_tool_answer(("context_drop", {"handles": ["ctx_0_Bash"]}), usage=USAGE)))
    fake.enqueue(Reply(sse=stream_chunks("Counted, and the output is put away.", usage=USAGE)))
    result = claude(proxy, "Run seq 1 4000, then free up your context.", tmp_path / "home")
    assert result["result"].strip() == "Counted, and the output is put away."
    offered = {t["function"]["name"] for t in fake.chats[1].json()["tools"]}
    assert "context_drop" in offered
    stub = next(m for m in fake.chats[2].json()["messages"] if m.get("tool_call_id") == "ctx_0_Bash")["content"]
    oid = re.search(r"id=([0-9a-f]{64})", stub).group(1)  # type: ignore[union-attr]
    restored = httpx.get(f"{proxy}/ctx/sessions/{run_session(proxy, result)}/overflow/{oid}").text
    assert restored.split() == [str(i) for i in range(1, 4001)]
    session = httpx.get(f"{proxy}/ctx/sessions/{run_session(proxy, result)}").json()
    assert session["requests"] == 2


def test_claude_code_against_a_native_upstream_gets_its_body_through_byte_for_byte(
        native: tuple[FakeUpstream, str, Recorder], tmp_path: Path) -> None:
    fake, proxy, recorder = native
    call = {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "echo hello-from-bash"}}
    fake.enqueue(Reply(sse=sse(answer({"type": "text", "text": "Running it."}, call, stop="tool_use"))),
                 path="/messages")
    fake.enqueue(Reply(sse=sse(answer({"type": "text", "text": "It printed hello-from-bash."}))), path="/messages")
    result = claude(proxy, "Run echo hello-from-bash and tell me what it printed.", tmp_path / "home")
    assert result["result"].strip() == "It printed hello-from-bash."
    upstream = [r for r in fake.received if r.path == "/v1/messages"]
    assert len(upstream) == len(recorder.bodies) == 2 and not fake.chats
    assert [r.body for r in upstream] == recorder.bodies  # nothing cut: every byte as Claude Code sent it
    assert all(r.query == "beta=true" and "anthropic-beta" in r.headers for r in upstream)
    second = upstream[1].json()
    assert second["messages"][-2]["content"][-1] == call
    output = second["messages"][-1]["content"][0]
    assert output["tool_use_id"] == "toolu_01" and "hello-from-bash" in json.dumps(output["content"])
    assert httpx.get(f"{proxy}/ctx/sessions/{run_session(proxy, result)}").json()["requests"] == 2


def test_a_long_claude_code_run_stays_inside_a_small_window_and_every_cut_is_restorable(tmp_path: Path) -> None:
    """Eight commands whose outputs together are several times the window: every prompt the model gets fits
    (none refused), and every output the proxy cut comes back byte for byte from the stub's overflow id."""
    window, rounds = 49152, 8
    model = SmallModel(window)
    outputs = {f"ctx_0_Bash_{i}": f"seq {i * 100000 + 1} {i * 100000 + 3000}" for i in range(rounds)}
    for call_id, command in outputs.items():
        script = stream_tool_answer(("Bash", {"command": command}))
        model.enqueue(Reply(sse=[_renamed(chunk, call_id) for chunk in script]))
    model.enqueue(Reply(sse=stream_chunks("All eight ran.")))
    for fake, proxy, _ in serve(tmp_path, model, CTXPROXY_CTX_WINDOW=str(window)):
        result = claude(proxy, "Run the commands I will need, one at a time.", tmp_path / "home")
        assert result["result"].strip() == "All eight ran."
        assert len(model.counts) == rounds + 1 and max(model.counts) <= window, model.counts
        last = fake.chats[-1].json()["messages"]
        stubs = {m["tool_call_id"]: m["content"] for m in last if m.get("role") == "tool"}
        assert stubs.keys() == outputs.keys()
        cut = {k: re.search(r"id=([0-9a-f]{64})", v) for k, v in stubs.items()}
        assert all(cut.values())  # 160 KB of output in all: each cut to a preview as it arrived
        for call_id, match in cut.items():
            if match:
                start, end = map(int, outputs[call_id].split()[1:])
                restored = httpx.get(f"{proxy}/ctx/sessions/{run_session(proxy, result)}/overflow/{match[1]}").text
                assert restored.split() == [str(n) for n in range(start, end + 1)]


def run_session(proxy: str, result: dict[str, Any]) -> str:
    """The proxy's session of Claude Code's main conversation: its run's id and the conversation's opening."""
    rows = httpx.get(f"{proxy}/ctx/sessions").json()["sessions"]
    [session] = [r["id"] for r in rows if str(r["id"]).startswith(f"{result['session_id']}:")]
    return str(session)


def _renamed(chunk: Any, call_id: str) -> Any:
    """A scripted chunk whose tool call gets its own id (Claude Code keys its results by it)."""
    for choice in chunk.get("choices", []):
        for call in choice.get("delta", {}).get("tool_calls") or []:
            if "id" in call:
                call["id"] = call_id
    return chunk
