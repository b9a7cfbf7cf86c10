"""The per-request cost of an ordinary request: what the proxy recomputes when a request carries new text.

The peers' latency method sends the same history with a new user message each time, so every request is a fork
of the last one and its projection is recomputed from the session's decisions. What was counted or serialised
for an earlier request must not be done again: these tests count the work, never time it.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from starlette.requests import Request
from starlette.testclient import TestClient

from ctxproxy.config import load_settings
from ctxproxy.proxy.core.identity import message_hash
from ctxproxy.proxy.core.project import _out_hash, absorbed_state
from ctxproxy.proxy.core.tokens import Calibration, MessageCounter, TextCounter
from ctxproxy.proxy.edge.chat import url_path
from ctxproxy.proxy.engine.budgets import budget_for
from ctxproxy.proxy.engine.context import SessionContexts, _read_back, read_new_session
from ctxproxy.proxy.engine.exchange import iso_ms, target_of
from ctxproxy.proxy.engine.state import AppState, Warmup
from ctxproxy.store import (
    ForwardRecord,
    Journal,
    JournalWriter,
    ResponseRecord,
    SessionState,
    claim,
    record_session_state,
)
from ctxproxy.store.reads import chain_hashes
from ctxproxy.store.sql import SqliteConnection
from tests.conftest import app_client
from tests.fakes import FakeUpstream
from tests.test_journal import incoming, record
from tests.test_settings import PROFILES, write

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


def _send(client: TestClient, messages: list[dict[str, Any]], **fields: Any) -> None:
    response = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": messages, **fields})
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


class Witness(FakeUpstream):
    """An upstream that notes, as each chat arrives, what ``seen`` holds then."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen
        self.at_arrival: list[list[str]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
            self.at_arrival.append(list(self.seen))
        await super().__call__(scope, receive, send)


def test_a_forward_s_tally_is_counted_once_its_answer_has_left_not_before_it_goes(tmp_path: Path) -> None:
    """What a projection cut is tallied for the metrics and the log line only (0.7 ms a request of a long
    session at 128k, looking up its ~800 cut messages): the forward goes upstream first, and the tally, counted
    after the answer, still gives the metrics what the cuts freed."""
    seen: list[str] = []
    fake = Witness(seen)
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "8192"})
    messages = history(20)
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        counter = client.app.state.ctx.counter  # type: ignore[attr-defined]
        looked_up = counter.known_all
        counter.known_all = lambda keys: (seen.append("tally"), looked_up(keys))[1]
        for k in range(1, 21):
            _send(client, messages[:2 + 2 * k])
        freed = client.get("/metrics").text
    assert all(before == ["tally"] * k for k, before in enumerate(fake.at_arrival))  # each after the one before
    assert seen == ["tally"] * 20
    spilled = re.search(r'^ctxproxy_tokens_freed_total\{by="auto",kind="spill"\} ([0-9.]+)$', freed, re.MULTILINE)
    assert spilled is not None and float(spilled[1]) > 0


