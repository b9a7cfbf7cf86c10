"""Retention: ``prune`` removes the sessions idle since before a cutoff, and what only they referred to.

The journal is append-only while the proxy runs; pruning is the one deliberate exception, run by the operator
(``ctxproxy prune --older-than 30d``). What goes, in one transaction:

- every session last active before the cutoff, *unless* a remaining session descends from it: a forked child
  inherits its parent's decisions and may restore the bodies its parent cut (``store.ancestry``), so a
  parent stays, whole, as long as any descendant does;
- their requests, forwards, answers, decisions, context ops, overflow rows, overflow spans and journaled working state;
- the Responses API's kept responses (``store.kept_responses``) made before the cutoff (they name no session);
- message lists no remaining request, forward or session head reaches (through the delta encoding's bases);
- content-addressed blobs (messages, parameters, cut bodies, mirror texts) nothing remaining refers to: a body
  two sessions cut, or a message two sessions share, stays while either does.

A dry run does the same work and rolls it back, so what it reports is exactly what a real run would remove.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ctxproxy.store.replaced import ReplacedTexts
from ctxproxy.store.sql import Connection

__all__ = ["PruneReport", "RetentionMixin"]


@dataclass(frozen=True)
class PruneReport:
    sessions: list[str]
    """The sessions removed (or that a dry run would remove), oldest activity first."""
    kept_for_children: int
    """Sessions idle since before the cutoff, kept because a remaining session descends from them."""
    requests: int
    lists: int
    blobs: int
    blob_chars: int
    """The characters of the removed blobs' JSON bodies: about the bytes freed in the file."""
    dry_run: bool


class RetentionMixin:
    conn: Connection

    if TYPE_CHECKING:  # provided by Journal (store.cuts)
        @property
        def replaced_texts(self) -> ReplacedTexts: ...
        def forget_ancestries(self) -> None: ...
        def forget_openings(self) -> None: ...
        def forget_digests(self) -> None: ...

    def prune(self, before: str, dry_run: bool = False) -> PruneReport:
        """Remove the sessions last active before ``before`` (an ISO timestamp, as the journal writes them).

        SQLite checks the foreign keys once, over the whole result, rather than per deleted row: most child columns
        (``requests.list_id``, ``message_lists.base_id``...) have no index there, and a row-by-row check made a
        prune of 5 000 requests take 13 s instead of a fraction of one. PostgreSQL checks them row by row, as it
        always does, through the indexes it has on those columns (``m011``)."""
        try:
            with self.conn.unchecked_foreign_keys(), self.conn.transaction(exclusive=True):
                report = self._prune(before, dry_run)
                self.conn.check_foreign_keys()  # a row still refers to one the prune removed: nothing is removed
                if dry_run:
                    raise _DryRun(report)
                self._bump_version()
            self.replaced_texts.clear()  # texts of the removed sessions' decisions are not kept either
            self.forget_ancestries()
            self.forget_openings()
            self.forget_digests()
        except _DryRun as done:
            return done.report
        return report

    def data_version(self) -> int:
        """Changes when another connection (``ctxproxy prune``) committed since this one last looked (SQLite: any
        commit; PostgreSQL: a prune's, counted in ``journal_version``)."""
        if self.conn.dialect == "sqlite":
            return int(self.conn.execute("PRAGMA data_version").fetchone()[0])
        return int(self.conn.execute("SELECT version FROM journal_version").fetchone()[0])

    def _bump_version(self) -> None:
        if self.conn.dialect != "sqlite":
            self.conn.execute("UPDATE journal_version SET version = version + 1")

    def vacuum(self) -> None:
        """Give the freed pages back to the file system (SQLite rewrites the file: needs as much free space again;
        PostgreSQL marks them reusable)."""
        self.conn.execute("VACUUM")

    def _prune(self, before: str, dry_run: bool) -> PruneReport:
        for table, columns in _TEMP_TABLES.items():
            self.conn.execute(f"CREATE TEMP TABLE IF NOT EXISTS {table} ({columns})")
            self.conn.execute(f"DELETE FROM {table}")
        self.conn.execute(_CHOOSE, [before])
        sessions = [r[0] for r in self.conn.execute(
            "SELECT s.id FROM sessions s JOIN pruned p ON p.id = s.id ORDER BY s.updated_at, s.id")]
        idle = self.conn.execute("SELECT COUNT(*) FROM sessions WHERE updated_at < ?", [before]).fetchone()[0]
        counts = [self.conn.execute(sql).rowcount for sql in _DELETE_ROWS]
        self.conn.execute("DELETE FROM kept_responses WHERE created_at < ?", [before])  # no session: by age
        self.conn.execute(_LIVE_LISTS)
        lists = self.conn.execute("DELETE FROM message_lists WHERE id NOT IN (SELECT id FROM live_lists)").rowcount
        self.conn.execute(DELETE_PREFIXES)
        self.conn.execute(_LIVE_BLOBS)
        chars = [r[0] for r in self.conn.execute(
            "DELETE FROM blobs WHERE hash NOT IN (SELECT hash FROM live_blobs) RETURNING chars").fetchall()]
        return PruneReport(sessions, idle - len(sessions), counts[_REQUESTS], lists, len(chars), sum(chars),
                           dry_run)


