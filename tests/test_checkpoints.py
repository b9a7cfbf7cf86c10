"""The journal's checkpoints run on their own thread (``store.checkpoints``), never inside a request's commit."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ctxproxy.store import Journal, JournalWriter, MemoryJournal
from ctxproxy.store.checkpoints import (
    BACKSTOP_PAGES,
    PACE_PAGES,
    SHORTEST_WAIT,
    Checkpointer,
    checkpoint_backstop,
    next_wait,
)
from tests.test_journal import incoming, record

PAGE = 4096


def _write_log_pages(journal: Journal, pages: int) -> None:
    """Requests whose bodies take ``pages`` of the write-ahead log or more."""
    for n in range(pages * PAGE // 100_000 + 1):
        record(journal, incoming([{"role": "user", "content": f"{n} " + "x" * 100_000}], n=n % 60))


def _wait_for(done: Callable[[], object], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_commits_leave_the_log_to_the_checkpointer_which_copies_it_back_when_poked(tmp_path: Path) -> None:
    """1500 pages of log: SQLite's default has the commit that passes 1000 copy them into the file (18-24 ms,
    on a request's path); with the backstop no commit does, and the checkpointer does once poked."""
    default = Journal(tmp_path / "default.db")
    start = (tmp_path / "default.db").stat().st_size
    _write_log_pages(default, 1500)
    assert (tmp_path / "default.db").stat().st_size > start + 1000 * PAGE  # a commit checkpointed
    default.close()

    journal = Journal(tmp_path / "journal.db")
    checkpoint_backstop(journal.conn)
    checkpoints = Checkpointer(tmp_path / "journal.db", every=0.05)
    try:
        start = (tmp_path / "journal.db").stat().st_size
        _write_log_pages(journal, 1500)
        assert (tmp_path / "journal.db").stat().st_size == start  # the file untouched: every page still in the log
        assert (tmp_path / "journal.db-wal").stat().st_size > 1500 * PAGE
        checkpoints.poke()
        _wait_for(lambda: checkpoints.checkpoints)
        assert (tmp_path / "journal.db").stat().st_size > start + 1000 * PAGE
        log = (tmp_path / "journal.db-wal").stat().st_size
        record(journal, incoming([{"role": "user", "content": "after"}]))
        assert (tmp_path / "journal.db-wal").stat().st_size == log  # the log began again: written over, not grown
        assert journal.conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 1500 * PAGE // 100_000 + 2
    finally:
        checkpoints.close()
        journal.close()


def log_restarts(log: Path) -> int:
    """How many times the write-ahead log at ``log`` started afresh: its header's checkpoint sequence number (bytes
    12-15, big-endian), which SQLite counts up at each restart from 0 for a new log."""
    with log.open("rb") as file:
        return int.from_bytes(file.read(16)[12:16], "big")


def burst(folder: Path, seconds: float = 1.0) -> tuple[int, int, int, int, int]:
    """Requests 2 ms apart for ``seconds``, each poking a checkpointer that runs every 0.05 s (as the 600-round
    run's, sent back to back): (requests, checkpoints, log bytes, file bytes, times the log started afresh) after.
    ``bench/log_restarts.py``'s."""
    journal = Journal(folder / "journal.db")
    checkpoint_backstop(journal.conn)
    checkpoints = Checkpointer(folder / "journal.db", every=0.05)
    try:
        start, n = time.monotonic(), 0
        while time.monotonic() - start < seconds:
            record(journal, incoming([{"role": "user", "content": f"{n} " + "x" * 8000}], n=n % 60))
            checkpoints.poke()
            n += 1
            time.sleep(0.002)
        return n, checkpoints.checkpoints, (folder / "journal.db-wal").stat().st_size, (
            folder / "journal.db").stat().st_size, log_restarts(folder / "journal.db-wal")
    finally:
        checkpoints.close()
        journal.close()


def test_commits_that_never_pause_for_long_still_let_the_log_start_afresh(tmp_path: Path) -> None:
    """Each checkpoint found commits made while it ran, so the log never started afresh (0 times in 18 checkpoints)
    and grew to the backstop (54 MB of log for a 6 MB file here); checkpoints run again while commits came during
    the last, until one ends between two. Counted by the log's own header, not judged by its size, which the
    scheduler decides: a commit whose transaction began during the last pass keeps the log going to the next
    checkpoint, and how long that runs is the machine's (11-17 restarts of 18 checkpoints, the largest log 0.5-1.9
    times the file; with both cores busy elsewhere 7-18 of 17-18, and up to 3.4 times)."""
    _, checkpoints, _, _, restarts = burst(tmp_path)
    assert checkpoints >= 5
    assert restarts >= checkpoints // 4


def test_the_checkpointer_never_takes_the_write_lock_which_a_transaction_that_read_could_not_wait_for(
        tmp_path: Path) -> None:
    """A transaction that began with a read (``BEGIN``, not ``BEGIN IMMEDIATE``) and then writes fails at once, busy
    timeout or not, while another connection holds the write lock: a RESTART checkpoint, which takes it, made a
    small chat a 503 while a large request was journaled. So the checkpointer runs PASSIVE checkpoints only."""
    journal = Journal(tmp_path / "journal.db")
    writer = journal.conn.raw
    writer.execute("CREATE TABLE scratch (x BLOB)")
    other = sqlite3.connect(str(tmp_path / "journal.db"), isolation_level=None)
    try:
        writer.execute("BEGIN")
        writer.execute("SELECT COUNT(*) FROM scratch").fetchone()
        other.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with pytest.raises(sqlite3.OperationalError, match="database is locked"):
            writer.execute("INSERT INTO scratch VALUES (1)")
        assert time.monotonic() - started < 1.0  # its busy timeout is 10 s: not waited for
        writer.execute("ROLLBACK")
        other.execute("ROLLBACK")
        statements: list[str] = []
        checkpointer = sqlite3.connect(str(tmp_path / "journal.db"), isolation_level=None)
        checkpointer.set_trace_callback(statements.append)
        for n in range(20):
            record(journal, incoming([{"role": "user", "content": f"{n} " + "x" * 8000}], n=n))
        Checkpointer._copy_back(checkpointer)
        checkpointer.close()
        assert statements and set(statements) == {"PRAGMA wal_checkpoint(PASSIVE)"}
    finally:
        other.close()
        journal.close()


