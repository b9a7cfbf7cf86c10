"""One writer: every journal call of the process runs on one dedicated thread.

SQLite allows one writer at a time; rather than contend for the lock, all calls (writes and the few operator
reads) are queued on a single-thread executor that owns the connection, as datasette's write thread does. The
event loop only awaits a future, so a commit never blocks other requests.

A storage failure (disk full, a read-only or corrupt file, an I/O error) leaves here as a ``JournalUnavailable``
whose message names the file and the fix (``store.failures``), passed through the writer's ``failure`` function:
the proxy gives ``proxy.errors.storage_error``, which makes it ``StorageFull`` (507) or ``StorageError`` (503), and
the request handlers render it like any other. The store names no HTTP status and imports nothing from ``proxy``
(a contract of ``make test``). Each call is its own transaction, rolled back on failure, so the next call starts
clean: once the disk has room again, requests are journaled again.

An answer that could not be journaled that way (often after the client got it) is kept in memory and written
before the next call: left unwritten, its request would look in flight until the next restart, and the
session's next request would fork it (``store.placement._continued``).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ctxproxy.store.failures import JournalUnavailable, explain
from ctxproxy.store.journal import Journal

__all__ = ["JournalWriter"]

T = TypeVar("T")

UNWRITTEN = 10_000
"""Answers kept in memory while the disk is full; beyond, the oldest are dropped (a restart marks their requests
interrupted)."""


class JournalWriter:
    """Runs ``Journal`` methods on the writer thread: ``await writer.call(Journal.record_request, req)``."""

    def __init__(self, journal: Journal, failure: Callable[[JournalUnavailable], Exception] = lambda e: e) -> None:
        self.journal = journal
        self._failure = failure
        """What a storage failure is raised as (the proxy's HTTP error); by default the ``JournalUnavailable``."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctxproxy-journal")
        self._unwritten: deque[tuple[object, ...]] = deque(maxlen=UNWRITTEN)
        self._data_version: int | None = None
        self.generation = 0
        """Counts the times another process wrote the journal (``ctxproxy prune``): what the proxy remembers of
        its sessions (``proxy.engine.context``) is keyed by it, so nothing read before such a write is used after."""

    async def call(self, method: Callable[..., T], *args: object) -> T:
        # What ``loop.run_in_executor`` does, without its check that the callable is no coroutine function: on
        # uvloop it runs on every call, and inspecting a ``partial`` that way was 1.4% of a small request's time.
        future = self._executor.submit(self._guarded, method, *args)
        return await asyncio.wrap_future(future, loop=asyncio.get_running_loop())

    def _guarded(self, method: Callable[..., T], *args: object) -> T:
        self._notice_other_writers()
        self._write_unwritten()
        try:
            return method(self.journal, *args)
        except sqlite3.Error as exc:
            problem = storage_failure(exc, self.journal)
            if problem is None:
                raise
            if method is Journal.record_response:
                self._unwritten.append(args)
            raise self._failure(problem) from exc

    def _notice_other_writers(self) -> None:
        try:
            version = self.journal.data_version()
        except sqlite3.Error:
            return  # the call itself will meet the same failure, and report it
        if self._data_version is not None and version != self._data_version:
            self.generation += 1
            self.journal.forget_interrupted()
        self._data_version = version

    def _write_unwritten(self) -> None:
        while self._unwritten:
            try:
                Journal.record_response(self.journal, *self._unwritten[0])  # type: ignore[arg-type]
            except sqlite3.IntegrityError:
                pass  # written after all (or its request is gone): nothing left to do for it
            except sqlite3.Error:
                return  # still no room: kept for the next call
            self._unwritten.popleft()

    def close(self) -> None:
        self._executor.submit(self._write_unwritten).result()
        self._executor.submit(self.journal.close).result()
        self._executor.shutdown(wait=True)


def storage_failure(exc: sqlite3.Error, journal: Journal) -> JournalUnavailable | None:
    """The operator's version of a storage failure; None for anything else (a constraint, a misuse: a bug, which
    stays as it is, for the log and a 500)."""
    problem = explain(exc, journal.path)
    if problem.kind in ("full", "read_only", "corrupt") or isinstance(exc, sqlite3.OperationalError):
        return problem
    return None

