"""Session placement: which session a request continues, or which it opens (named, continued, or forked).

A mixin of ``Journal`` (same connection, same single writer), run inside ``record_request``'s transaction.
A request either names its session (the session header) or is matched by fingerprint (first system + first user
message). A fingerprinted request continues the session whose head (its last message list) is a prefix of the
request's messages; if none is, it opens a child of the same-fingerprint session it shares the most messages
with. A prefix is checked by a digest over the message hashes, so no earlier list is loaded: a head by its own
digest, a shorter shared prefix by the prefix index (``store.prefixes``), a binary search of indexed SELECTs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ctxproxy.store.prefixes import PrefixDigests, common_prefix, list_digest
from ctxproxy.store.records import IncomingRequest, prefix_digest
from ctxproxy.store.recovery import ANSWERED, INTERRUPTED
from ctxproxy.store.sql import Connection

__all__ = ["Head", "Placement", "PlacementMixin"]


@dataclass(frozen=True)
class Head:
    """A session as placement sees it: its last message list (the head) and whether that can be continued."""

    id: str
    list_id: int | None
    length: int
    digest: str
    updated_at: str
    pending: int = 0
    """1 while the head's own request has no answer yet: nothing can continue it before that answer exists."""
    interrupted: int = 0
    """1 when the head's own request was in flight when the proxy died (``store.recovery``)."""


@dataclass(frozen=True)
class Placement:
    """Where a request lands: its session, and the list its messages are delta-encoded against."""

    session: Head
    base_list_id: int | None
    common: int
    created: bool
    parent_id: str | None


