"""The Responses front against a real model server: llama.cpp (llama-cpp-python) serving SmolLM2-135M-Instruct,
which speaks only chat completions, behind the real proxy, driven by the official ``openai`` SDK's
``client.responses``. Nothing is scripted: the answers and the token counts are the server's own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ctxproxy.config import load_settings
from ctxproxy.proxy.edge.app import create_app
from ctxproxy.store import Journal
from tests.fakes import serve_in_thread
from tests.real.upstream import llama_server

pytestmark = pytest.mark.e2e
MODEL = "smollm2"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with llama_server(2048, tmp_path_factory.mktemp("llama") / "server.log") as base:
        yield base


@pytest.fixture
def sdk(llama: str, tmp_path: Path) -> Iterator[tuple[openai.OpenAI, Journal]]:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": llama + "/v1",
                                  "CTXPROXY_NULL_CONTENT": "empty"})
    with (serve_in_thread(create_app(settings)) as proxy,
          openai.OpenAI(base_url=proxy + "/v1", api_key="sk-test", max_retries=0, timeout=300) as client):
        yield client, Journal(settings.data_path / "journal.db")


def test_a_real_model_answers_a_response_and_its_chained_follow_up(sdk: tuple[openai.OpenAI, Journal]) -> None:
    client, journal = sdk
    first = client.responses.create(model=MODEL, instructions="You are terse.", input="Name a colour.",
                                    max_output_tokens=16)
    assert first.output_text.strip() and first.usage is not None and first.usage.input_tokens > 0
    second = client.responses.create(model=MODEL, instructions="You are terse.", input="Another one.",
                                     previous_response_id=first.id, max_output_tokens=16)
    assert second.output_text.strip() and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the chain went up whole
    [session] = journal.sessions()  # the chain continues the conversation: one session
    assert session["requests"] == 2


def test_a_real_model_streams_a_response(sdk: tuple[openai.OpenAI, Journal]) -> None:
    client, _ = sdk
    events = list(client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=16, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")  # incomplete: it hit max_output_tokens
    assert deltas and "".join(deltas) == last.response.output_text  # (llama-cpp-python streams no usage)
