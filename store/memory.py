"""The incognito journal: in memory only, and bounded, so incognito traffic cannot grow the process for good.

Incognito requests are journaled like any other (sessions, projections, cut bodies), in an SQLite database that
lives in memory. Unbounded, it only grew: 60 incognito requests of 1 MB kept ~120 MB of pages. ``MemoryJournal``
forgets whole sessions, least recently used first: as each incognito request is journaled, every session idle
longer than ``max_age`` goes, and then the oldest while the database holds more than ``max_bytes``. A session
goes with the sessions forked from it (they are delta-encoded against its lists and inherit its decisions), and
never while one of them has a request in flight. What nothing refers to any more (message lists, message and
parameter bodies, cut bodies) is deleted with it, and the freed pages are given back (``auto_vacuum``), so the
database's size is what it holds. A forgotten session's stubs name bodies that are gone: ``read_overflow`` says so.
"""

from __future__ import annotations

import logging
import sqlite3
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from ctxproxy.store.journal import Journal
from ctxproxy.store.retention import DELETE_PREFIXES

__all__ = ["MemoryJournal"]

log = logging.getLogger("ctxproxy")

_FAMILIES = """
WITH RECURSIVE family(root, id) AS (
    SELECT id, id FROM sessions WHERE parent_id IS NULL
    UNION ALL SELECT family.root, s.id FROM sessions s JOIN family ON s.parent_id = family.id
)
SELECT family.root, MAX(s.updated_at) AS last_used,
       MAX(NOT EXISTS (SELECT 1 FROM responses p WHERE p.request_id =
           (SELECT MAX(r.id) FROM requests r WHERE r.session_id = s.id))) AS in_flight
  FROM family JOIN sessions s ON s.id = family.id
 GROUP BY family.root ORDER BY last_used, family.root
"""
"""Each family (a session and those forked from it, transitively), least recently used first."""

_FORGET = [
    "DELETE FROM temp.forget",
    """INSERT INTO temp.forget WITH RECURSIVE family(id) AS (
           SELECT ? UNION SELECT s.id FROM sessions s JOIN family ON s.parent_id = family.id)
       SELECT id FROM family""",
    "DELETE FROM context_ops WHERE session_id IN (SELECT id FROM temp.forget)",
    "DELETE FROM session_state WHERE session_id IN (SELECT id FROM temp.forget)",
    "DELETE FROM decisions WHERE session_id IN (SELECT id FROM temp.forget)",
    "DELETE FROM overflow WHERE session_id IN (SELECT id FROM temp.forget)",
    "DELETE FROM overflow_spans WHERE session_id IN (SELECT id FROM temp.forget)",
    "DELETE FROM responses WHERE request_id IN (SELECT r.id FROM requests r JOIN temp.forget f ON r.session_id = f.id)",
    "DELETE FROM forwards WHERE request_id IN (SELECT r.id FROM requests r JOIN temp.forget f ON r.session_id = f.id)",
    "DELETE FROM requests WHERE session_id IN (SELECT id FROM temp.forget)",
    "DELETE FROM sessions WHERE id IN (SELECT id FROM temp.forget)",
    # Message lists nothing reaches any more: not a request's, a forward's or a head, nor the base of one that is.
    """DELETE FROM message_lists WHERE id NOT IN (
           WITH RECURSIVE live(id) AS (
               SELECT list_id FROM requests UNION SELECT list_id FROM forwards UNION SELECT list_id FROM overflow_spans
               UNION SELECT mirror_list FROM session_state WHERE mirror_list IS NOT NULL
               UNION SELECT mirror_ids FROM session_state WHERE mirror_ids IS NOT NULL
               UNION SELECT head_list_id FROM sessions WHERE head_list_id IS NOT NULL
               UNION SELECT l.base_id FROM message_lists l JOIN live ON l.id = live.id WHERE l.base_id IS NOT NULL)
           SELECT id FROM live)""",
    DELETE_PREFIXES,
    """DELETE FROM blobs WHERE hash NOT IN (SELECT j.value FROM message_lists, json_each(message_lists.added) j)
                         AND hash NOT IN (SELECT params_hash FROM requests)
                         AND hash NOT IN (SELECT params_hash FROM forwards)
                         AND hash NOT IN (SELECT id FROM overflow)
                         AND hash NOT IN (SELECT replaced_by FROM decisions WHERE replaced_by IS NOT NULL)
                         AND hash NOT IN (SELECT mirror_hash FROM session_state WHERE mirror_hash IS NOT NULL)""",
]


class MemoryJournal(Journal):
    """A ``Journal`` in memory that forgets its least recently used sessions beyond ``max_bytes`` / ``max_age``
    seconds. ``now`` is the clock (tests pass their own)."""

    def __init__(self, max_bytes: int, max_age: float, now: Callable[[], datetime] = lambda: datetime.now(UTC)
                 ) -> None:
        super().__init__(None)
        self.max_bytes, self.max_age, self._now = max_bytes, max_age, now
        self.forgotten: deque[str] = deque()
        """Ids of the sessions forgotten, for the app to drop their working state (``AppState.journal_for``)."""
        self.conn.execute("CREATE TEMP TABLE forget (id TEXT PRIMARY KEY)")

    def after_request(self) -> None:
        """Each journaled request is a moment to keep within the bound (its own session is in flight: it stays).
        The request is committed already: a failure here is logged, not the request's."""
        try:
            self.keep_within_bound()
        except sqlite3.Error:
            log.exception("the incognito journal could not forget its oldest sessions; it stays over its bound")

    def stored_bytes(self) -> int:
        """What the database holds: its pages in use, times the page size."""
        pages = self.conn.execute("PRAGMA page_count").fetchone()[0] - self.conn.execute(
            "PRAGMA freelist_count").fetchone()[0]
        return int(pages * self.conn.execute("PRAGMA page_size").fetchone()[0])

    def keep_within_bound(self) -> list[str]:
        """Forget idle families older than ``max_age``, then the oldest while over ``max_bytes``; returns their
        roots."""
        cutoff = (self._now() - timedelta(seconds=self.max_age)).isoformat(timespec="milliseconds")
        oldest = self.conn.execute("SELECT MIN(updated_at) FROM sessions").fetchone()[0]
        if (oldest is None or oldest >= cutoff) and self.stored_bytes() <= self.max_bytes:
            return []  # the usual case, without walking every session's family
        forgotten = []
        for root, last_used, in_flight in self.conn.execute(_FAMILIES).fetchall():
            if in_flight:
                continue
            if last_used >= cutoff and self.stored_bytes() <= self.max_bytes:
                break
            self._forget(root)
            forgotten.append(root)
        return forgotten

    def _forget(self, root: str) -> None:
        with self.conn:  # all or nothing
            for sql in _FORGET[:2]:
                self.conn.execute(sql, [root] if "?" in sql else [])
            family = [row[0] for row in self.conn.execute("SELECT id FROM temp.forget")]
            for sql in _FORGET[2:]:
                self.conn.execute(sql)
        self.forgotten.extend(family)
        self.replaced_texts.clear()  # nothing of a forgotten session stays, here either
        self.forget_ancestries()
        self.forget_openings()
        self.forget_digests()
        for _ in range(4):  # one pass can leave a page it freed while moving others (seen with a mirror's text)
            self.conn.execute("PRAGMA incremental_vacuum").fetchall()
            if not self.conn.execute("PRAGMA freelist_count").fetchone()[0]:
                break
