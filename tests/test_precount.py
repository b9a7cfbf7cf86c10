"""A request's newest tool results are counted beside its journaling (``proxy.engine.precount``): each once, on a
thread, only those the projection would count as they came, and nothing the proxy sends or journals changes."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

import ctxproxy.proxy.edge.chat as chat
from ctxproxy.config import load_settings
from ctxproxy.proxy.core.tokens import MessageCounter, TextCounter
from ctxproxy.proxy.engine.precount import PRECOUNT_CHARS
from ctxproxy.proxy.engine.state import AppState, Warmup
from tests.conftest import app_client
from tests.fakes import FakeUpstream

WINDOW = 131072
"""Its budget spills results from about 10 000 characters on (``Limits.for_window``)."""


class NotingThreads:
    """The proxy's text counter, noting each text it counts and the thread that asked."""

    def __init__(self, inner: TextCounter) -> None:
        self.inner = inner
        self.calls: list[tuple[str, str]] = []

    @property
    def name(self) -> str:
        return self.inner.name

    def count(self, text: str) -> int:
        self.calls.append((text, threading.current_thread().name))
        return self.inner.count(text)

    def threads(self, text: str) -> list[str]:
        return [thread for counted, thread in self.calls if counted == text]


def _settings(path: Path, window: int | None = WINDOW) -> Any:
    env = {"CTXPROXY_DATA_DIR": str(path), "CTXPROXY_UPSTREAM": "http://u.test/v1"}
    return load_settings(env=env | ({"CTXPROXY_CTX_WINDOW": str(window)} if window else {}))


def _noting(client: TestClient) -> NotingThreads:
    state: AppState = client.app.state.ctx  # type: ignore[attr-defined]
    counter: Future[MessageCounter] = Future()
    counter.set_result(MessageCounter(NotingThreads(state.counter.text_counter)))
    state.warmup = Warmup(counter)
    return state.counter.text_counter  # type: ignore[return-value]


@pytest.fixture
def noting(tmp_path: Path) -> Iterator[tuple[TestClient, NotingThreads]]:
    with app_client(_settings(tmp_path), httpx.ASGITransport(app=FakeUpstream())) as client:
        yield client, _noting(client)


def result(k: int, chars: int) -> str:
    """A tool result of ``chars`` characters, different for each ``k``."""
    text = f"output of step {k}\n" + "".join(f"line {i}: value {i * 7 + k}\n" for i in range(chars // 10))
    return text[:chars]


def rounds(*sizes: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                      {"role": "user", "content": "Fix the failing test."}]
    for k, size in enumerate(sizes):
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": "sh", "arguments": f'{{"n": {k}}}'}}]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": result(k, size)}]
    return messages


def _send(client: TestClient, messages: list[dict[str, Any]]) -> None:
    response = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": messages})
    assert response.status_code == 200, response.text


def test_a_new_result_is_counted_once_on_a_thread_not_on_the_loop(noting: tuple[TestClient, NotingThreads]) -> None:
    client, text = noting
    _send(client, rounds(6000)[:2])
    _send(client, rounds(6000))
    loop = text.threads("Fix the failing test.")
    assert len(loop) == 1
    assert len(text.threads(result(0, 6000))) == 1
    assert text.threads(result(0, 6000)) != loop  # counted beside the journal's write, on another thread
    _send(client, rounds(6000, 300))  # the next request finds it in the cache; a short result is counted on the loop
    assert len(text.threads(result(0, 6000))) == 1
    assert text.threads(result(1, 300)) == loop


def test_a_result_that_spills_or_is_short_is_not_counted_ahead(noting: tuple[TestClient, NotingThreads]) -> None:
    client, text = noting
    _send(client, rounds(30_000, PRECOUNT_CHARS - 1))
    assert text.threads(result(0, 30_000)) == []  # spilled as it came: its stub is counted, never the original
    assert text.threads(result(1, PRECOUNT_CHARS - 1)) == text.threads("Fix the failing test.")


def test_nothing_is_counted_ahead_while_the_window_is_not_known(tmp_path: Path) -> None:
    with app_client(_settings(tmp_path, window=None), httpx.ASGITransport(app=FakeUpstream())) as client:
        text = _noting(client)
        _send(client, rounds(5000))  # the window is asked of the upstream when planning: not known at arrival
        first = text.threads(result(0, 5000))
        assert first == text.threads("Fix the failing test.")
        _send(client, rounds(5000, 5000))  # known from the first request on
        assert text.threads(result(1, 5000)) not in ([], first)


def _sent_and_estimated(path: Path, precounting: bool,
                        monkeypatch: pytest.MonkeyPatch) -> tuple[list[bytes], list[Any]]:
    fake = FakeUpstream()
    with monkeypatch.context() as patch:
        if not precounting:
            patch.setattr(chat, "precount", lambda *args: None)
        with app_client(_settings(path), httpx.ASGITransport(app=fake)) as client:
            sizes = [3000, 9000, 12_000, 2500, 7000, 4000]
            for k in range(1, len(sizes) + 1):
                _send(client, rounds(*sizes[:k]))
    with sqlite3.connect(path / "journal.db") as db:
        estimates = db.execute("SELECT estimate FROM forwards ORDER BY id").fetchall()
    return [r.body for r in fake.chats], estimates


def test_what_goes_upstream_and_the_estimates_are_the_same_without_it(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with_it = _sent_and_estimated(tmp_path / "with", True, monkeypatch)
    without = _sent_and_estimated(tmp_path / "without", False, monkeypatch)
    assert with_it == without
    assert len(with_it[0]) == 6 and any(e != (None,) for e in with_it[1])