def test_the_wait_for_the_next_checkpoint_follows_the_log() -> None:
    """Scaled so that commits at the same rate leave ``PACE_PAGES`` in the log at the next one: shorter while they
    come fast (never below ``SHORTEST_WAIT``), back to the longest as they slow."""
    assert next_wait(0.25, PACE_PAGES, 0.25) == 0.25
    assert next_wait(0.25, 4 * PACE_PAGES, 0.25) == pytest.approx(0.0625)
    assert next_wait(0.0625, 100 * PACE_PAGES, 0.25) == SHORTEST_WAIT
    assert next_wait(SHORTEST_WAIT, PACE_PAGES // 2, 0.25) == pytest.approx(2 * SHORTEST_WAIT)
    assert next_wait(0.2, 10, 0.25) == next_wait(0.2, 0, 0.25) == 0.25
    assert next_wait(0.0, 10, 0.0) == 0.0  # a checkpointer told to run at once stays at once


def test_a_checkpoint_is_not_another_process_s_write(tmp_path: Path) -> None:
    """The writer notices other writers by ``PRAGMA data_version`` (``store.writer``): a checkpoint from another
    connection changes no data, and must not make it forget what it keeps (the prefix index's rows...)."""
    journal = Journal(tmp_path / "journal.db")
    checkpoints = Checkpointer(tmp_path / "journal.db", every=0.0)
    try:
        record(journal, incoming([{"role": "user", "content": "one"}]))
        version = journal.data_version()
        checkpoints.poke()
        _wait_for(lambda: checkpoints.checkpoints)
        assert checkpoints.checkpoints and journal.data_version() == version
    finally:
        checkpoints.close()
        journal.close()


def test_the_writer_of_a_sqlite_file_checkpoints_on_its_own_thread_and_stops_it_when_closed(tmp_path: Path) -> None:
    writer = JournalWriter(Journal(tmp_path / "journal.db"))
    try:
        assert writer.journal.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == BACKSTOP_PAGES
        asyncio.run(writer.call(Journal.record_request, incoming([{"role": "user", "content": "hi"}])))
        assert writer._checkpoints is not None
        _wait_for(lambda: writer._checkpoints.checkpoints)  # type: ignore[union-attr]
        assert writer._checkpoints.checkpoints == 1  # poked by the commit, once
    finally:
        writer.close()
    assert not [t for t in threading.enumerate() if t.name == "ctxproxy-checkpoints"]
    incognito = JournalWriter(MemoryJournal(1 << 20, 3600.0))
    try:
        assert incognito._checkpoints is None  # in memory: no log, nothing to checkpoint
    finally:
        incognito.close()


def test_a_checkpoint_that_fails_is_logged_and_tried_again_at_the_next_poke(tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "journal.db").write_bytes(b"not a database, " * 512)
    checkpoints = Checkpointer(tmp_path / "journal.db", every=0.0)
    try:
        for expected in (1, 2):
            checkpoints.poke()
            _wait_for(lambda n=expected: len(caplog.records) >= n)  # type: ignore[misc]
            assert len(caplog.records) == expected and checkpoints.checkpoints == 0
    finally:
        checkpoints.close()
    assert "could not checkpoint the journal's write-ahead log" in caplog.records[0].getMessage()


class _ClosedJustBeforeTheClear(threading.Event):
    """The checkpointer's poke event, whose first ``clear`` lets ``close`` set both events first: a close that came
    after the wait before a checkpoint ended and before the thread cleared the poke (a scheduler's choice)."""

    def __init__(self, checkpoints: Checkpointer) -> None:
        super().__init__()
        self.closer = threading.Thread(target=checkpoints.close)

    def clear(self) -> None:
        if self.closer.ident is None:
            self.closer.start()
            while not self.is_set():  # close has set the stop, then the poke
                time.sleep(0.001)
        super().clear()


class _ClosedJustBeforeItsFirstClear(Checkpointer):
    """A checkpointer whose thread waits on that event from its start."""

    def _run(self) -> None:
        self._poked = _ClosedJustBeforeTheClear(self)
        super()._run()


def test_a_close_that_comes_just_before_the_poke_is_cleared_still_stops_the_thread(tmp_path: Path) -> None:
    """The thread cleared the poke after close had set it and waited for the next one for ever: a replay's
    app never finished its shutdown (a CI run stopped at its time limit)."""
    Journal(tmp_path / "journal.db").close()
    checkpoints = _ClosedJustBeforeItsFirstClear(tmp_path / "journal.db", every=0.0)
    _wait_for(lambda: isinstance(checkpoints._poked, _ClosedJustBeforeTheClear))
    hooked = checkpoints._poked
    assert isinstance(hooked, _ClosedJustBeforeTheClear)
    checkpoints.poke()
    _wait_for(lambda: hooked.closer.ident is not None)
    hooked.closer.join(timeout=5)
    stopped = not hooked.closer.is_alive()
    if not stopped:  # let the test end: what a second close would do
        checkpoints._poked.set()
        hooked.closer.join()
    assert stopped
