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

Commits that never pause (a session's requests sent back to back: ~35 pages of log each, hundreds a second) leave
each checkpoint behind by what they wrote while it ran, so the log never started afresh: in the 600-round run it
grew to the backstop, whose checkpoint and syncs a commit then ran on the loop (27 + 14 ms). So a checkpoint is
followed by more while commits came during the last (``Checkpointer._copy_back``), each shorter, until one ends
between two commits; and the wait after a poke follows the log (``next_wait``): each checkpoint sees how many
pages the log held and sets the next wait so that it holds about ``PACE_PAGES`` at the next one, shorter while
commits come fast, back to ``every`` as they slow (an agent waiting on its model gets a checkpoint per request).

A log copied back whole still starts afresh only at a commit whose transaction began after the copy ended: under
commits sent back to back, one began during the last pass at 1-7 of a burst's 18 checkpoints, committed on top, and the
log went on to the next checkpoint (``bench/log_restarts.py``). Starting it afresh from here would take the write
lock (``_PASSIVE``), which the writer's transactions cannot all wait for.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

from ctxproxy.store.sql import Connection

__all__ = ["BACKSTOP_PAGES", "CHECKPOINT_EVERY", "PACE_PAGES", "Checkpointer", "checkpoint_backstop", "next_wait"]

log = logging.getLogger("ctxproxy")

CHECKPOINT_EVERY = 0.25
"""Seconds from the first commit since the last checkpoint to the next checkpoint, at most (``next_wait``): the
log holds at most about that many seconds of commits. A second of the 600-round run's was 64 MB in process."""

BACKSTOP_PAGES = 16_384
"""Log pages (64 MB at 4 KB) past which a commit checkpoints by itself again, as SQLite does past 1000 by default."""

PACE_PAGES = BACKSTOP_PAGES // 4
"""The log a checkpoint aims to find (16 MB at 4 KB pages): a quarter of the backstop, so a burst four times faster
than the last one still stays off the loop."""

CHASES = 8
"""Checkpoints run back to back at most after the first (``Checkpointer._copy_back``)."""

_PASSIVE = "PRAGMA wal_checkpoint(PASSIVE)"
"""The only checkpoint this thread runs. RESTART or TRUNCATE would take the write lock, and a transaction of the
writer's that began with a read (``BEGIN``, not ``BEGIN IMMEDIATE``) and then writes fails at once while another
connection holds it, busy timeout or not (``tests/test_checkpoints.py``): tried here to start the log afresh under
back-to-back commits, RESTART made a small chat a 503 while a large request was journaled."""

SHORTEST_WAIT = 0.05
"""Seconds: the checkpoints' pace at its fastest (each one syncs the log and the file)."""


def next_wait(wait: float, log_pages: int, longest: float) -> float:
    """The wait before the next checkpoint, from the last ``wait`` and the pages the log held after it: scaled so
    that the same rate of commits leaves ``PACE_PAGES`` in it, within [``SHORTEST_WAIT``, ``longest``]."""
    return min(longest, max(SHORTEST_WAIT, wait * PACE_PAGES / max(log_pages, 1)))


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
        self.wait = every
        """Seconds from a poke to the next checkpoint (``next_wait``)."""
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
        """Stop, without a last checkpoint: the last connection to the file to close checkpoints it whole. It sets
        the stop before the poke, so the thread sees one or the other: the poke, unless its clear came after both,
        and then the stop, which it looks at before it waits again."""
        self._stopping.set()
        self._poked.set()
        self._thread.join()

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while not self._stopping.is_set():  # a close between the wait below and the clear: its poke is gone
                self._poked.wait()
                if self._stopping.wait(self.wait):
                    break  # closing
                self._poked.clear()  # commits from here on poke again, for the next one
                conn = self._checkpoint(conn)
        finally:
            if conn is not None:
                conn.close()

    @staticmethod
    def _copy_back(conn: sqlite3.Connection) -> tuple[int, int]:
        """A passive checkpoint, then more while commits came during the last: (log pages, pages copied) of the
        first. The log starts afresh only at a commit that finds all of it copied, and commits that come all the
        time (a session's requests sent back to back) left each checkpoint behind by what they wrote while it ran:
        the log never started afresh, and reached the backstop. Each next checkpoint copies only what came during
        the last (a few pages), so one soon ends between two commits; one that finds nothing new costs no sync."""
        _, log_pages, copied = conn.execute(_PASSIVE).fetchone()
        seen, done = log_pages, copied
        for _ in range(CHASES):
            if done < seen:  # a reader holds the rest: another checkpoint would not copy it either
                break
            _, now, done = conn.execute(_PASSIVE).fetchone()
            if now <= seen:  # nothing came meanwhile, or the log started afresh
                break
            seen = now
        return log_pages, copied

    def _checkpoint(self, conn: sqlite3.Connection | None) -> sqlite3.Connection | None:
        """A checkpoint on ``conn`` (opened first if None); the connection for the next one (None after a failure:
        disk full, an I/O error... the next poke tries again, on a new one; the backstop holds meanwhile)."""
        try:
            if conn is None:
                conn = sqlite3.connect(str(self._path), check_same_thread=False, isolation_level=None)
                conn.execute(f"PRAGMA synchronous={'FULL' if self._sync == 'full' else 'NORMAL'}")  # how it syncs
            log_pages, copied = self._copy_back(conn)
            self._pinned = log_pages >= BACKSTOP_PAGES * 3 // 4 and copied < log_pages
            self.wait = next_wait(self.wait, log_pages, self._every)
            self.checkpoints += 1
            return conn
        except sqlite3.Error as exc:
            log.warning("could not checkpoint the journal's write-ahead log %s-wal: %s", self._path, exc)
            if conn is not None:
                conn.close()
            return None
