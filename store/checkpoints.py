"""The SQLite journal's checkpoints, off the requests' path: a thread of their own, on a connection of their own.

In WAL mode a commit appends its pages to the write-ahead log, and SQLite's default has the commit that takes the
log past 1000 pages copy them all back into the database file and sync both (``wal_autocheckpoint``): 18-24 ms on
this project's machine, once every 60 small requests or so, on that request's path. A long session's requests
write more pages each: they met one every 20-30 requests (issue #13: "no request of the 600-round run above 2× the
median"). So the server's connection leaves checkpoints to ``Checkpointer``: a commit pokes it, and within
``CHECKPOINT_EVERY`` seconds it runs ``PRAGMA wal_checkpoint(PASSIVE)`` on its own connection. SQLite lets that
run beside the writer: it copies the frames committed before it began, waits for no one, and the next commit
starts the log afresh once all of it is copied. It takes the GIL only to start and end the statement.

The writer's own automatic checkpoint stays, at ``BACKSTOP_PAGES``: a log that grows past it (this thread could not
keep up, or a reader in another process held the log) is checkpointed by a commit again, as before.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

from ctxproxy.store.sql import Connection

__all__ = ["BACKSTOP_PAGES", "CHECKPOINT_EVERY", "Checkpointer", "checkpoint_backstop"]

log = logging.getLogger("ctxproxy")

CHECKPOINT_EVERY = 1.0
"""Seconds from the first commit since the last checkpoint to the next checkpoint: the log holds at most about
that many seconds of commits."""

BACKSTOP_PAGES = 16_384
"""Log pages (64 MB at 4 KB) past which a commit checkpoints by itself again, as SQLite does past 1000 by default."""


def checkpoint_backstop(conn: Connection, pages: int = BACKSTOP_PAGES) -> None:
    """The writer's connection checkpoints by itself only past ``pages`` of log (``Checkpointer`` does it before)."""
    conn.execute(f"PRAGMA wal_autocheckpoint={int(pages)}")


class Checkpointer:
    """Checkpoints the WAL of the SQLite file at ``path`` on a daemon thread, ``every`` seconds after a ``poke``."""

    def __init__(self, path: Path, sync: str = "normal", every: float = CHECKPOINT_EVERY) -> None:
        self._path, self._sync, self._every = path, sync, every
        self._poked, self._stopping = threading.Event(), threading.Event()
        self.checkpoints = 0
        """Checkpoints run (whole or partial): for tests and the curious."""
        self._pinned = False
        """What the last checkpoint saw (``log_near_backstop``)."""
        self._thread = threading.Thread(target=self._run, name="ctxproxy-checkpoints", daemon=True)
        self._thread.start()

    def log_near_backstop(self) -> bool:
        """Whether the last checkpoint left the log near ``BACKSTOP_PAGES`` and could not copy all of it back (a
        reader in another process holds part of it): then the log cannot start afresh, and the next commits may
        checkpoint it themselves, and sync. A log copied back whole starts afresh at the next commit, however
        large its file stays."""
        return self._pinned

    def poke(self) -> None:
        """A commit was made: checkpoint within ``every`` seconds. (Setting a set ``Event``: a lock, ~0.1 µs.)"""
        self._poked.set()

    def close(self) -> None:
        """Stop, without a last checkpoint: the last connection to the file to close checkpoints it whole."""
        self._stopping.set()
        self._poked.set()
        self._thread.join()

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while True:
                self._poked.wait()
                if self._stopping.wait(self._every):
                    break  # closing
                self._poked.clear()  # commits from here on poke again, for the next one
                conn = self._checkpoint(conn)
        finally:
            if conn is not None:
                conn.close()

    def _checkpoint(self, conn: sqlite3.Connection | None) -> sqlite3.Connection | None:
        """A checkpoint on ``conn`` (opened first if None); the connection for the next one (None after a failure:
        disk full, an I/O error... the next poke tries again, on a new one; the backstop holds meanwhile)."""
        try:
            if conn is None:
                conn = sqlite3.connect(str(self._path), check_same_thread=False, isolation_level=None)
                conn.execute(f"PRAGMA synchronous={'FULL' if self._sync == 'full' else 'NORMAL'}")  # how it syncs
            _, log_pages, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            self._pinned = log_pages >= BACKSTOP_PAGES * 3 // 4 and copied < log_pages
            self.checkpoints += 1
            return conn
        except sqlite3.Error as exc:
            log.warning("could not checkpoint the journal's write-ahead log %s-wal: %s", self._path, exc)
            if conn is not None:
                conn.close()
            return None