class _DryRun(Exception):
    """A dry run's report, leaving its transaction, which it rolls back."""

    def __init__(self, report: PruneReport) -> None:
        super().__init__()
        self.report = report


_TEMP_TABLES = {"pruned": "id TEXT PRIMARY KEY", "live_lists": "id BIGINT PRIMARY KEY",
                "live_blobs": "hash TEXT PRIMARY KEY"}
"""What is removed, and what stays, written down first: a ``NOT IN`` over a table is hashed, once; over the
recursive query itself PostgreSQL ran it per row (0.9 s of a 1.3 s prune of 2 050 requests)."""

_CHOOSE = """
WITH RECURSIVE kept(id) AS (
    SELECT id FROM sessions WHERE updated_at >= ?
    UNION SELECT s.parent_id FROM sessions s JOIN kept k ON s.id = k.id WHERE s.parent_id IS NOT NULL
)
INSERT INTO pruned SELECT id FROM sessions WHERE id NOT IN (SELECT id FROM kept)
"""

_OF_PRUNED = "SELECT id FROM requests WHERE session_id IN (SELECT id FROM pruned)"
_DELETE_ROWS = [  # children before parents: the foreign keys are on
    f"DELETE FROM session_state WHERE session_id IN (SELECT id FROM pruned) OR request_id IN ({_OF_PRUNED})",
    f"DELETE FROM context_ops WHERE session_id IN (SELECT id FROM pruned) OR request_id IN ({_OF_PRUNED})",
    f"DELETE FROM decisions WHERE session_id IN (SELECT id FROM pruned) OR request_id IN ({_OF_PRUNED})",
    "DELETE FROM overflow WHERE session_id IN (SELECT id FROM pruned)",
    "DELETE FROM overflow_spans WHERE session_id IN (SELECT id FROM pruned)",
    f"DELETE FROM responses WHERE request_id IN ({_OF_PRUNED})",
    f"DELETE FROM forwards WHERE request_id IN ({_OF_PRUNED})",
    "DELETE FROM requests WHERE session_id IN (SELECT id FROM pruned)",
    "DELETE FROM sessions WHERE id IN (SELECT id FROM pruned)",
]
_REQUESTS = 7

_LIVE_LISTS = """
INSERT INTO live_lists WITH RECURSIVE live(id) AS (
    SELECT list_id FROM requests
    UNION SELECT list_id FROM forwards
    UNION SELECT list_id FROM overflow_spans
    UNION SELECT mirror_list FROM session_state WHERE mirror_list IS NOT NULL
    UNION SELECT mirror_ids FROM session_state WHERE mirror_ids IS NOT NULL
    UNION SELECT head_list_id FROM sessions WHERE head_list_id IS NOT NULL
    UNION SELECT m.base_id FROM message_lists m JOIN live l ON m.id = l.id WHERE m.base_id IS NOT NULL
)
SELECT id FROM live
"""

DELETE_PREFIXES = "DELETE FROM prefixes WHERE segment NOT IN (SELECT id FROM message_lists)"
"""The prefix index of the lists removed: a segment goes with its first list, the base of all its others."""

_LIVE_BLOBS = """
INSERT INTO live_blobs
    SELECT j.value FROM message_lists m, json_each(m.added) j
    UNION SELECT params_hash FROM requests
    UNION SELECT params_hash FROM forwards
    UNION SELECT id FROM overflow
    UNION SELECT overflow_id FROM decisions
    UNION SELECT replaced_by FROM decisions WHERE replaced_by IS NOT NULL
    UNION SELECT j.value FROM context_ops c, json_each(c.overflow_ids) j
    UNION SELECT mirror_hash FROM session_state WHERE mirror_hash IS NOT NULL
"""
