"""What the journal keeps in memory of each opening's sessions: how many there are, and the digests of their heads.

An opening is the first system and user message a request starts with (its ``fingerprint``); placement looks among
its sessions for the one the request continues (``store.placement``). On a SQLite file only this journal writes the
sessions: another process's write is seen by ``PRAGMA data_version``, and then everything kept here is dropped
(``forget_openings``), as it is when sessions are removed.

The count names a new session (``_new_ids``): counting visits every session of the opening, 0.1 ms after a thousand
of them, so it is counted once and then kept.

The head digests let a request that continues no session (a new run, a fork, an edited retry: every request of the
peers' benchmark) skip the lookup of its prefix digests among the heads (``_EXTENDED``, a new run's costliest
statement: ~30 µs after a thousand runs of one opening, issue #13), which finds none. What is kept is a superset
of the digests in the table: read whole, then each head a request moves a session to added, in its transaction,
before it commits (one that then fails leaves a digest too many, which costs a lookup, never a continuation). A
digest not kept is no session's head; one kept is looked up as before. Heads that moved on stay until the set
holds twice the digests it was read with (plus ``_SLACK``), when it is read again: a read of the opening's
sessions at most once per as many requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from ctxproxy.store.sql import Connection

__all__ = ["OPENINGS_KEPT", "OpeningsMixin"]

OPENINGS_KEPT = 4096
"""Openings whose counts, heads (and interrupted sessions, ``store.placement``) are kept; beyond, the oldest goes."""

V = TypeVar("V")

_SLACK = 64
"""Digests a set of head digests may grow by past twice the ones it was read with, before it is read again."""


class OpeningsMixin:
    conn: Connection
    siblings: dict[str, int]
    """Per opening, how many sessions it has (``_siblings``; SQLite only)."""
    head_digests: dict[str, tuple[set[str], int]]
    """Per opening, a superset of its sessions' head digests, and the size at which it is read again (SQLite only)."""

    def _siblings(self, fingerprint: str) -> int:
        """The opening's sessions: on SQLite counted once, then kept (``opened_sibling``)."""
        known = self.siblings.get(fingerprint) if self.conn.dialect == "sqlite" else None
        if known is None:
            row = self.conn.execute("SELECT COUNT(*) FROM sessions WHERE fingerprint = ?", [fingerprint]).fetchone()
            known = int(row[0])
            if self.conn.dialect == "sqlite":
                _keep(self.siblings, fingerprint, known)
        return known

    def opened_sibling(self, fingerprint: str) -> None:
        """After the commit that opened a session of ``fingerprint``: one more in the count kept (if any)."""
        if fingerprint in self.siblings:
            self.siblings[fingerprint] += 1

    def may_be_heads(self, fingerprint: str, digests: Iterable[str]) -> bool:
        """False when none of ``digests`` is the head digest of a session of the opening (on SQLite: nothing need
        be looked up); True when one may be (on PostgreSQL always: other replicas write too)."""
        if self.conn.dialect != "sqlite":
            return True
        entry = self.head_digests.get(fingerprint)
        if entry is None or len(entry[0]) > entry[1]:
            kept = {str(d) for (d,) in self.conn.execute(
                "SELECT DISTINCT head_digest FROM sessions WHERE fingerprint = ?", [fingerprint])}
            entry = (kept, 2 * len(kept) + _SLACK)
            _keep(self.head_digests, fingerprint, entry)
        return not entry[0].isdisjoint(digests)

    def moved_head(self, fingerprint: str | None, digest: str) -> None:
        """In the transaction that moves a session of opening ``fingerprint`` (None: a named one) to the head
        ``digest``, before it commits: kept, if the opening's digests are."""
        entry = self.head_digests.get(fingerprint) if fingerprint is not None else None
        if entry is not None:
            entry[0].add(digest)

    def forget_openings(self) -> None:
        """Sessions were removed, or another process wrote the journal (or a transaction failed): read again."""
        self.siblings.clear()
        self.head_digests.clear()


def _keep(kept: dict[str, V], fingerprint: str, value: V) -> None:
    if fingerprint not in kept and len(kept) >= OPENINGS_KEPT:
        kept.pop(next(iter(kept)))
    kept[fingerprint] = value
