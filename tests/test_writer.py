"""The journal's writer (``store.writer``): a request path's call runs where it costs least and never waits on the loop.

An idle writer runs the request path's calls on the caller's thread (the hop to the writer thread and back was
~0.2 ms of each, issue #13); anything that could make such a call wait (a call already queued or running, another
process holding the write lock, a sync at each commit) sends it to the writer thread, as before.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from ctxproxy.config import load_settings
from ctxproxy.proxy.engine import shielded
from ctxproxy.proxy.engine.heavy import OFFLOAD_BYTES, OFFLOAD_MESSAGES, WHOLE_MIRROR_CHARS, heavy_journaling
from ctxproxy.proxy.engine.shielded import journaled
from ctxproxy.proxy.errors import StorageError, StorageFull, storage_error
from ctxproxy.store import (
    Journal,
    JournalWriter,
    MirrorShown,
    RecordedRequest,
    ResponseRecord,
    SessionState,
    StateChange,
    checkpoints,
)
from ctxproxy.store.claims import claim
from tests.conftest import app_client
from tests.fakes import FakeUpstream
from tests.test_journal import incoming, run


@pytest.fixture
def placed_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the threads each request was placed on (``Journal.record_request``'s first step)."""
    names: list[str] = []
    place = Journal._place

    def noting(self: Journal, *args: Any) -> Any:
        names.append(threading.current_thread().name)
        return place(self, *args)

    monkeypatch.setattr(Journal, "_place", noting)
    yield names


def _requests(path: Path) -> int:
    with sqlite3.connect(path) as other:
        return int(other.execute("SELECT COUNT(*) FROM requests").fetchone()[0])


def test_an_idle_writer_runs_a_request_on_the_callers_thread_committed(tmp_path: Path, placed_on: list[str]) -> None:
    writer = JournalWriter(Journal(tmp_path / "journal.db"))
    try:
        asyncio.run(writer.call(Journal.record_request, incoming(run(2)[-1])))
        assert placed_on == [threading.current_thread().name]
        assert _requests(tmp_path / "journal.db") == 1  # committed: another connection sees it
        assert not writer.journal.conn.raw.in_transaction
        # at rest the connection waits for no lock: the thread's calls wait (``waiting``), not the loop's
        assert writer.journal.conn.raw.execute("PRAGMA busy_timeout").fetchone()[0] == 0
    finally:
        writer.close()


def test_a_call_queues_behind_one_the_thread_is_running(tmp_path: Path, placed_on: list[str]) -> None:
    """The thread's calls keep their order: one that comes while another runs there runs there, after it."""
    writer, release, order = JournalWriter(Journal(tmp_path / "journal.db")), threading.Event(), []

    def slow(journal: Journal) -> None:  # not a request path's call: always on the thread
        release.wait(10)
        order.append("slow")

    async def both() -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(writer.call(slow))
            await asyncio.sleep(0.05)
            second = group.create_task(writer.call(Journal.record_request, incoming(run(2)[-1])))
            await asyncio.sleep(0.05)
            assert not second.done()
            release.set()
        order.append("request")

    try:
        asyncio.run(both())
    finally:
        writer.close()
    assert order == ["slow", "request"] and placed_on == ["ctxproxy-journal_0"]


def test_a_write_lock_held_elsewhere_sends_the_call_to_the_thread_and_the_loop_runs_on(tmp_path: Path,
                                                                                      placed_on: list[str]) -> None:
    """Another process (a ``ctxproxy prune``) holds the write lock: the call waits for it on the writer thread,
    and the loop keeps serving meanwhile."""
    writer = JournalWriter(Journal(tmp_path / "journal.db"))
    other = sqlite3.connect(tmp_path / "journal.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")

    async def meanwhile() -> float:
        async with asyncio.TaskGroup() as group:
            call = group.create_task(writer.call(Journal.record_request, incoming(run(2)[-1])))
            started, ticks = time.monotonic(), 0
            while time.monotonic() - started < 0.3:
                await asyncio.sleep(0.01)
                ticks += 1
            assert not call.done() and ticks >= 3  # the loop ran on while the call waited (blocked, it would not tick)
            other.execute("ROLLBACK")
        return time.monotonic() - started

    try:
        assert asyncio.run(meanwhile()) < 10
    finally:
        other.close()
        writer.close()
    assert placed_on == ["ctxproxy-journal_0"] and _requests(tmp_path / "journal.db") == 1


