"""The journal's threads: every journal call of the process runs on a writer thread, never on the event loop.

SQLite allows one writer at a time; rather than contend for the lock, all calls (writes and the few operator
reads) are queued for a single thread (``store.hops``) that owns the connection, as datasette's write thread does.
The event loop only awaits a future, so a commit never blocks other requests. PostgreSQL takes many writers: there a
few threads run calls, each on its own connection (``Journal.reopen``), so one session's commit does not queue
behind another's; what must not interleave (two requests of one session) is serialised by the database
(``Journal.record_request``'s lock), across threads and processes alike.

A storage failure (disk full, a read-only or corrupt file, an I/O error) leaves here as a ``JournalUnavailable``
whose message names the file and the fix (``store.failures``), passed through the writer's ``failure`` function:
the proxy gives ``proxy.errors.storage_error``, which makes it ``StorageFull`` (507) or ``StorageError`` (503), and
the request handlers render it like any other. The store names no HTTP status and imports nothing from ``proxy``
(a contract of ``make test``). Each call is its own transaction, rolled back on failure, so the next call starts
clean: once the disk has room again, requests are journaled again.

An answer that could not be journaled that way (the client still gets it, ``Exchange.answer``) is kept in memory
and written before the next call: left unwritten, its request would look in flight until the next restart, and
the session's next request would fork it (``store.placement._continued``).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from ctxproxy.store.checkpoints import Checkpointer, checkpoint_backstop
from ctxproxy.store.failures import JournalUnavailable, explain
from ctxproxy.store.hops import Threads
from ctxproxy.store.journal import Journal

__all__ = ["JournalWriter"]

T = TypeVar("T")

POSTGRES_WRITERS = 4
"""Writer threads (and connections) on PostgreSQL: a replica's concurrent sessions commit in parallel."""

_PLACING = (Journal.record_request, Journal.record_request_and_read)
"""The calls that place a request: they wait for the answers handed in before them."""

_BLIND_WRITES = (Journal.record_response, Journal.record_forward)
"""Calls that only write, reading nothing the process keeps in memory: they do not look whether another process
wrote the journal (``PRAGMA data_version``; a round trip on PostgreSQL). The next call that reads looks, and sees any
such write all the same: the version it compares with is the one the last look saw."""

UNWRITTEN = 10_000
"""Answers kept in memory while the disk is full; beyond, the oldest are dropped (a restart marks their requests
interrupted)."""


class JournalWriter:
    """Runs ``Journal`` methods on the writer thread: ``await writer.call(Journal.record_request, req)``."""

    def __init__(self, journal: Journal, failure: Callable[[JournalUnavailable], Exception] = lambda e: e) -> None:
        self.journal = journal
        self._failure = failure
        """What a storage failure is raised as (the proxy's HTTP error); by default the ``JournalUnavailable``."""
        threads = POSTGRES_WRITERS if journal.conn.dialect == "postgresql" else 1
        self._threads = Threads(threads, "ctxproxy-journal")
        self._local = threading.local()
        self._free, self._journals = [journal], [journal]
        """The journal no thread has claimed yet (the first thread takes the one given), and every one opened."""
        self._lock = threading.Lock()
        self._unwritten: deque[tuple[object, ...]] = deque(maxlen=UNWRITTEN)
        self._answers: set[asyncio.Future[Any]] = set()
        """Answers handed to the threads and not yet journaled. A request waits for those handed in before it:
        placement continues a session only from an answered head, and an answer's call (journaled after the client
        has it) may otherwise run on another thread, later (one thread, on SQLite, keeps them in order anyway)."""
        self._checkpoints = _checkpointer(journal)
        """A SQLite file's checkpoints, off the requests' path (``store.checkpoints``)."""
        self._data_version: int | None = None
        self.generation = 0
        """Counts the times another process wrote the journal (``ctxproxy prune``): what the proxy remembers of
        its sessions (``proxy.engine.context``) is keyed by it, so nothing read before such a write is used after."""

    async def call(self, method: Callable[..., T], *args: object) -> T:
        if method in _PLACING and self._answers:
            await asyncio.wait(list(self._answers))
        future: asyncio.Future[T] = self._threads.run(self._guarded, method, *args)  # ``store.hops``: a third of
        # the hop through an executor
        if method is Journal.record_response:
            self._answers.add(future)
            future.add_done_callback(self._answers.discard)
        return await future

    def _guarded(self, method: Callable[..., T], *args: object) -> T:
        journal = self._own()
        if method not in _BLIND_WRITES:
            self._notice_other_writers(journal)
        self._write_unwritten(journal)
        try:
            result = method(journal, *args)
        except journal.conn.Error as exc:
            problem = storage_failure(exc, journal)
            if problem is None:
                raise
            if method is Journal.record_response:
                self._unwritten.append(args)
            raise self._failure(problem) from exc
        if self._checkpoints is not None:
            self._checkpoints.poke()
        return result

    def _own(self) -> Journal:
        """This thread's journal: the one given, or (PostgreSQL's other threads) a connection of its own."""
        journal: Journal | None = getattr(self._local, "journal", None)
        if journal is None:
            with self._lock:
                journal = self._free.pop() if self._free else self.journal.reopen()
                if journal is not self.journal:
                    self._journals.append(journal)
            self._local.journal = journal
        return journal

    def _notice_other_writers(self, journal: Journal) -> None:
        try:
            version = journal.data_version()
        except journal.conn.Error:
            return  # the call itself will meet the same failure, and report it
        with self._lock:
            if self._data_version is not None and version != self._data_version:
                self.generation += 1
                journal.forget_interrupted()
                journal.forget_ancestries()
                journal.forget_siblings()
                journal.forget_digests()
            self._data_version = version

    def _write_unwritten(self, journal: Journal) -> None:
        if not self._unwritten:
            return
        with self._lock:
            while self._unwritten:
                try:
                    Journal.record_response(journal, *self._unwritten[0])  # type: ignore[arg-type]
                except journal.conn.IntegrityError:
                    pass  # written after all (or its request is gone): nothing left to do for it
                except journal.conn.Error:
                    return  # still no room: kept for the next call
                self._unwritten.popleft()

    def close(self) -> None:
        self._threads.run_blocking(lambda: self._write_unwritten(self._own()))
        self._threads.stop()
        if self._checkpoints is not None:
            self._checkpoints.close()
        for journal in self._journals:
            journal.close()


def _checkpointer(journal: Journal) -> Checkpointer | None:
    """A SQLite file's: its commits leave checkpoints to it (``store.checkpoints``). None in memory, on PostgreSQL."""
    if journal.path is None:
        return None
    checkpoint_backstop(journal.conn)
    return Checkpointer(journal.path, journal.sync)


def storage_failure(exc: Exception, journal: Journal) -> JournalUnavailable | None:
    """The operator's version of a storage failure; None for anything else (a constraint, a misuse: a bug, which
    stays as it is, for the log and a 500)."""
    problem = explain(exc, journal.location)
    if problem.kind != "unavailable" or isinstance(exc, journal.conn.OperationalError):
        return problem
    return None

