"""Against a real model server: llama.cpp (llama-cpp-python) serving SmolLM2-135M-Instruct with a 2048-token
window, on loopback, behind the real proxy on real uvicorn. Nothing here is scripted: the answers, the token
counts and the overflow errors are the server's own."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxproxy.config import load_settings
from ctxproxy.proxy.core.tokens import Calibration
from ctxproxy.proxy.edge.app import create_app
from ctxproxy.store import Journal
from tests.fakes import serve_in_thread
from tests.real.upstream import agent_history, llama_server

pytestmark = pytest.mark.e2e
N_CTX = 2048
MODEL = "smollm2"


@dataclass
class Real:
    direct: str
    proxy: str
    journal: Journal

    def chat(self, body: dict[str, Any], via_proxy: bool = True) -> httpx.Response:
        base = self.proxy if via_proxy else self.direct
        return httpx.post(base + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=300)

    def admin(self, path: str) -> Any:
        return httpx.get(self.proxy + "/ctx" + path, timeout=10).json()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with llama_server(N_CTX, tmp_path_factory.mktemp("llama") / "server.log") as base:
        yield base


@pytest.fixture
def real(llama: str, tmp_path: Path) -> Iterator[Real]:
    """A fresh proxy (own journal, nothing configured about the window) in front of the shared real server,
    configured as this upstream needs: ``null_content = "empty"``."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": llama + "/v1",
                                  "CTXPROXY_NULL_CONTENT": "empty"})
    with serve_in_thread(create_app(settings)) as proxy:
        yield Real(llama, proxy, Journal(settings.data_path / "journal.db"))


def _ask(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "You are a terse assistant."},
                         {"role": "user", "content": text}], "max_tokens": 16, "temperature": 0, "seed": 1}


def _long_agent_run(rounds: int) -> list[dict[str, Any]]:
    """An agent history far over the window: each round a tool call and a 60-line tool result."""
    question = {"role": "user", "content": "In one sentence: which module loads the config?"}
    return [*agent_history(rounds, lines=60), question]


def _requests_of(real: Real, session: str) -> list[dict[str, Any]]:
    journal = real.admin(f"/sessions/{session}/journal")
    return [real.admin(f"/requests/{row['request_id']}") for row in journal["entries"]]


def test_a_plain_answer_is_the_servers_own(real: Real) -> None:
    direct, proxied = real.chat(_ask("Name one colour."), via_proxy=False), real.chat(_ask("Name one colour."))
    assert direct.status_code == proxied.status_code == 200
    answer = proxied.json()
    assert answer["choices"][0]["message"]["content"].strip()
    assert answer["usage"]["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"]  # the same prompt arrived
    assert proxied.headers["X-Ctx-Session"]


def test_a_streamed_answer_arrives_whole(real: Real) -> None:
    with httpx.stream("POST", real.proxy + "/v1/chat/completions", timeout=300,
                      json={"model": MODEL, "stream": True, **_ask("Count to three.")}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.strip() and len(chunks) > 2


def test_a_run_over_the_window_fails_direct_and_succeeds_through_the_proxy(real: Real) -> None:
    body = {"messages": _long_agent_run(rounds=12), "max_tokens": 24, "temperature": 0}
    direct = real.chat(body, via_proxy=False)
    assert direct.status_code == 400
    assert direct.json()["error"]["code"] == "context_length_exceeded"

    proxied = real.chat(body)
    assert proxied.status_code == 200, proxied.text
    assert proxied.json()["choices"][0]["message"]["content"] is not None
    assert proxied.json()["usage"]["prompt_tokens"] < N_CTX


def test_a_streamed_run_over_the_window_is_answered_on_a_fresh_session(real: Real) -> None:
    """llama-cpp-python refuses a streamed prompt over n_ctx by closing the stream before its first byte, with the
    reason only in its log; the proxy asks it why (the same prompt, not streamed), learns the window, cuts, and
    the agent gets its stream."""
    body = {"messages": _long_agent_run(rounds=12), "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", real.proxy + "/v1/chat/completions", json={"model": MODEL, **body},
                      timeout=300) as response:
        text = response.read().decode()
    assert response.status_code == 200, text
    assert text.rstrip().endswith("data: [DONE]")
    session, deadline = response.headers["X-Ctx-Session"], time.monotonic() + 10
    while time.monotonic() < deadline:  # a stream's answer is journaled after its last byte
        attempts = [(r["outcome"], r["status"]) for r in _requests_of(real, session)[0]["responses"]]
        if attempts and attempts[-1][1] == 200:
            break
        time.sleep(0.05)
    assert attempts[0][0] == "context_overflow" and attempts[-1][1] == 200, attempts


def test_the_window_is_learned_once_from_the_servers_own_error(real: Real) -> None:
    """llama-cpp-python reports no window; the proxy learns it from the first overflow and keeps it."""
    history = _long_agent_run(rounds=12)
    first = real.chat({"messages": history, "max_tokens": 8, "temperature": 0})
    assert first.status_code == 200, first.text
    answer = first.json()["choices"][0]["message"]["content"]
    history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And which one saves it?"}]
    second = real.chat({"messages": history, "max_tokens": 8, "temperature": 0})
    assert second.status_code == 200, second.text
    assert second.headers["X-Ctx-Session"] == first.headers["X-Ctx-Session"]
    attempts = [[(r["outcome"], r["status"]) for r in req["responses"]]
                for req in _requests_of(real, first.headers["X-Ctx-Session"])]
    assert attempts[0][0][1] == 400 and attempts[0][-1][1] == 200  # learned from the server's 400, then fit
    assert [status for _, status in attempts[1]] == [200]  # the window was known: no second overflow


def test_null_content_that_this_server_refuses_is_sent_as_empty(real: Real) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "sh", "arguments": '{"cmd": "ls"}'}}
    messages = [*_ask("What files are there?")["messages"],
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "README.md setup.py"}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    assert real.chat(body, via_proxy=False).status_code == 500  # the server's own answer to null
    proxied = real.chat(body)
    assert proxied.status_code == 200, proxied.text
    request = _requests_of(real, proxied.headers["X-Ctx-Session"])[0]
    assert request["responses"][0]["status"] == 200


