"""What a restart owes the journal: requests a crash left unanswered, and a check that the file is whole.

A mixin of ``Journal``. A request is *answered* once it has a final response row: any outcome but the interim
ones the proxy writes between its own rounds (``context_round``, ``context_overflow``: another attempt always
follows). A request without one when a server starts was in flight when the previous process died (SIGKILL, OOM,
power loss): ``mark_interrupted`` gives it a final row, outcome ``interrupted``, so it never looks in flight
again (its session's head is then free to be continued by the client's retry, see ``store.journal``). The
journal stays append-only: the mark is one more response row, for the attempt that never got its answer.
"""

from __future__ import annotations

from ctxproxy.store.sql import Connection

__all__ = ["ANSWERED", "INTERRUPTED", "MARK_ABANDONED", "RecoveryMixin"]

INTERRUPTED = "interrupted"

ANSWERED = ("EXISTS (SELECT 1 FROM responses p WHERE p.request_id = {request}"
            " AND p.outcome NOT IN ('context_round', 'context_overflow'))")
"""SQL: the request whose id is the expression ``{request}`` has its final answer."""

def _interrupted_rows(why: str, which: str) -> str:
    """SQL: a final ``interrupted`` row (status 0, ``why`` as its body; parameters: the time, then ``which``'s) for
    each request ``which`` selects that has no final answer yet, for the attempt that was never answered."""
    return f"""
INSERT INTO responses (request_id, attempt, outcome, status, body, finished_at)
SELECT r.id,
       (SELECT MAX(a) FROM (SELECT MAX(p.attempt) + 1 AS a FROM responses p WHERE p.request_id = r.id
                            UNION ALL SELECT MAX(f.attempt) FROM forwards f WHERE f.request_id = r.id
                            UNION ALL SELECT 0) attempts),
       '{INTERRUPTED}', 0, '{why}', ?
  FROM requests r
 WHERE {which} NOT {ANSWERED.format(request="r.id")}
"""


MARK_ABANDONED = _interrupted_rows(
    "the ctxproxy process handling this request stopped (killed or crashed) before it was answered; marked by"
    " another process sharing the store, which found it gone.", "r.id = ? AND")
"""SQL (parameters: the time, the request's id): the final ``interrupted`` row of one request whose process died,
if it has no final answer yet (``store.claims``, ``store.placement``)."""

_MARK = _interrupted_rows(
    "ctxproxy stopped (killed or crashed) before this request was answered; marked when it started again.", "")
"""SQL (parameter: the time): the final ``interrupted`` row of every request in flight when ctxproxy stopped."""


class RecoveryMixin:
    conn: Connection

    def mark_interrupted(self, now: str) -> int:
        """Give every request still in flight a final ``interrupted`` row, for the attempt that was never
        answered; returns how many. Only a server starting on its data dir calls this, never a reader: a
        request in flight in a running server is not interrupted."""
        with self.conn:
            cursor = self.conn.execute(_MARK, [now])
        return cursor.rowcount

    def probe_write(self) -> None:
        """Write, and roll it back: raises now, not at the first request, if the journal is read-only. (Taking
        SQLite's write lock is not enough: it grants it on a file it opened read-only, and refuses the first page;
        PostgreSQL refuses the write on a standby or a read-only user.)"""
        try:
            with self.conn:
                self.conn.execute("UPDATE schema_migrations SET name = name WHERE id = (SELECT MIN(id) FROM"
                                  " schema_migrations)")
                raise _Probed
        except _Probed:
            pass

    def integrity_problems(self, limit: int = 5) -> list[str]:
        """SQLite's ``PRAGMA quick_check``: what is wrong with the file (the first few), or nothing. O(size), no
        index cross-check (``integrity_check`` would be slower still, for little more). PostgreSQL checks its
        pages itself (checksums, WAL): nothing to ask it here."""
        if self.conn.dialect != "sqlite":
            return []
        rows = self.conn.execute(f"PRAGMA quick_check({int(limit)})").fetchall()
        return [str(r[0]) for r in rows if r[0] != "ok"]


class _Probed(Exception):
    """The probe's write went through: rolled back."""


