"""The incognito journal is bounded (issue #10, item 4): it forgets whole sessions, least recently used first, past
``incognito_max_bytes`` or ``incognito_max_age``, never one with a request in flight, and gives the memory back."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxproxy.config import load_settings
from ctxproxy.proxy.core.state import sha256_text
from ctxproxy.store import (
    IncomingRequest,
    MemoryJournal,
    OverflowBody,
    RecordedRequest,
    ResponseRecord,
    SessionState,
    record_session_state,
    session_state,
)
from tests.conftest import app_client
from tests.fakes import FakeUpstream, Reply, tool_answer
from tests.test_journal import incoming, run

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat(timespec="milliseconds")


def session_run(i: int, rounds: int = 1, size: int = 20_000) -> list[dict[str, Any]]:
    return run(rounds, opening=f"task {i}", result=f"{i} " + "y" * size)[-1]


def request_at(messages: list[dict[str, Any]], seconds: float, session: str | None = None) -> IncomingRequest:
    req = incoming(messages, session)
    return IncomingRequest(**{**req.__dict__, "received_at": at(seconds)})


def answer(journal: MemoryJournal, rec: RecordedRequest) -> None:
    journal.record_response(ResponseRecord(rec.request_id, 0, "ok", 200, "{}", None, 1.0, 2.0, at(0)))


def journal_at(max_bytes: int, max_age: float, clock: list[float]) -> MemoryJournal:
    return MemoryJournal(max_bytes, max_age, now=lambda: T0 + timedelta(seconds=clock[0]))


def test_the_journal_stays_within_its_size_forgetting_the_oldest_sessions() -> None:
    clock = [0.0]
    journal = journal_at(400_000, 3600, clock)
    for i in range(40):  # 40 sessions of ~20 KB each: ~800 KB unbounded
        clock[0] = i
        answer(journal, journal.record_request(request_at(session_run(i), i, session=f"run-{i:02d}")))
        assert journal.stored_bytes() <= 400_000 + 64_000  # the bound, plus the request just journaled
    kept = sorted(s["id"] for s in journal.sessions())
    assert 5 < len(kept) < 40
    assert kept == [f"run-{i:02d}" for i in range(40 - len(kept), 40)]  # the most recent ones
    assert sorted(journal.forgotten) == [f"run-{i:02d}" for i in range(40 - len(kept))]


def test_sessions_idle_past_the_age_are_forgotten_at_the_next_request() -> None:
    clock = [0.0]
    journal = journal_at(10**9, 60, clock)
    old = journal.record_request(request_at(session_run(1), 0))
    answer(journal, old)
    clock[0] = 30
    answer(journal, journal.record_request(request_at(session_run(2), 30)))
    assert len(journal.sessions()) == 2
    clock[0] = 61
    answer(journal, journal.record_request(request_at(session_run(3), 61)))
    assert old.session_id not in {s["id"] for s in journal.sessions()} and len(journal.sessions()) == 2
    assert list(journal.forgotten) == [old.session_id]


def test_forgetting_sessions_forgets_the_prefix_index_rows_kept() -> None:
    """The lists forgotten go with them; a new list may take one of their ids (``store.prefixes._digest_row``)."""
    clock = [0.0]
    journal = journal_at(10**9, 60, clock)
    history = session_run(1, rounds=3)
    answer(journal, journal.record_request(request_at(history, 0)))
    answer(journal, journal.record_request(request_at([*history[:2], {"role": "user", "content": "again"}], 1)))
    assert journal.digest_rows
    clock[0] = 120
    answer(journal, journal.record_request(request_at(session_run(2), 120)))
    assert journal.forgotten and journal.digest_rows == {}


def test_a_session_with_a_request_in_flight_is_never_forgotten() -> None:
    clock = [0.0]
    journal = journal_at(64 * 1024, 1, clock)
    waiting = journal.record_request(request_at(session_run(0, size=50_000), 0))  # no answer yet
    for i in range(1, 10):
        clock[0] = 100 * i
        answer(journal, journal.record_request(request_at(session_run(i), 100 * i)))
    assert journal.session(waiting.session_id) is not None
    answer(journal, waiting)


def test_a_forgotten_session_takes_its_forks_cut_bodies_and_unshared_blobs_with_it() -> None:
    clock = [0.0]
    journal = journal_at(10**9, 60, clock)
    parent = journal.record_request(request_at(run(2)[-1], 0))
    answer(journal, parent)
    edited = [*run(2)[-1][:3], {"role": "tool", "tool_call_id": "c0", "content": "edited"}]
    child = journal.record_request(request_at(edited, 1))  # forks: delta-encoded against the parent's list
    answer(journal, child)
    assert journal.session(child.session_id)["parent_id"] == parent.session_id  # type: ignore[index]
    body = "cut " * 1000
    journal.add_decisions(child.session_id, [], at(1), child.request_id,
                          [OverflowBody(sha256_text(body), body, "sh", "c0")])
    record_session_state(journal, child.session_id, child.request_id,
                         SessionState("user:t", "user:t", ("applied",), "/ws/LIVE_CONTEXT.json", body + "{}"), at(1))
    assert journal.overflow_body(sha256_text(body), child.session_id) is not None
    clock[0] = 200
    survivor = journal.record_request(request_at(session_run(7), 200))
    answer(journal, survivor)
    assert [s["id"] for s in journal.sessions()] == [survivor.session_id]
    assert journal.overflow_body(sha256_text(body)) is None
    assert session_state(journal, child.session_id) == SessionState()
    assert journal.conn.execute("SELECT COUNT(*) FROM session_state").fetchone()[0] == 0
    assert journal.conn.execute("PRAGMA foreign_key_check").fetchall() == []
    blobs = journal.conn.execute("SELECT count(*) FROM blobs").fetchone()[0]
    assert blobs == len(session_run(7)) + 1  # the survivor's messages and its parameters: nothing else
    assert journal.request(survivor.request_id)["messages"] == session_run(7)  # type: ignore[index]
    assert journal.conn.execute("PRAGMA freelist_count").fetchone()[0] == 0  # the pages went back


@settings(max_examples=30)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.booleans()), min_size=1, max_size=25))
def test_forgetting_never_breaks_what_remains(steps: list[tuple[int, int, bool]]) -> None:
    """Runs that grow, fork and go idle in any order: every remaining request still rebuilds, nothing dangles."""
    clock = [0.0]
    journal = journal_at(48 * 1024, 50, clock)
    for n, (opening, rounds, edit) in enumerate(steps):
        clock[0] = 10.0 * n
        messages = run(rounds, opening=f"task {opening}", result="z" * 3000)[-1]
        if edit and len(messages) > 2:
            messages = [*messages[:-1], {**messages[-1], "content": f"edited {n}"}]
        rec = journal.record_request(request_at(messages, 10.0 * n))
        answer(journal, rec)
        assert journal.request(rec.request_id)["messages"] == messages  # type: ignore[index]
    assert journal.conn.execute("PRAGMA foreign_key_check").fetchall() == []
    for (request_id,) in journal.conn.execute("SELECT id FROM requests").fetchall():
        assert journal.request(request_id) is not None


def test_incognito_traffic_no_longer_grows_memory_for_good(tmp_path: Path) -> None:
    """The defect: 60 incognito requests of 1 MB added 180 MB of RSS for good. Here 40 sessions of 200 KB
    (8 MB) against a 1 MB bound: the in-memory journal's size is the measure."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_INCOGNITO_MAX_BYTES": str(1024 * 1024)})
    with app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as client:
        journal = client.app.state.ctx.incognito_journal.journal  # type: ignore[attr-defined]
        for i in range(40):
            messages = session_run(i, size=200_000)
            response = client.post("/v1/chat/completions", headers={"X-Ctx-Incognito": "1"},
                                   json={"model": "m", "messages": messages})
            assert response.status_code == 200
            assert journal.stored_bytes() <= 1024 * 1024 + 1024 * 1024  # the bound, plus one request's worth
        assert 1 <= len(journal.sessions()) <= 6
        assert client.get("/ctx/sessions").json()["sessions"] == []  # and nothing went to disk