def test_calibration_predicts_the_servers_own_token_counts(real: Real) -> None:
    """tiktoken is not SmolLM2's tokenizer: after one answer, estimate × k must land near what the server counts."""
    history = _long_agent_run(rounds=1)
    for question in ("Which module?", "Which line?", "Which function?", "Why?"):
        history += [{"role": "user", "content": question}]
        answer = real.chat({"messages": history, "max_tokens": 8, "temperature": 0})
        assert answer.status_code == 200, answer.text
        history += [{"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]}]
    session, deadline = answer.headers["X-Ctx-Session"], time.monotonic() + 10
    while len(samples := real.journal.calibration_samples(session, MODEL)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)  # the last answer is journaled off the request's path
    assert len(samples) == 4
    raw_errors, calibrated_errors, calibration = [], [], Calibration()
    for estimate, actual in samples:
        raw_errors.append(abs(estimate - actual) / actual)
        calibrated_errors.append(abs(calibration.scaled(estimate) - actual) / actual)
        calibration = calibration.observe(estimate, actual)
    assert max(calibrated_errors[1:]) < 0.05, (samples, calibrated_errors)
    assert max(calibrated_errors[1:]) < min(raw_errors), (samples, raw_errors)


def _thirty_kb_round(i: int) -> list[dict[str, Any]]:
    """One agent round: a shell call and its 30 KB result (a file listing, as a new user's agent would read)."""
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "sh", "arguments": json.dumps({"cmd": f"cat src/big_{i}.py"})}}
    body = "\n".join(f"def handler_{i}_{n}(config, request):  # big_{i} line {n}" for n in range(600))[:30_000]
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": body}]


def _post(real: Real, body: dict[str, Any]) -> tuple[int, str]:
    if not body.get("stream"):
        answer = real.chat(body)
        return answer.status_code, answer.text
    with httpx.stream("POST", real.proxy + "/v1/chat/completions", json={"model": MODEL, **body},
                      timeout=300) as response:
        text = response.read().decode()
    return response.status_code, text


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_a_window_learned_late_strands_no_round(real: Real, stream: bool) -> None:
    """#11: no ``ctx_window``, and llama-cpp-python reports none: the first 30 KB results are spilled to previews
    sized for the 131072 fallback. Once the server's refusal teaches the real window, those decisions are re-cut
    for it (the newest result's preview too) instead of the request being refused: every round is answered."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. Be brief."},
                                     {"role": "user", "content": "Find where the config is loaded and fix it."}]
    for i in range(4):
        history += _thirty_kb_round(i)
        status, text = _post(real, {"messages": history, "max_tokens": 8, "temperature": 0, "stream": stream})
        assert status == 200, f"round {i + 1}: {text[:600]}"
        if stream:
            assert text.rstrip().endswith("data: [DONE]"), f"round {i + 1}: {text[-600:]}"


def _anthropic_run(rounds: int) -> list[dict[str, Any]]:
    """``_long_agent_run`` as Claude Code would send it: tool_use and tool_result blocks, the system apart."""
    messages: list[dict[str, Any]] = []
    for m in _long_agent_run(rounds)[1:]:
        if m["role"] == "assistant":
            messages.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in m["tool_calls"]]})
        elif m["role"] == "tool":
            result = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"],
                      "cache_control": {"type": "ephemeral"}}
            messages.append({"role": "user", "content": [result]})
        elif messages and messages[-1]["role"] == "user":
            messages[-1]["content"].append({"type": "text", "text": m["content"]})
        else:
            messages.append({"role": "user", "content": [{"type": "text", "text": m["content"]}]})
    return messages


@pytest.mark.parametrize("stream", [False, True])
def test_the_anthropic_sdk_through_the_proxy_to_the_real_server(real: Real, stream: bool) -> None:
    """Translated mode against llama.cpp: an agent history far over the window, in Anthropic's shape, is cut to
    fit and answered by the server itself, buffered and streamed."""
    import anthropic

    sdk = anthropic.Anthropic(base_url=real.proxy, api_key="sk-test", max_retries=0, timeout=300)
    tools = [{"name": "sh", "description": "Run a shell command", "input_schema": {
        "type": "object", "properties": {"cmd": {"type": "string"}}}}]
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "extra_body": {"temperature": 0}, "tools": tools,
                           "system": [{"type": "text", "text": "You are a coding agent. Be brief.",
                                       "cache_control": {"type": "ephemeral"}}],
                           "messages": _anthropic_run(rounds=12)}
    if stream:
        with sdk.messages.stream(**ask) as answer:
            message = answer.get_final_message()
    else:
        message = sdk.messages.create(**ask)
    assert message.role == "assistant" and message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert 0 < message.usage.input_tokens < N_CTX  # the server's own count of what the proxy sent