SH_TOOL = {"type": "function", "function": {"name": "sh", "description": "run a shell command",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}


@pytest.mark.parametrize("fenced", [False, True])
def test_the_proxy_s_own_texts_are_counted_once_not_per_request(small_window: tuple[TestClient, CountingText],
                                                                 fenced: bool) -> None:
    """What the schema of ``read_overflow`` (listed once a session holds a stub) or the fenced route's note
    cost never changes: counted again on each request, it was 6% of a small new-text request's time."""
    client, text = small_window
    messages = history(20)
    if fenced:  # an agent that calls its tools in text blocks: the fenced route, told the syntax in a note
        messages = [{"role": "user" if m["role"] == "tool" else m["role"], "content": m["content"] or
                     f"THOUGHT: look again\n\n```bash\nls -{k}\n```"} for k, m in enumerate(messages)]
    tools = {} if fenced else {"tools": [SH_TOOL]}
    for k in range(1, 21):
        _send(client, messages[:2 + 2 * k], **tools)
    _send(client, [*messages[:2], {"role": "user", "content": "continue (nonce 0)"}], **tools)
    text.texts.clear()
    for i in (1, 2):  # the peers' small request: a new run of the opening, which inherits the long run's cuts
        _send(client, [*messages[:2], {"role": "user", "content": f"continue (nonce {i})"}], **tools)
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
    """The real writer, counting the journal calls it runs, on the loop (``call_here``) or on its thread."""

    def __init__(self, journal: Journal) -> None:
        super().__init__(journal)
        self.hops = 0
        self.names: list[str] = []

    def _checked(self, journal: Journal, method: Callable[..., T], args: tuple[object, ...], held: bool = False,
                 locked: bool = False) -> T:
        self.hops += 1
        self.names.append(method.__name__)
        return super()._checked(journal, method, args, held=held, locked=locked)


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


def test_a_new_run_is_journaled_and_its_context_read_back_in_one_hop(tmp_path: Path) -> None:
    """A request that opens a session (a new run, a fork: every request of the peers' benchmark) has no context
    in memory: it is read back in the same call on the journal's thread as the request row, not one more."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "8192"})
    with app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as client:
        state: AppState = client.app.state.ctx  # type: ignore[attr-defined]
        messages = history(20)
        for k in range(1, 21):
            _send(client, messages[:2 + 2 * k])
        state.journal = writer = CountingWriter(state.journal.journal)
        try:
            for i in range(2):
                _send(client, [*messages[:2], {"role": "user", "content": f"continue (nonce {i})"}])
        finally:
            writer.close()
    assert "_read_back" not in writer.names and writer.names.count("record_request_and_read") == 2


def test_a_forward_of_the_request_s_own_messages_is_journaled_with_its_answer(tmp_path: Path) -> None:
    """A new run of a session whose results were cut goes upstream with its messages as they came, and the
    context tools listed: nothing in its forward row is new (no decision, no cut body; the list is the request's
    own), so it is written in the answer's transaction, and the request's path makes two hops to the journal's
    thread, not three (after the opening's first new run, which reads the decisions the runs inherit). The row
    still says what went: the request's list, not verbatim."""
    fake = FakeUpstream()
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "8192"})
    tools = [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object"}}}]
    opening = history(20)
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        state: AppState = client.app.state.ctx  # type: ignore[attr-defined]
        for k in range(1, 21):
            _send(client, opening[:2 + 2 * k], tools=tools)
        state.journal = writer = CountingWriter(state.journal.journal)
        new_run = [*opening[:2], {"role": "user", "content": "another task"}]
        try:
            _send(client, [*opening[:2], {"role": "user", "content": "a first new run"}], tools=tools)
            writer.names.clear()
            _send(client, new_run, tools=tools)
        finally:
            writer.close()
        sent = fake.last_chat.json()
    assert writer.names == ["record_request_and_read", "record_response"]
    assert sent["messages"] == new_run and len(sent["tools"]) > 1  # the context tools listed beside the agent's
    journal = Journal(tmp_path / "journal.db")
    try:
        row = journal.conn.execute("SELECT f.verbatim, f.list_id, r.list_id FROM forwards f JOIN requests r"
                                   " ON r.id = f.request_id ORDER BY f.id DESC LIMIT 1").fetchone()
    finally:
        journal.close()
    assert row[0] == 0 and row[1] == row[2]


def test_a_large_body_s_messages_go_upstream_as_their_bytes_came_when_only_the_tools_change(tmp_path: Path) -> None:
    """A 47 KB new run of a session whose results were cut: its messages go as they came, the context tools listed
    beside the agent's. The messages are not serialised again (0.3 ms of a 630 KB body): their bytes are the
    client's own, spaced and escaped as it sent them, in a body that parses to the same request."""
    fake = FakeUpstream()
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "32768"})
    tools = [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object"}}}]
    opening = history(20)
    talk = [m for i in range(14) for m in ({"role": "user", "content": f"q{i} " + "é ab " * 250},
                                            {"role": "assistant", "content": f"a{i} " + "cd " * 250})]
    new_run = [*opening[:2], *talk, {"role": "user", "content": "another task"}]
    as_sent = json.dumps(new_run, indent=2).encode()  # spaced, and é escaped: not what orjson writes
    raw = b'{"model": "fake-model", "tools": ' + json.dumps(tools).encode() + b', "messages": ' + as_sent + b"}"
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        for k in range(1, 21):
            _send(client, opening[:2 + 2 * k], tools=tools)
        response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    sent = fake.last_chat.json()
    assert sent["messages"] == new_run and len(sent["tools"]) > 1 and sent["model"] == "fake-model"
    assert as_sent in fake.last_chat.body


def test_a_new_run_is_claimed_in_the_call_that_journals_it(tmp_path: Path) -> None:
    """A session opened by its opening is claimed (``store.claims``) in the call that journals its request, not in
    a hop of its own once its lock is taken: nothing can join it before its answer. Its next request, handled by
    the same process, still finds its memory valid (no read back)."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "8192"})
    with app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as client:
        state: AppState = client.app.state.ctx  # type: ignore[attr-defined]
        messages = history(3)
        _send(client, messages[:4])
        state.journal = writer = CountingWriter(state.journal.journal)
        try:
            _send(client, [*messages[:2], {"role": "user", "content": "continue (nonce 1)"}])
            opened = writer.names[:]
            _send(client, [*messages[:2], {"role": "user", "content": "continue (nonce 1)"},
                           {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}])
        finally:
            writer.close()
    assert opened[0] == "record_request_and_read" and "claim" not in opened and "_read_back" not in opened
    assert writer.names[len(opened)] == "record_request_and_read" and "claim" in writer.names[len(opened):]
    assert "_read_back" not in writer.names


def test_a_named_session_is_claimed_under_its_lock_not_when_it_opens(tmp_path: Path) -> None:
    """Two requests of a new named session in parallel: the second joins the session before the first took its
    lock, and may take it first. Had the first claimed the session when it opened it, the second's claim would
    find an unanswered holder and journal it as abandoned (``store.claims``) while it waits for the lock."""
    journal = Journal(tmp_path / "journal.db")
    try:
        first = journal.record_request(incoming(history(1)[:2], session="named"))
        assert first.created
        saved = read_new_session("m", named=True)(journal, first)
        assert saved is not None and not saved.claimed
        second = journal.record_request(incoming(history(2)[:4], session="named", n=1))
        assert second.session_id == first.session_id
        assert claim(journal, "named", second.request_id) is None
        assert journal.conn.execute("SELECT COUNT(*) FROM responses WHERE request_id = ?",
                                    [first.request_id]).fetchone()[0] == 0
        again = journal.record_request(incoming(history(3)[:6], session="named", n=2), claim_opened=True)
        assert claim(journal, "named", again.request_id) == second.request_id  # a named session: not at opening
        opened = journal.record_request(incoming([*history(1)[:2], {"role": "user", "content": "x"}], n=3),
                                        claim_opened=True)
        saved = read_new_session("m", named=False)(journal, opened)
        assert saved is not None and saved.claimed
        assert claim(journal, opened.session_id, opened.request_id) == opened.request_id
    finally:
        journal.close()


def test_a_new_run_is_claimed_in_the_transaction_of_its_request_row(tmp_path: Path) -> None:
    """The claim of a session opened by its opening is written by the request's own transaction, not by one more
    after it (each commit is a WAL append on the journal's thread, on every request of the peers' benchmark)."""
    journal = Journal(tmp_path / "journal.db")
    try:
        messages = history(1)
        record(journal, incoming(messages))
        commits: list[str] = []
        assert isinstance(journal.conn, SqliteConnection)
        journal.conn.raw.set_trace_callback(lambda s: commits.append(s) if s.strip().upper() == "COMMIT" else None)
        read = read_new_session("m", named=False)
        opened, saved = journal.record_request_and_read(
            incoming([*messages[:2], {"role": "user", "content": "continue (nonce 1)"}], n=1), read, True)
        journal.conn.raw.set_trace_callback(None)
        assert opened.created and saved is not None and saved.claimed and len(commits) == 1
        assert claim(journal, opened.session_id, opened.request_id) == opened.request_id
    finally:
        journal.close()


def test_a_new_run_shares_only_the_ancestors_that_hold_decisions(tmp_path: Path) -> None:
    """Runs forking runs (the peers' method: each request a new run of the last) make a chain of up to 64
    ancestors, most with no decision of their own: each was a step of the read back and an entry pushing the long
    run's shared decisions out of ``SessionContexts``."""
    journal = Journal(tmp_path / "journal.db")
    messages = history(2)
    long = record(journal, incoming(messages))
    cut = {"kind": "spill", "target": "tool:call_0", "message_hash": "h", "replacement": "stub", "overflow_id": "",
           "until": "", "count": 0, "source": "auto"}
    journal.add_decisions(long.session_id, [cut], "t")
    last = long
    for i in range(10):
        last = record(journal, incoming([*messages[:2], {"role": "user", "content": f"continue (nonce {i})"}], n=i))
    writer, contexts = JournalWriter(journal), SessionContexts()
    try:
        context = asyncio.run(contexts.get(writer, last.session_id, "m"))
    finally:
        writer.close()
    assert [d.target for d in context.decisions] == ["tool:call_0"]
    assert [key[2] for key in contexts._shared] == [long.session_id]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/", "/v1/a?b#c\\d", "/v1/é ü"])
def test_the_journaled_path_is_starlette_s_url_path(path: str) -> None:
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"x=1", "root_path": "",
             "headers": [(b"host", b"proxy.test:8080")], "server": ("127.0.0.1", 8080), "scheme": "http"}
    assert url_path(Request(scope)) == Request(scope).url.path


def test_a_session_just_opened_reads_back_as_the_full_read_would(tmp_path: Path) -> None:
    """``read_new_session`` skips the reads of what a session has only once its requests made it (forwards,
    answers, decisions, mirror revisions, working state): a fork of a session that has all of them reads back the
    same as the full read, and an existing session would not."""
    journal = Journal(tmp_path / "journal.db")
    try:
        messages = history(2)
        parent = journal.record_request(incoming(messages))
        params = incoming(messages).params_hash
        journal.record_forward(ForwardRecord(parent.request_id, 0, parent.session_id, "t", params, verbatim=True,
                                             estimate=900, k=1.2, samples=3))
        journal.record_response(ResponseRecord(parent.request_id, 0, "ok", 200, "{}", {"prompt_tokens": 1000}, 1.0,
                                               2.0, "t"))
        cut = {"kind": "spill", "target": "tool:call_0", "message_hash": "h", "replacement": "stub",
               "overflow_id": "", "until": "", "count": 0, "source": "auto"}
        journal.add_decisions(parent.session_id, [cut], "t")
        record_session_state(journal, parent.session_id, parent.request_id,
                             SessionState("turn", "turn", ("done",), "/m.json", "{}"), "t")
        fork = journal.record_request(incoming([*messages[:2], {"role": "user", "content": "continue (nonce 1)"}]))
        read = read_new_session("m", named=False)(journal, fork)
        assert read is not None and read.claimed and read.latest is not None and read.ancestors
        assert replace(read, claimed=False) == _read_back(journal, fork.session_id, "m", None)
        again = journal.record_request(incoming(messages, n=1))
        assert not again.created and read_new_session("m", named=False)(journal, again) is None
        assert _read_back(journal, parent.session_id, "m", None).state.offered_turn == "turn"
    finally:
        journal.close()


def test_an_answer_is_written_without_looking_for_other_writers_who_are_still_noticed(tmp_path: Path) -> None:
    """Every call on the journal's thread first read ``PRAGMA data_version`` (a round trip on PostgreSQL): three a
    request. A call that only writes (a forward, an answer) reads nothing the process remembers; the next call that
    reads still sees what another process wrote in between (here a prune)."""
    journal = Journal(tmp_path / "journal.db")
    statements: list[str] = []
    journal.conn.raw.set_trace_callback(statements.append)  # type: ignore[attr-defined]
    writer = JournalWriter(journal)

    async def go() -> None:
        recorded = await writer.call(Journal.record_request, incoming(history(1)))
        before, statements[:] = writer.generation, []
        await writer.call(Journal.record_response, ResponseRecord(recorded.request_id, 0, "ok", 200, "{}", None, 1.0,
                                                                  2.0, "t"))
        assert statements and not [s for s in statements if "data_version" in s]
        other = Journal(tmp_path / "journal.db")
        other.prune("9999")  # another process removes every session
        other.close()
        await writer.call(Journal.sessions)
        assert writer.generation == before + 1

    try:
        asyncio.run(go())
    finally:
        writer.close()


def test_the_budget_kept_per_model_and_window_is_the_model_s(tmp_path: Path) -> None:
    """``AppState.budget`` works a budget out once per model and window: each model's profile still gets its own."""
    settings = load_settings(write(tmp_path, PROFILES), {"CTXPROXY_DATA_DIR": str(tmp_path),
                                                         "CTXPROXY_UPSTREAM": "http://u.test/v1"})
    with app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as client:
        state: AppState = client.app.state.ctx  # type: ignore[attr-defined]
        for _ in range(2):
            for model in ("qwen/qwen3-coder-30b", "qwen/qwen2.5", "llama-3", None):
                for window in (131072, 1_000_000):
                    assert state.budget(model, window) == budget_for(settings.for_model(model), window)
        assert state.budget("qwen/qwen2.5", 131072) != state.budget("llama-3", 131072)


@pytest.mark.parametrize(("path", "query"), [("/v1/chat/completions", b""), ("/v1/a?b#c\\d", b"x=1&y=%20"),
                                           ("/v1/é ü", b"q=a#frag"), ("/v1/t\tab\n", b"a=\tb\r")])
def test_the_forwarded_path_and_query_are_starlette_s(path: str, query: bytes) -> None:
    """What the forward sends upstream and the log line names, read from the scope without building the URL."""
    scope = {"type": "http", "method": "POST", "path": path, "query_string": query, "root_path": "",
             "headers": [(b"host", b"proxy.test:8080")], "server": ("127.0.0.1", 8080), "scheme": "http"}
    url = Request(scope).url
    assert target_of(Request(scope)) == (url.path, url.query)


@pytest.mark.parametrize("ns", [0, 999_999, 1_000_000, 1_764_572_400_999_999_999, 1_764_572_401_000_000_000,
                                1_764_572_401_123_456_789, 4_102_444_799_999_000_000])
def test_the_journal_s_time_is_isoformat_s(ns: int) -> None:
    """``now`` formats each second once: the text must be ``isoformat``'s for the same instant, the millisecond
    truncated, across second boundaries and back again (several threads ask)."""
    instant = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=ns // 1000)
    expected = instant.isoformat(timespec="milliseconds")
    assert iso_ms(ns) == expected
    assert iso_ms(ns + 1_000_000_000)[:19] != expected[:19] and iso_ms(ns) == expected


def test_a_stub_s_kept_hash_is_the_hash_of_the_stub() -> None:
    """``project._out_hash`` keeps a stub's hash by (its message's hash, its content): what it returns must be
    ``message_hash`` of the stub, kept or not, and anything but a new content is hashed afresh."""
    message = {"role": "tool", "tool_call_id": "c1", "content": "x" * 5000}
    h = message_hash(message)
    for content in ("[spilled: 5000 chars]", "[spilled: 5000 chars]", "y" * 3000):
        stub = {**message, "content": content}
        assert _out_hash(stub, h, message) == message_hash(stub)
    other = {**message, "tool_call_id": "c2", "content": "[spilled: 5000 chars]"}
    assert _out_hash(other, h, message) == message_hash(other)  # not only its content changed: hashed


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


def test_a_forward_after_a_fold_offers_the_journal_only_bodies_it_lacks(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #13: a forward after a fold is a delta from the fold on, most of it results cut on earlier requests;
    their bodies were stored with the forward this one extends, so only the new ones are serialised and offered
    again (a fold pass at 600 rounds offered ~600). Every forwarded list still reads back whole from the journal."""
    offered: list[ForwardRecord] = []
    record_forward = Journal.record_forward
    monkeypatch.setattr(Journal, "record_forward",
                        lambda self, rec: (offered.append(rec), record_forward(self, rec))[1])
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "4096", "CTXPROXY_SPILL_CHARS": "100000"})
    with app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as client:
        for rounds in range(2, 40):
            _send(client, history(rounds))
    cut = [rec for rec in offered if not rec.verbatim]
    assert any(d["kind"] == "fold" for rec in cut for d in rec.decisions)
    assert all(body is None for rec in cut for h, body in zip(rec.added_hashes, rec.added_bodies, strict=True)
               if h in rec.base_hashes)
    journal = Journal(tmp_path / "journal.db")
    try:
        for (list_id,) in journal.conn.execute("SELECT list_id FROM forwards").fetchall():
            hashes = chain_hashes(journal.conn, list_id)
            stored = {h for (h,) in journal.conn.execute(
                f"SELECT hash FROM blobs WHERE hash IN ({','.join('?' * len(set(hashes)))})", list(set(hashes)))}
            assert stored == set(hashes)
    finally:
        journal.close()


def _new_runs_upstream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, absorbed: bool) -> tuple[list[bytes], int]:
    """A 20-round session at 4k (its old results folded), then three new runs of its opening: the bodies they sent
    upstream, and how often a state was absorbed from the decisions they inherit (``absorbed``: False, never)."""
    import ctxproxy.proxy.engine.context as context

    calls = []
    monkeypatch.setattr(context, "absorbed_state", lambda ds: calls.append(len(ds)) or absorbed_state(ds))
    if not absorbed:
        monkeypatch.setattr(SessionContexts, "absorbed", lambda self, writer, ctx: None)
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "4096"})
    fake = FakeUpstream()
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        messages = history(20)
        for k in range(1, 21):
            _send(client, messages[:2 + 2 * k])
        sent = []
        for i in range(3):
            _send(client, [*messages[:2], {"role": "user", "content": f"continue (nonce {i})"}])
            sent.append(fake.last_chat.body)
    return sent, len(calls)


def test_new_runs_start_from_the_decisions_they_inherit_absorbed_once(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each new run of a long session's opening inherits its decisions; their state before any message is absorbed
    once for all of them (``SessionContexts.absorbed``), and each sends upstream what absorbing them itself sends."""
    with monkeypatch.context() as patched:
        sent, absorbed = _new_runs_upstream(tmp_path / "once", patched, absorbed=True)
    with monkeypatch.context() as patched:
        alone, _ = _new_runs_upstream(tmp_path / "each", patched, absorbed=False)
    assert sent == alone and absorbed == 1
