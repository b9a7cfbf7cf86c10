"""The journal's threads: a journal call runs on a writer thread, or on the loop when that cannot make it wait.

SQLite allows one writer at a time; rather than contend for the lock, all calls (writes and the few operator
reads) are queued for a single thread (``store.hops``) that owns the connection, as datasette's write thread does,
so a commit that waits (for a ``ctxproxy prune`` holding the write lock, for a sync of the disk) never blocks other
requests. The hop there and back cost ~0.2 ms of every call, two or three a chat request: so a request path's call
that nothing can make wait runs on the loop itself (``JournalWriter._run_here``): none queued or running on the
thread, the write lock free at once (then held), no sync at each commit, and not ``heavy`` (a request's many new
bytes, parsed on the worker, are stored on the thread too). PostgreSQL takes many writers: there a
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
from typing import Any, TypeVar, cast

from ctxproxy.store.checkpoints import Checkpointer, checkpoint_backstop
from ctxproxy.store.claims import claim
from ctxproxy.store.failures import JournalUnavailable, explain
from ctxproxy.store.hops import Threads
from ctxproxy.store.journal import Journal
from ctxproxy.store.session_state import record_forward_and_state, record_session_state

__all__ = ["JournalWriter"]

T = TypeVar("T")

POSTGRES_WRITERS = 4
"""Writer threads (and connections) on PostgreSQL: a replica's concurrent sessions commit in parallel."""

_PLACING = frozenset({Journal.record_request, Journal.record_request_and_read})
"""The calls that place a request: they wait for the answers handed in before them (a set: `in` narrows no type)."""

_BLIND_WRITES = (Journal.record_response, Journal.record_forward)
"""Calls that only write, reading nothing the process keeps in memory: they do not look whether another process
wrote the journal (``PRAGMA data_version``; a round trip on PostgreSQL). The next call that reads looks, and sees any
such write all the same: the version it compares with is the one the last look saw."""

_HERE = frozenset({*_PLACING, *_BLIND_WRITES, record_forward_and_state, record_session_state, claim})
"""The request path's calls, which may run on the caller's thread when the writer thread is idle (``_run_here``):
each is one transaction of a few ms at most, and none relies on a transaction of its own inside it (the prune's
bulk deletes turn foreign keys off, which a transaction already begun ignores; the incognito journal's bound is
kept after its request is committed)."""

UNWRITTEN = 10_000
"""Answers kept in memory while the disk is full; beyond, the oldest are dropped (a restart marks their requests
interrupted)."""