def test_an_answer_kept_in_memory_is_written_at_close_once_a_lock_held_elsewhere_goes(tmp_path: Path) -> None:
    """The writer's connection rests without a busy timeout (the loop's calls take the lock at once or go to the
    thread): at close, an answer still kept in memory waits for a ``ctxproxy prune``'s lock, as the thread's calls
    do, rather than failing at once and being lost with the process."""
    writer = JournalWriter(Journal(tmp_path / "journal.db"))
    recorded = asyncio.run(writer.call(Journal.record_request, incoming(run(2)[-1])))
    writer._unwritten.append((ResponseRecord(recorded.request_id, 0, "ok", 200, "{}", None, None, 1.0, "now"),))
    other = sqlite3.connect(tmp_path / "journal.db", isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    threading.Timer(0.3, lambda: other.execute("ROLLBACK")).start()
    try:
        writer.close()
    finally:
        other.close()
    with sqlite3.connect(tmp_path / "journal.db") as check:
        assert check.execute("SELECT COUNT(*) FROM responses").fetchone()[0] == 1


def test_a_journal_synced_at_each_commit_is_written_on_its_thread(tmp_path: Path, placed_on: list[str]) -> None:
    writer = JournalWriter(Journal(tmp_path / "journal.db", "full"))
    try:
        asyncio.run(writer.call(Journal.record_request, incoming(run(2)[-1])))
    finally:
        writer.close()
    assert placed_on == ["ctxproxy-journal_0"]


def test_a_call_that_fails_on_the_callers_thread_leaves_nothing_and_forgets_what_it_read(
        tmp_path: Path, placed_on: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills in the middle of a request: the operator's 507, nothing of the request journaled, no
    transaction left open, what the journal read during it dropped; once there is room, the next call is journaled."""
    journal = Journal(tmp_path / "journal.db")
    pages = journal.conn.execute("PRAGMA page_count").fetchone()[0]
    journal.conn.execute(f"PRAGMA max_page_count = {pages + 2}")  # SQLite's own SQLITE_FULL
    writer = JournalWriter(journal, storage_error)
    forgotten: list[str] = []
    forget = Journal.forget_digests
    monkeypatch.setattr(Journal, "forget_digests", lambda self: (forgotten.append("digests"), forget(self))[1])
    try:
        with pytest.raises(StorageFull):
            asyncio.run(writer.call(Journal.record_request, incoming(run(40, result="y" * 2000)[-1])))
        assert placed_on == [threading.current_thread().name] and forgotten == ["digests"]
        assert _requests(tmp_path / "journal.db") == 0 and not journal.conn.raw.in_transaction
        journal.conn.execute("PRAGMA max_page_count = 1073741823")
        asyncio.run(writer.call(Journal.record_request, incoming(run(40, result="y" * 2000)[-1])))
        assert _requests(tmp_path / "journal.db") == 1
    finally:
        writer.close()


def test_a_call_said_heavy_is_written_on_the_thread(tmp_path: Path, placed_on: list[str]) -> None:
    writer = JournalWriter(Journal(tmp_path / "journal.db"))
    try:
        asyncio.run(writer.call(Journal.record_request, incoming(run(2)[-1]), heavy=True))
    finally:
        writer.close()
    assert placed_on == ["ctxproxy-journal_0"]


def test_the_proxy_journals_a_request_of_many_new_bytes_on_the_thread(tmp_path: Path, placed_on: list[str]) -> None:
    """A request whose new bytes are parsed on the worker (``proxy.engine.heavy``: here, 5000 new messages) is
    journaled on the writer thread: storing them would otherwise hold the loop, and every other client, as long."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "1000000"})
    small = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    large = {"model": "m", "messages": [{"role": ("user", "assistant")[i % 2], "content": f"m{i}"}
                                        for i in range(5001)]}
    with app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as client:
        for body in (small, large):
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert placed_on[0] != "ctxproxy-journal_0" and placed_on[1] == "ctxproxy-journal_0"


def test_a_forward_that_stores_a_large_cut_body_is_journaled_on_the_thread(tmp_path: Path, placed_on: list[str],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1.5 MB tool result, spilled: the forward stores it whole, on the writer thread (``ForwardRecord.new_bytes``);
    the next request, which adds a few bytes to it, is journaled on the loop, forward and all."""
    forwarded: list[str] = []
    write_forward = Journal.write_forward
    monkeypatch.setattr(Journal, "write_forward", lambda self, rec: (
        forwarded.append(threading.current_thread().name), write_forward(self, rec))[1])
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "32768"})
    call = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}
    messages = [{"role": "user", "content": "read it"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "line of a log\n" * (3 << 17)}]
    with app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as client:
        after = [{"role": "assistant", "content": "done"}, {"role": "user", "content": "ok"}]
        for body in (messages, [*messages, *after]):
            assert client.post("/v1/chat/completions", json={"model": "m", "messages": body}).status_code == 200
    assert forwarded[0] == placed_on[0] == "ctxproxy-journal_0"
    assert forwarded[1] == placed_on[1] != "ctxproxy-journal_0"


def test_a_read_that_made_sqlite_roll_back_fails_the_call_not_only_the_read(tmp_path: Path, placed_on: list[str],
                                                                           ) -> None:
    """Some failures (an I/O error in a read that spills to a temporary file) make SQLite roll back the whole
    transaction; ``record_request_and_read`` catches a failed read, so on the loop its request would have been
    reported journaled and was not. The call fails instead (503), nothing is kept of it, and the next request gets
    its own ids."""
    writer = JournalWriter(Journal(tmp_path / "journal.db"), storage_error)

    def rolled_back(journal: Journal, recorded: Any) -> None:
        journal.conn.raw.execute("ROLLBACK")  # what SQLite does itself on SQLITE_IOERR
        raise sqlite3.OperationalError("disk I/O error")

    try:
        with pytest.raises(StorageError):
            asyncio.run(writer.call(Journal.record_request_and_read, incoming(run(2)[-1]), rolled_back))
        assert _requests(tmp_path / "journal.db") == 0 and not writer.journal.conn.raw.in_transaction
        recorded = asyncio.run(writer.call(Journal.record_request, incoming(run(2)[-1])))
        assert recorded.request_id == 1 and _requests(tmp_path / "journal.db") == 1
        assert recorded.session_id.count("-") == 1  # the opening's first session, not a second of a vanished one
    finally:
        writer.close()
    assert placed_on == [threading.current_thread().name] * 2


def test_a_log_a_reader_holds_near_its_backstop_sends_calls_to_the_thread(tmp_path: Path, placed_on: list[str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A write-ahead log that another process's reader keeps from being copied back, near ``BACKSTOP_PAGES``, is
    checkpointed, and synced, by the commits themselves: those are made on the writer thread. Once the reader is
    gone and a checkpoint copied it all back, calls run on the loop again."""
    monkeypatch.setattr(checkpoints, "BACKSTOP_PAGES", 1)  # any log is near it
    writer = JournalWriter(Journal(tmp_path / "journal.db"))
    reader = sqlite3.connect(tmp_path / "journal.db", isolation_level=None)

    def after_a_checkpoint(messages: int) -> None:
        seen = writer._checkpoints.checkpoints  # type: ignore[union-attr]
        asyncio.run(writer.call(Journal.record_request, incoming(run(messages)[-1])))
        deadline = time.monotonic() + 10
        while writer._checkpoints.checkpoints == seen and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.02)

    try:
        after_a_checkpoint(2)  # on the loop; the checkpoint copies it all back
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM requests").fetchall()  # holds the log from here on
        after_a_checkpoint(3)  # on the loop still; the checkpoint cannot copy it back
        asyncio.run(writer.call(Journal.record_request, incoming(run(4)[-1])))  # on the thread
        reader.execute("COMMIT")
        after_a_checkpoint(5)  # on the thread (the last checkpoint was held); this one copies it all back
        asyncio.run(writer.call(Journal.record_request, incoming(run(6)[-1])))  # on the loop again
    finally:
        reader.close()
        writer.close()
    here = threading.current_thread().name
    assert placed_on == [here, here, "ctxproxy-journal_0", "ctxproxy-journal_0", here]


def test_the_connection_is_never_used_from_two_threads_at_once(tmp_path: Path, placed_on: list[str]) -> None:
    """While a call holds the connection (here, as if the writer thread were in one), a call does not run beside
    it on the loop: it goes to the thread, which takes the connection once it is free."""
    writer = JournalWriter(Journal(tmp_path / "journal.db"))

    async def while_held() -> None:
        writer._running.acquire()
        async with asyncio.TaskGroup() as group:
            call = group.create_task(writer.call(Journal.record_request, incoming(run(2)[-1])))
            await asyncio.sleep(0.05)
            assert not call.done()
            writer._running.release()

    try:
        asyncio.run(while_held())
    finally:
        writer.close()
    assert placed_on == ["ctxproxy-journal_0"]


def _shown(n: int) -> SessionState:
    return SessionState(mirror_shown=MirrorShown(0, tuple(f"m{i}" for i in range(n)), tuple(f"h{i}" for i in range(n))))


@pytest.mark.parametrize(("change", "forward_bytes", "heavy"), [
    (None, 0, False),
    (None, OFFLOAD_BYTES, True),
    (StateChange("s", 1, SessionState(offered_turn="t"), "now"), 0, False),
    (StateChange("s", 1, SessionState(mirror_text="m" * WHOLE_MIRROR_CHARS), "now"), 0, True),
    (StateChange("s", 1, SessionState(mirror_text="m" * (WHOLE_MIRROR_CHARS - 1)), "now"), 0, False),
    (StateChange("s", 1, _shown(OFFLOAD_MESSAGES), "now"), 0, True),
    (StateChange("s", 1, _shown(OFFLOAD_MESSAGES - 1), "now"), 0, False),
])
def test_what_journaling_is_heavy(change: Any, forward_bytes: int, heavy: bool) -> None:
    """A MiB of cut bodies, a mirror of a thousand messages (its lists), or a long mirror's text stored whole: the
    journal's thread."""
    assert heavy_journaling(change, forward_bytes) is heavy


def test_a_call_on_the_writer_thread_waits_for_another_process_s_write_lock(tmp_path: Path) -> None:
    """``claim`` reads, then writes: begun with a plain ``BEGIN``, it failed at once while another connection held
    SQLite's write lock (a ``ctxproxy prune``; a checkpoint that took it made a small chat a 503). Every call on
    the writer thread begins with the lock, and waits for it within the busy timeout."""
    writer = JournalWriter(Journal(tmp_path / "journal.db"))
    other = sqlite3.connect(str(tmp_path / "journal.db"), isolation_level=None, check_same_thread=False)
    try:
        rec = asyncio.run(writer.call(Journal.record_request, incoming([{"role": "user", "content": "hi"}])))
        other.execute("BEGIN IMMEDIATE")  # the caller's thread cannot take it: the call goes to the writer thread
        release = threading.Timer(0.3, lambda: other.execute("COMMIT"))
        release.start()
        started = time.monotonic()
        asyncio.run(writer.call(claim, rec.session_id, rec.request_id))
        assert time.monotonic() - started >= 0.25
        release.join()
        held = writer.journal.conn.execute("SELECT claimed_by FROM sessions WHERE id = ?", [rec.session_id])
        assert held.fetchone()[0] == rec.request_id
    finally:
        other.close()
        writer.close()

def test_a_call_run_on_the_loop_opens_no_cancel_scope(tmp_path: Path, placed_on: list[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``proxy.engine.shielded``: a call that cannot be cancelled halfway costs no cancel scope (~7 µs)."""
    scopes: list[object] = []
    monkeypatch.setattr(shielded.anyio, "CancelScope", lambda **kw: scopes.append(kw))
    writer = JournalWriter(Journal(tmp_path / "journal.db"))
    try:
        recorded = asyncio.run(journaled(writer, Journal.record_request, incoming(run(2)[-1])))
    finally:
        writer.close()
    assert isinstance(recorded, RecordedRequest) and _requests(tmp_path / "journal.db") == 1
    assert placed_on == [threading.current_thread().name] and scopes == []


def test_a_call_on_the_thread_ends_and_is_returned_before_a_cancellation_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``proxy.engine.shielded``: once begun, the request's row is written, so its answer row can follow."""
    place = Journal._place

    def slowly(self: Journal, *args: Any) -> Any:
        time.sleep(0.2)  # on the writer's thread: the caller's scope is cancelled meanwhile
        return place(self, *args)

    monkeypatch.setattr(Journal, "_place", slowly)
    got: list[RecordedRequest] = []

    async def cancelled_meanwhile() -> bool:
        with anyio.move_on_after(0.02) as scope:
            got.append(await journaled(writer, Journal.record_request, incoming(run(2)[-1]), heavy=True))
            await anyio.sleep(5)  # the cancellation goes on here
        return scope.cancelled_caught

    writer = JournalWriter(Journal(tmp_path / "journal.db"))
    try:
        assert asyncio.run(cancelled_meanwhile())
    finally:
        writer.close()
    assert len(got) == 1 and _requests(tmp_path / "journal.db") == 1


def test_call_here_runs_only_what_the_loop_may_and_does_nothing_else(tmp_path: Path, placed_on: list[str]) -> None:
    writer = JournalWriter(Journal(tmp_path / "journal.db"))
    try:
        assert writer.call_here(Journal.record_request, incoming(run(2)[-1]), heavy=True) == (False, None)
        assert writer.call_here(Journal.sessions) == (False, None)  # an operator's read: the thread's
        assert placed_on == [] and _requests(tmp_path / "journal.db") == 0
        ran, recorded = writer.call_here(Journal.record_request, incoming(run(2)[-1]))
        assert ran and isinstance(recorded, RecordedRequest) and _requests(tmp_path / "journal.db") == 1
    finally:
        writer.close()