def test_the_in_memory_journal_is_opened_by_the_first_incognito_request(tmp_path: Path) -> None:
    """Opening it (an in-memory database and its migrations) took 9 ms of every start: a server that journals
    every request to disk never opens it, and the first incognito request does, that request's own row in it."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1"})
    with app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as client:
        state = client.app.state.ctx  # type: ignore[attr-defined]
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert state._incognito is None
        assert client.post("/v1/chat/completions", headers={"X-Ctx-Incognito": "1"}, json=body).status_code == 200
        assert state._incognito is not None and len(state.incognito_journal.journal.sessions()) == 1


def test_reading_a_forgotten_cut_says_it_is_gone(tmp_path: Path) -> None:
    """A stub of a forgotten incognito session names a body that is gone; read_overflow says so and why."""
    fake = FakeUpstream()
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1"})
    gone = sha256_text("a body this session's journal forgot")
    fake.enqueue(Reply(body=tool_answer(("read_overflow", {"id": gone}))))
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        response = client.post("/v1/chat/completions", headers={"X-Ctx-Incognito": "1"},
                               json={"model": "m", "messages": session_run(1)})
    assert response.status_code == 200
    told = [m["content"] for m in fake.last_chat.json()["messages"] if m["role"] == "tool"][-1]
    assert f"no cut content with id {gone}" in told and "incognito" in told and "cannot be restored" in told


def test_a_failure_to_forget_is_logged_never_the_requests(caplog: pytest.LogCaptureFixture) -> None:
    clock = [0.0]
    journal = journal_at(10**9, 1, clock)
    first = journal.record_request(request_at(session_run(1), 0))
    answer(journal, first)
    with journal.conn:  # something the forgetting does not know of still refers to the session
        journal.conn.execute("CREATE TABLE holds (session_id TEXT REFERENCES sessions(id))")
        journal.conn.execute("INSERT INTO holds VALUES (?)", [first.session_id])
    clock[0] = 100
    later = journal.record_request(request_at(session_run(2), 100))
    assert journal.request(later.request_id) is not None
    assert journal.session(first.session_id) is not None  # rolled back whole, not half forgotten
    assert "could not forget" in caplog.text and list(journal.forgotten) == []