class JournalWriter:
    """Runs ``Journal`` methods on the writer thread: ``await writer.call(Journal.record_request, req)``."""

    def __init__(self, journal: Journal, failure: Callable[[JournalUnavailable], Exception] = lambda e: e) -> None:
        self.journal, self._failure = journal, failure
        """``failure``: what a storage failure is raised as (the proxy's HTTP error); by default as it is."""
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
        self._here = threads == 1 and journal.path is not None and journal.sync != "full"
        """A SQLite file written without a sync at each commit: a call may run on the caller's thread."""
        if self._here:  # its calls there take the lock at once or not at all; the thread's wait (``_guarded``)
            journal.conn.rest_without_waits()
        self._running = threading.Lock()
        """Held while a call uses the SQLite connection, on the writer thread or on the caller's."""
        self._data_version: int | None = None
        self.generation = 0
        """Counts the times another process wrote the journal (``ctxproxy prune``): what the proxy remembers of
        its sessions (``proxy.engine.context``) is keyed by it, so nothing read before such a write is used after."""

    async def call(self, method: Callable[..., T], *args: object, heavy: bool = False) -> T:
        """``method(journal, *args)``. ``heavy``: it may write many bytes (a large request's new messages, the
        bodies its forward cuts, a large answer), so it runs on the writer thread whatever else (``_run_here``)."""
        if method in _PLACING and self._answers:
            await asyncio.wait(list(self._answers))
        ran, result = self.call_here(method, *args, heavy=heavy)
        if ran:
            return cast(T, result)
        future: asyncio.Future[T] = self._threads.run(self._guarded, method, *args)  # ``store.hops``: a third of
        # the hop through an executor
        if method is Journal.record_response:
            self._answers.add(future)
            future.add_done_callback(self._answers.discard)
        return await future

    def call_here(self, method: Callable[..., T], *args: object, heavy: bool = False) -> tuple[bool, T | None]:
        """(True, ``call``'s result) run on the caller's thread now, never yielding to the loop (``_run_here``);
        else (False, None), nothing done: a call that places a request waits for the answers handed in before."""
        if not self._here or heavy or method not in _HERE or not self._threads.idle or self._unwritten \
                or (method in _PLACING and self._answers):
            return False, None
        return self._run_here(method, args)

    def _run_here(self, method: Callable[..., T], args: tuple[object, ...]) -> tuple[bool, T | None]:
        """(True, ``method``'s result), run on the caller's thread, when nothing is queued for the writer thread,
        nor running there, and the write lock is free at once; else (False, None), and nothing was done.

        The hop to the writer thread and back cost ~0.2 ms of each call, two or three a chat request (issue #13),
        where the call itself takes 0.1-1.5 ms. It holds the write lock from its start (``begin_if_free``), so it
        never waits for another process; a commit does not sync the disk (``journal_sync`` normal), and the log's
        checkpoints stay on their own thread (a log near the size at which a commit would checkpoint it itself
        sends the call to the thread). A call that fails leaves nothing of its transaction, nor does one whose
        transaction SQLite rolled back under it (an I/O error a read caught), and the journal forgets what it read
        during it."""
        if (self._checkpoints is not None and self._checkpoints.log_near_backstop()) \
                or not self._running.acquire(blocking=False):
            return False, None
        try:
            journal = self.journal
            if not journal.conn.begin_if_free():
                return False, None
            try:
                return True, self._checked(journal, method, args, held=True)
            except BaseException:
                journal.conn.end(commit=False)
                _forget_reads(journal)
                raise
        finally:
            self._running.release()

    def _guarded(self, method: Callable[..., T], *args: object) -> T:
        """On the writer thread. On a SQLite file each call is one transaction holding the write lock from its start,
        as ``_run_here``'s are: one that began with a read and then writes (``claim``'s) fails at once, busy timeout
        or not, while another connection holds the lock (a ``ctxproxy prune``); this one waits for it. (A prune,
        which needs a transaction of its own, is the command's, never the writer's.)"""
        journal = self._own()
        locked = journal.conn.dialect == "sqlite" and journal.path is not None
        if not self._here:
            return self._checked(journal, method, args, locked=locked)
        with self._running, journal.conn.waiting():
            return self._checked(journal, method, args, locked=locked)

    def _checked(self, journal: Journal, method: Callable[..., T], args: tuple[object, ...], held: bool = False,
                 locked: bool = False) -> T:
        """``method(journal, *args)``, its storage failures made the operator's; ``held``: in the transaction
        ``_run_here`` began, committed here; ``locked``: in one begun here with the write lock (``_guarded``)."""
        if method not in _BLIND_WRITES:
            self._notice_other_writers(journal)
        self._write_unwritten(journal)
        try:
            if held:  # a failure SQLite rolled the transaction back for, which the looks above let pass
                journal.conn.check_held()
            result = _locked_call(journal, method, args) if locked else method(journal, *args)
            if held:
                journal.conn.end(commit=True)
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
                _forget_reads(journal)
            self._data_version = version

    def _write_unwritten(self, journal: Journal) -> None:
        if self._unwritten:
            with self._lock:
                _write_kept(journal, self._unwritten)

    def close(self) -> None:
        self._threads.run_blocking(lambda: _write_left(self))
        self._threads.stop()
        if self._checkpoints is not None:
            self._checkpoints.close()
        for journal in self._journals:
            journal.close()


def _write_left(writer: JournalWriter) -> None:
    """At close, on the thread: the answers still kept in memory, waiting for the lock as the thread's calls do."""
    if writer._unwritten:
        journal = writer._own()
        with journal.conn.waiting():
            writer._write_unwritten(journal)


def _write_kept(journal: Journal, unwritten: deque[tuple[object, ...]]) -> None:
    """The answers kept in memory (``JournalWriter._unwritten``) journaled, oldest first, until one fails."""
    while unwritten:
        try:
            Journal.record_response(journal, *unwritten[0])  # type: ignore[arg-type]
        except journal.conn.IntegrityError:
            pass  # written after all (or its request is gone): nothing left to do for it
        except journal.conn.Error:
            return  # still no room: kept for the next call
        unwritten.popleft()


def _forget_reads(journal: Journal) -> None:
    """What the journal keeps of its reads, dropped: another process wrote, or a transaction that read it failed."""
    journal.forget_interrupted()
    journal.forget_ancestries()
    journal.forget_openings()
    journal.forget_digests()


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


def _locked_call(journal: Journal, method: Callable[..., T], args: tuple[object, ...]) -> T:
    """``method(journal, *args)`` in a transaction that takes SQLite's write lock at its ``BEGIN IMMEDIATE``."""
    with journal.conn.transaction(exclusive=True):
        return method(journal, *args)