class PlacementMixin:
    conn: Connection

    if TYPE_CHECKING:  # provided by Journal (store.reads)
        def message_hashes(self, list_id: int) -> list[str]: ...

    def _place(self, req: IncomingRequest, digests: PrefixDigests) -> Placement:
        """``digests``: the request's prefix digests (``req.hashes``), shared by every comparison."""
        if req.session_name is not None:
            head = self._head(req.session_name)
            if head is None:
                return self._open(req, req.session_name, parent=None, shared=0, fingerprint=None)
            return Placement(head, head.list_id, self._common_with(head, digests), False, None)
        candidates = self._heads_by_fingerprint(req.fingerprint)
        head = _continued(candidates, digests, self._answered_heads(candidates))
        if head is not None:
            return Placement(head, head.list_id, head.length, False, None)
        parent, shared = self._closest(candidates[-_FORK_CANDIDATES:], digests)
        return self._open(req, self._new_id(req.fingerprint, len(candidates)), parent, shared, req.fingerprint)

    def _open(self, req: IncomingRequest, session_id: str, parent: Head | None, shared: int,
              fingerprint: str | None) -> Placement:
        self.conn.execute(
            "INSERT INTO sessions (id, fingerprint, named, parent_id, shared_len, created_at, updated_at,"
            " head_list_id, head_len, head_digest, requests, model) VALUES (?, ?, ?, ?, ?, ?, ?, NULL, 0, ?, 0, ?)",
            [session_id, fingerprint, int(fingerprint is None), parent.id if parent else None, shared,
             req.received_at, req.received_at, prefix_digest([]), req.model],
        )
        if parent is not None:
            self.conn.execute("UPDATE sessions SET inherit_upto = (SELECT COALESCE(MAX(id), 0) FROM decisions"
                              " WHERE session_id = ?) WHERE id = ?", [parent.id, session_id])
        head = Head(session_id, None, 0, prefix_digest([]), req.received_at)
        base = parent.list_id if parent and shared else None
        return Placement(head, base, shared if base else 0, True, parent.id if parent else None)

    def _new_id(self, fingerprint: str, siblings: int) -> str:
        stem = f"s-{fingerprint[:12]}"
        n = siblings + 1
        candidate = stem if n == 1 else f"{stem}-{n}"
        while self._head(candidate) is not None:
            n += 1
            candidate = f"{stem}-{n}"
        return candidate

    def _closest(self, candidates: Sequence[Head], digests: PrefixDigests) -> tuple[Head | None, int]:
        """The same-fingerprint session sharing the longest message prefix with the request (a fork's parent); of
        those sharing as much, the first. Each later candidate is only searched for a longer prefix."""
        best: tuple[Head | None, int] = (None, 0)
        for head in candidates:
            common = self._common_with(head, digests, at_least=best[1] if best[0] is not None else 0)
            if common > best[1] or best[0] is None:
                best = (head, common)
        return best

    def _common_with(self, head: Head, digests: PrefixDigests, at_least: int = 0) -> int:
        """The messages the head shares with the request (``at_least`` when no more than that)."""
        if _extends(digests, head):
            return head.length
        if head.list_id is None:
            return at_least
        return common_prefix(self.conn, head.list_id, head.length, digests, self.message_hashes, at_least)

    def _advance_head(self, session_id: str, list_id: int, req: IncomingRequest, digest: str) -> None:
        self.conn.execute(
            "UPDATE sessions SET head_list_id = ?, head_len = ?, head_digest = ?, updated_at = ?,"
            " requests = requests + 1, model = COALESCE(?, model) WHERE id = ?",
            [list_id, len(req.hashes), digest, req.received_at, req.model, session_id],
        )

    def _head(self, session_id: str) -> Head | None:
        row = self.conn.execute(
            "SELECT id, head_list_id, head_len, head_digest, updated_at FROM sessions WHERE id = ?", [session_id]
        ).fetchone()
        return Head(*row) if row else None

    def _heads_by_fingerprint(self, fingerprint: str) -> list[Head]:
        rows = self.conn.execute(
            "SELECT h.id, h.head_list_id, h.head_len, h.head_digest, h.updated_at,"
            f" NOT {ANSWERED.format(request='h.last')},"
            f" EXISTS (SELECT 1 FROM responses p WHERE p.request_id = h.last AND p.outcome = '{INTERRUPTED}')"
            " FROM (SELECT s.*, (SELECT MAX(r.id) FROM requests r WHERE r.session_id = s.id) AS last"
            "       FROM sessions s WHERE s.fingerprint = ?) h ORDER BY h.updated_at, h.id", [fingerprint]
        ).fetchall()
        return [Head(*row) for row in rows]

    def _answered_heads(self, candidates: Sequence[Head]) -> list[Head]:
        """For a session whose last request was interrupted: its history as of its last answered request, which
        the client's next step after the crash may extend instead of retrying the lost one."""
        out: list[Head] = []
        for head in (h for h in candidates if h.interrupted):
            row = self.conn.execute(
                "SELECT r.list_id, r.received_at, l.length FROM requests r JOIN message_lists l ON l.id = r.list_id"
                f" WHERE r.session_id = ? AND {ANSWERED.format(request='r.id')} AND NOT EXISTS (SELECT 1 FROM"
                f" responses p WHERE p.request_id = r.id AND p.outcome = '{INTERRUPTED}') ORDER BY r.id DESC LIMIT 1",
                [head.id]).fetchone()
            if row is not None:
                digest = list_digest(self.conn, int(row[0]), int(row[2]), self.message_hashes)
                out.append(Head(head.id, int(row[0]), int(row[2]), digest, row[1]))
        return out


_FORK_CANDIDATES = 8
"""A new run's parent is looked for among the most recently active sessions of its opening only."""


def _continued(candidates: Sequence[Head], hashes: PrefixDigests, answered: Sequence[Head] = ()) -> Head | None:
    """The session this request continues, if any.

    A continuation carries the head and more (the head's answer, the next result). A request that merely
    equals a head is a retry, or a second run replaying the same first steps: it goes where it strictly extends
    a head if such a session exists (so two runs never swap sessions), else to the equal one. A head whose own
    request is still unanswered cannot be continued yet: a request matching it is a parallel run. A session
    whose last request was interrupted by a crash is also continued from ``answered``, its last answered history
    (then from the longest of its two heads the request extends).
    """
    matching = [h for h in candidates if not h.pending and _extends(hashes, h)]
    matching += [h for h in answered if _extends(hashes, h)]
    strict = [h for h in matching if h.length < len(hashes)]
    chosen = strict or matching
    if not chosen:
        return None
    best = max(chosen, key=lambda h: (h.length, h.updated_at))
    return max((h for h in matching if h.id == best.id), key=lambda h: h.length)


def _extends(hashes: PrefixDigests, head: Head) -> bool:
    return head.length <= len(hashes) and hashes.at(head.length) == head.digest
