"""The per-request cost of an ordinary request: what the proxy recomputes when a request carries new text.

The peers' latency method sends the same history with a new user message each time, so every request is a fork
of the last one and its projection is recomputed from the session's decisions. What was counted or serialised
for an earlier request must not be done again: these tests count the work, never time it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from starlette.testclient import TestClient

from ctxproxy.config import load_settings
from ctxproxy.proxy.core.tokens import Calibration, MessageCounter, TextCounter
from ctxproxy.proxy.engine.context import SessionContexts
from ctxproxy.proxy.engine.state import AppState, Warmup
from ctxproxy.store import Journal, JournalWriter
from tests.conftest import app_client
from tests.fakes import FakeUpstream
from tests.test_journal import incoming, record

T = TypeVar("T")


class CountingText:
    """A real text counter that delegates to the proxy's and remembers what it was asked to count."""

    def __init__(self, inner: TextCounter) -> None:
        self.inner = inner
        self.texts: list[str] = []

    @property
    def name(self) -> str:
        return self.inner.name

    def count(self, text: str) -> int:
        self.texts.append(text)
        return self.inner.count(text)


def history(rounds: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                      {"role": "user", "content": "Fix the failing test."}]
    for k in range(rounds):
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": "sh", "arguments": f'{{"n": {k}}}'}}]})
        messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": f"output {k}\n" + "word " * 900})
    return messages


@pytest.fixture
def small_window(tmp_path: Path) -> Iterator[tuple[TestClient, CountingText]]:
    """The app at an 8k window (a 20-round history gets its oldest results elided), tokenizer calls recorded."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "8192"})
    with app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as client:
        state: AppState = client.app.state.ctx  # type: ignore[attr-defined]
        counting: Future[MessageCounter] = Future()  # the counter the warm-up hands out, its tokenizer recorded
        counting.set_result(MessageCounter(CountingText(state.counter.text_counter)))
        state.warmup = Warmup(counting)
        yield client, state.counter.text_counter  # type: ignore[misc]


def _send(client: TestClient, messages: list[dict[str, Any]]) -> None:
    response = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": messages})
    assert response.status_code == 200, response.text


def test_a_request_with_new_text_counts_only_its_new_message(small_window: tuple[TestClient, CountingText]) -> None:
    client, text = small_window
    messages = history(20)
    for k in range(1, 21):
        _send(client, messages[:2 + 2 * k])
    _send(client, [*messages, {"role": "user", "content": "continue (nonce 0)"}])
    text.texts.clear()
    for i in (1, 2):  # each forks the last: its projection is recomputed, its stubs must come from the cache
        _send(client, [*messages, {"role": "user", "content": f"continue (nonce {i})"}])
    assert text.texts == ["continue (nonce 1)", "continue (nonce 2)"]


def _nested(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(("field", "where"), [("messages", "`messages[1].content[0].text"), ("metadata", "`metadata")])
def test_a_body_nested_too_deep_to_write_is_refused_before_it_is_journaled(
        client: TestClient, fake: FakeUpstream, field: str, where: str) -> None:
    """orjson reads 1024 levels and writes 254: the body is not re-serialised whole to find out, its new parts
    are, on their way to the journal; the refusal still names where and nothing is stored or forwarded."""
    deep = {"type": "text", "text": _nested(300)}
    messages: list[Any] = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    body: dict[str, Any] = {"model": "fake-model", "messages": messages}
    _send(client, messages)
    if field == "messages":
        body["messages"] = [messages[0], {"role": "user", "content": [deep]}]
    else:
        body["metadata"] = _nested(300)
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert "deeper than 254 levels" in response.json()["error"]["message"]
    assert response.json()["error"]["message"].startswith(where)
    assert len(fake.chats) == 1
    sessions = client.get("/ctx/sessions").json()["sessions"]
    assert sum(s["requests"] for s in sessions) == 1


class CountingWriter(JournalWriter):
    """The real writer, counting its hops to the journal's thread."""

    def __init__(self, journal: Journal) -> None:
        super().__init__(journal)
        self.hops = 0

    async def call(self, method: Callable[..., T], *args: object) -> T:
        self.hops += 1
        return await super().call(method, *args)


def test_a_session_s_context_is_read_back_in_one_hop(tmp_path: Path) -> None:
    """Every fork and new run loads a context: five hops to the journal's thread were five wake-ups and GIL
    hand-offs on the request's path."""
    journal = Journal(tmp_path / "journal.db")
    messages = history(3)
    for k in range(1, 4):
        record(journal, incoming(messages[:2 + 2 * k], n=k))
    forked = journal.record_request(incoming([*messages, {"role": "user", "content": "continue"}], n=9))
    writer = CountingWriter(journal)
    try:
        context = asyncio.run(SessionContexts().get(writer, forked.session_id, "m"))
    finally:
        writer.close()
    assert writer.hops == 1
    assert context.decisions == [] and context.calibration("m") == Calibration() and context.mirror is None


class CountingMessages(MessageCounter):
    """The proxy's message counter, saying how many messages it was asked for (a cached count included)."""

    def __init__(self, text: TextCounter) -> None:
        super().__init__(text)
        self.calls = 0

    def count(self, message: dict[str, Any], key: str | None = None) -> int:
        self.calls += 1
        return super().count(message, key)


def _forked_upstream(tmp_path: Path, evict_parent: bool) -> tuple[bytes, int, int]:
    """A 20-round session at 8k (its old results elided), then a fork that edits a result 5 messages back: the
    body the fork sent upstream, how many messages its projection counted, how many its forward list added."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "8192"})
    fake = FakeUpstream()
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        state: AppState = client.app.state.ctx  # type: ignore[attr-defined]
        counter = CountingMessages(state.counter.text_counter)
        counting: Future[MessageCounter] = Future()
        counting.set_result(counter)
        state.warmup = Warmup(counting)
        messages = history(20)
        for k in range(1, 21):
            _send(client, messages[:2 + 2 * k])
        if evict_parent:
            for session in client.get("/ctx/sessions").json()["sessions"]:
                state.contexts.drop(state.journal, session["id"])
        fork = list(messages)
        fork[-5] = fork[-5] | {"content": "edited\n" + fork[-5]["content"]}
        counter.calls = 0
        _send(client, fork)
        added = state.journal.journal.conn.execute(  # the fork's forward list: what it adds to its base
            "SELECT l.length - l.base_len FROM forwards f JOIN message_lists l ON l.id = f.list_id"
            " ORDER BY f.id DESC LIMIT 1").fetchone()[0]
        return fake.last_chat.body, counter.calls, added


def test_a_fork_starts_from_its_parents_state_and_sends_what_a_recomputation_sends(tmp_path: Path) -> None:
    """A fork of a session whose context is in memory ingests only its own messages (its parent's state cut to the
    history they share, ``proxy.core.forked``) and journals its forward list against the parent's last; the bytes
    it sends upstream are those of a fork projected from the decisions (the parent's context evicted)."""
    sent, counted, added = _forked_upstream(tmp_path / "kept", evict_parent=False)
    recomputed, recounted, readded = _forked_upstream(tmp_path / "evicted", evict_parent=True)
    assert sent == recomputed
    assert recounted - counted == len(history(20)) - 5  # the 37 messages it shares with its parent: not ingested
    assert added <= 5 + 2 < readded  # its forward list: a delta against the parent's last, not its own request
