"""A session's ancestry: the sessions it forked from, each with the last decision it inherits from it.

Why a module: every new run reads its ancestry (the decisions it inherits, the cut bodies it may restore), and a run
forking runs has a chain of up to 64 sessions, which one recursive statement walks. A session's parent and what it
inherits never change once it is opened, so a journal keeps the chains of the sessions it opens (``AncestryMixin``,
on SQLite), and reads one only for a session it did not open; removing sessions forgets them all.
"""

from __future__ import annotations

from ctxproxy.store.sql import Connection

__all__ = ["AncestryMixin"]


class AncestryMixin:
    conn: Connection
    ancestries: dict[str, tuple[tuple[str, int | None], ...]]
    """Ancestries of the sessions this journal opened (``remember_ancestry``), oldest opened first."""

    def inherited(self, session_id: str) -> list[tuple[str, int]]:
        """``decision_chain``'s first part alone: what a session just opened can have (it has no decision yet)."""
        return [(sid, upto) for sid, upto in self._ancestry(session_id)[:-1] if upto is not None]

    def _ancestry(self, session_id: str) -> list[tuple[str, int | None]]:
        """(session, decisions up to) from the oldest ancestor down to ``session_id`` (None: all of them); at
        most 64, in one statement (runs forking runs make long chains: one SELECT each was on every new run's path),
        or, for a session this journal opened, none at all (``remember_ancestry``)."""
        kept = self.ancestries.get(session_id)
        if kept is not None:
            return list(kept)
        return [(str(sid), upto) for sid, upto in self.conn.execute(_ANCESTRY, [session_id]).fetchall()]

    def remember_ancestry(self, session_id: str, parent_id: str | None, inherit_upto: int | None) -> None:
        """After the commit that opened ``session_id``: its ancestry, kept (SQLite only). A session's parent and
        what it inherits never change once it is opened, so its chain is its parent's (the 63 nearest, the parent
        with ``inherit_upto``) and itself, as ``_ANCESTRY`` would read it; only removing sessions changes chains
        (``forget_ancestries``). Every request of the peers' benchmark forks the last one: its read back walked a
        chain of up to 64 sessions in a recursive statement, a seventh of the journal thread's samples. On
        PostgreSQL each writer thread has its own journal and replicas prune: nothing kept there would be sure."""
        if self.conn.dialect != "sqlite":
            return
        parent = self._ancestry(parent_id) if parent_id is not None and inherit_upto is not None else []
        chain = [*parent[-_ANCESTRY_DEPTH + 1:-1], (parent[-1][0], inherit_upto)] if parent else []
        self.ancestries[session_id] = (*chain, (session_id, None))
        if len(self.ancestries) > _ANCESTRIES_KEPT:
            self.ancestries.pop(next(iter(self.ancestries)))

    def forget_ancestries(self) -> None:
        """Sessions were removed (a prune, the incognito journal's bound, another process): chains are read again."""
        self.ancestries.clear()


_ANCESTRY_DEPTH = 64
"""The sessions ``_ANCESTRY`` reads at most: the session and 63 ancestors."""
_ANCESTRIES_KEPT = 4096
"""Sessions whose ancestry a journal keeps (``remember_ancestry``); beyond, the one opened first is read again."""

_ANCESTRY = """
WITH RECURSIVE up(id, upto, parent_id, inherit_upto, depth) AS (
    SELECT q.id, CAST(NULL AS BIGINT), s.parent_id, s.inherit_upto, 0
      FROM (SELECT CAST(? AS TEXT) AS id) q LEFT JOIN sessions s ON s.id = q.id
    UNION ALL
    SELECT u.parent_id, u.inherit_upto, s.parent_id, s.inherit_upto, u.depth + 1
      FROM up u LEFT JOIN sessions s ON s.id = u.parent_id
     WHERE u.inherit_upto IS NOT NULL AND u.parent_id IS NOT NULL AND u.depth < 63
)
SELECT id, upto FROM up ORDER BY depth DESC
"""
"""A session and its ancestors, each with the last decision its child inherits from it (the session: NULL)."""
