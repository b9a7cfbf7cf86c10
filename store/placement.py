"""Session placement: which session a request continues, or which it opens (named, continued, or forked).

A mixin of ``Journal`` (same connection, same single writer), run inside ``record_request``'s transaction.
A request either names its session (the session header) or is matched by fingerprint (first system + first user
message). A fingerprinted request continues the session whose head (its last message list) is a prefix of the
request's messages; if none is, it opens a child of the same-fingerprint session it shares the most messages
with. A prefix is checked by a digest over the message hashes, so no earlier list is loaded: a head by its own
digest, a shorter shared prefix by the prefix index (``store.prefixes``), a binary search of indexed SELECTs.

Placement reads only what it needs of the opening's sessions, however many there are (a benchmark that sends new
text each time makes one per request): the heads whose digest the request starts with, the 8 most recent (a new
run's parent), their count (a new id), and the ones whose last request was interrupted, read once per opening.
Each of those is a search of an index of ``sessions`` that starts with the opening (``m014``), not a visit of every
session of the opening: before, the 8 most recent were sorted from all of them and the distinct head lengths read
from every row, a third of a new run's time on the journal's thread after a thousand runs of one opening.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from ctxproxy.store.liveness import is_dead
from ctxproxy.store.openings import OPENINGS_KEPT, OpeningsMixin
from ctxproxy.store.prefixes import DigestRows, PrefixDigests, common_prefix, holder, list_digest
from ctxproxy.store.records import IncomingRequest, prefix_digest
from ctxproxy.store.recovery import ANSWERED, INTERRUPTED, MARK_ABANDONED
from ctxproxy.store.sql import Connection

__all__ = ["Head", "Placement", "PlacementMixin"]


class Head(NamedTuple):
    """A session as placement sees it: its last message list (the head) and whether that can be continued. A named
    tuple: a new run builds ~9 from rows, which cost 2 µs each as a frozen dataclass (issue #13)."""

    id: str
    list_id: int | None
    length: int
    digest: str
    updated_at: str
    pending: int = 0
    """1 while the head's own request has no answer yet: nothing can continue it before that answer exists."""


@dataclass(frozen=True)
class Placement:
    """Where a request lands: its session, and the list its messages are delta-encoded against."""

    session: Head
    base_list_id: int | None
    common: int
    created: bool
    parent_id: str | None
    inherit_upto: int | None = None
    """A session it opens as a fork: the parent's last decision it inherits."""


class PlacementMixin(OpeningsMixin):
    conn: Connection
    digest_rows: DigestRows
    """The prefix index's rows placement read (``store.prefixes._digest_row``; SQLite only: on a shared store
    another replica may prune)."""
    interrupted: dict[str, tuple[str, ...]]
    """Per opening (fingerprint), its sessions whose last request was interrupted (``_interrupted_sessions``)."""
    instance: str | None
    """This process's instance id on a shared store (``store.liveness``), else None."""

    if TYPE_CHECKING:  # provided by Journal (store.reads)
        def message_hashes(self, list_id: int) -> list[str]: ...

    def _place(self, req: IncomingRequest, digests: PrefixDigests) -> Placement:
        """``digests``: the request's prefix digests (``req.hashes``), shared by every comparison."""
        if req.session_name is not None:
            head = self._head(req.session_name)
            if head is None:
                return self._open(req, [req.session_name], parent=None, shared=0, fingerprint=None)
            return Placement(head, head.list_id, self._common_with(head, digests), False, None)
        extended = _ended_if_dead(self.conn, self.instance, self._heads_extended(req.fingerprint, digests))
        head = _continued(extended, digests, self._answered_heads(req.fingerprint))
        if head is not None:
            return Placement(head, head.list_id, head.length, False, None)
        parent, shared = _closest(self._recent_heads(req.fingerprint),
                                  lambda head, at_least: self._common_with(head, digests, at_least))
        return self._open(req, _new_ids(req.fingerprint, self._siblings(req.fingerprint)), parent, shared,
                          req.fingerprint)

    def _open(self, req: IncomingRequest, ids: Iterable[str], parent: Head | None, shared: int,
              fingerprint: str | None) -> Placement:
        """A new session under the first of ``ids`` that no session has yet (a name: the one; an opening's: its
        next number up, ``_new_ids``). Taken by the insert itself, which skips an id in use: a lookup of each
        candidate first was one of the ~20 statements of a small fork (issue #13)."""
        parent_id = parent.id if parent else None
        sql = _OPEN_FORK if parent_id is not None else _OPEN
        for session_id in ids:
            row = self.conn.execute(sql, [
                session_id, fingerprint, int(fingerprint is None), parent_id, shared, req.received_at,
                req.received_at, prefix_digest([]), req.model, *([parent_id] if parent_id is not None else [])
            ]).fetchone()
            if row is not None:
                break
        else:
            raise ValueError("the session's name is in use")  # a name is opened only when no session has it
        upto = None if row[1] is None else int(row[1])
        head = Head(session_id, None, 0, prefix_digest([]), req.received_at)
        base = holder(self.conn, parent.list_id, shared, self.digest_rows if self.conn.dialect == "sqlite" else None
                      ) if parent and parent.list_id is not None and shared else None
        return Placement(head, base, shared if base else 0, True, parent_id, upto)

    def _common_with(self, head: Head, digests: PrefixDigests, at_least: int = 0) -> int:
        """The messages the head shares with the request (``at_least`` when no more than that). A head no longer
        than the request that it does not start: all of it is not shared, so the search stops one short (a new run
        of the peers' benchmark shares 2 of its 3 messages with each of the 8 recent runs, 3-message heads: after the
        first, nothing is read for the other 7; before, ~12 lookups of the prefix index on every new run)."""
        if _extends(digests, head):
            return head.length
        most = head.length - 1 if head.length <= len(digests) else head.length
        if head.list_id is None or min(most, len(digests)) <= at_least:  # the peers' new runs: 7 of their 8
            return at_least
        return common_prefix(self.conn, head.list_id, most, digests, self.message_hashes, at_least,
                             self.digest_rows if self.conn.dialect == "sqlite" else None)

    def _advance_head(self, session_id: str, list_id: int, req: IncomingRequest, digest: str,
                      claimed_by: int | None = None) -> None:
        """The session's head is the request's list; ``claimed_by``: the request that claims it (``store.claims``)."""
        self.conn.execute(
            "UPDATE sessions SET head_list_id = ?, head_len = ?, head_digest = ?, updated_at = ?,"
            " requests = requests + 1, model = COALESCE(?, model), claimed_by = COALESCE(?, claimed_by) WHERE id = ?",
            [list_id, len(req.hashes), digest, req.received_at, req.model, claimed_by, session_id],
        )

    def _head(self, session_id: str) -> Head | None:
        row = self.conn.execute(
            "SELECT id, head_list_id, head_len, head_digest, updated_at FROM sessions WHERE id = ?", [session_id]
        ).fetchone()
        return Head(*row) if row else None

    def _heads_extended(self, fingerprint: str, digests: PrefixDigests) -> list[Head]:
        """The opening's sessions whose head the request starts with (equal digests at the head's length), oldest
        first, with ``pending``. The heads' distinct lengths are found by skipping through an index
        (``_HEAD_LENGTHS``), not by reading every session of the opening. A short request has few prefixes: all
        their digests are looked up at once, without the lengths (one statement of ~20 a small fork, issue #13)."""
        if len(digests) <= _ALL_PREFIXES:
            wanted = sorted({digests.at(0), *(digest for _, digest in digests.run(0, len(digests)))})
        else:
            lengths = [int(n) for (n,) in self.conn.execute(_HEAD_LENGTHS, [fingerprint, fingerprint, len(digests),
                                                                             len(digests)])]
            wanted = sorted({digests.at(n) for n in lengths})
        if not self.may_be_heads(fingerprint, wanted):  # a new run, a fork: no head is any of them
            return []
        rows: list[tuple[Any, ...]] = []
        for start in range(0, len(wanted), _CHUNK):
            chunk = wanted[start:start + _CHUNK]
            rows += self.conn.execute(f"{_EXTENDED} AND head_digest IN ({','.join('?' * len(chunk))})",
                                      [fingerprint, *chunk]).fetchall()
        return [Head(*row) for row in sorted(rows, key=lambda r: (r[4], r[0]))]

    def _recent_heads(self, fingerprint: str) -> list[Head]:
        """The opening's most recently active sessions, oldest first: where a new run looks for its parent."""
        rows = self.conn.execute(
            "SELECT id, head_list_id, head_len, head_digest, updated_at FROM sessions WHERE fingerprint = ?"
            " ORDER BY updated_at DESC, id DESC LIMIT ?", [fingerprint, _FORK_CANDIDATES]).fetchall()
        return [Head(*row) for row in reversed(rows)]

    def _answered_heads(self, fingerprint: str) -> list[Head]:
        """For a session whose last request was interrupted: its history as of its last answered request, which
        the client's next step after the crash may extend instead of retrying the lost one."""
        out: list[Head] = []
        for session_id in self._interrupted_sessions(fingerprint):
            row = self.conn.execute(_LAST_ANSWERED, [session_id, session_id]).fetchone()
            if row is not None:
                digest = list_digest(self.conn, int(row[0]), int(row[2]), self.message_hashes)
                out.append(Head(session_id, int(row[0]), int(row[2]), digest, row[1]))
        return out

    def _interrupted_sessions(self, fingerprint: str) -> tuple[str, ...]:
        """The opening's sessions whose last request was interrupted, oldest first: read once per opening, then
        kept (only a start marks requests interrupted, and a session stops being one with its next request;
        ``_answered_heads`` checks each again). ``forget_interrupted`` drops what is kept."""
        if self.conn.dialect == "postgresql":  # other replicas mark and continue them: nothing kept here is sure
            return tuple(str(r[0]) for r in self.conn.execute(_INTERRUPTED_HEADS, [fingerprint]))
        known = self.interrupted.get(fingerprint)
        if known is None:
            known = tuple(str(r[0]) for r in self.conn.execute(_INTERRUPTED_HEADS, [fingerprint]))
            if len(self.interrupted) >= OPENINGS_KEPT:
                self.interrupted.pop(next(iter(self.interrupted)))
            self.interrupted[fingerprint] = known
        return known

    def continued_interrupted(self, fingerprint: str | None, session_id: str) -> None:
        """After a committed request in ``session_id``: its last request is no longer the interrupted one."""
        known = self.interrupted.get(fingerprint) if fingerprint is not None else None
        if known and session_id in known:
            self.interrupted[fingerprint] = tuple(s for s in known if s != session_id)  # type: ignore[index]

    def forget_digests(self) -> None:
        """Lists were removed, or another process wrote the journal: the prefix index is read again."""
        self.digest_rows.clear()

    def forget_interrupted(self) -> None:
        """Requests were marked interrupted, or another process wrote the journal: read them again when asked."""
        self.interrupted.clear()


def _closest(candidates: Sequence[Head], common_with: Callable[[Head, int], int]) -> tuple[Head | None, int]:
    """The same-fingerprint session sharing the longest message prefix with the request (a fork's parent); of those
    sharing as much, the first. ``common_with(head, at_least)``: what the head shares, or at most ``at_least`` when
    no more than that (``PlacementMixin._common_with``). The longest heads are searched first, each later one only
    for a prefix that would win: a fork's parent is usually the longest, and then a head no longer than what it
    shares needs no lookup at all (before, the 7 other recent sessions were each searched: a third of a fork's
    placement)."""
    best: tuple[int, int] | None = None  # (candidate's index, messages shared)
    for i in sorted(range(len(candidates)), key=lambda i: -candidates[i].length):
        if best is None:
            best = (i, common_with(candidates[i], 0))
            continue
        wins_tie = i < best[0]
        common = common_with(candidates[i], max(0, best[1] - wins_tie))
        if common > best[1] or (common == best[1] and wins_tie):
            best = (i, common)
    return (None, 0) if best is None else (candidates[best[0]], best[1])


_FORK_CANDIDATES = 8
"""A new run's parent is looked for among the most recently active sessions of its opening only."""

_OPEN_ROW = ("INSERT INTO sessions (id, fingerprint, named, parent_id, shared_len, created_at, updated_at,"
             " head_list_id, head_len, head_digest, requests, model, inherit_upto)"
             " VALUES (?, ?, ?, ?, ?, ?, ?, NULL, 0, ?, 0, ?, {upto})"
             " ON CONFLICT (id) DO NOTHING RETURNING id, inherit_upto")
"""A session opened (no row back: its id is taken); a fork (``_OPEN_FORK``) inherits its parent's decisions up to
the last one, read in the same statement (an ``UPDATE`` of the row after it was one of the ~20 statements of a
small fork, issue #13)."""
_OPEN_FORK = _OPEN_ROW.format(upto="(SELECT COALESCE(MAX(id), 0) FROM decisions WHERE session_id = ?)")
_OPEN = _OPEN_ROW.format(upto="NULL")

_CHUNK = 500
"""Digests per ``IN (...)``: well under any database's limit on parameters of one statement."""

_ALL_PREFIXES = 16
"""A request of at most this many messages looks up the digests of all its prefixes (``_heads_extended``): that
many probes of ``sessions_by_opening_digest`` cost less than the statement that finds the heads' lengths."""

_HEAD_LENGTHS = (
    "WITH RECURSIVE lengths(n) AS (SELECT MIN(head_len) FROM sessions WHERE fingerprint = ?"
    " UNION ALL SELECT (SELECT MIN(s.head_len) FROM sessions s WHERE s.fingerprint = ? AND s.head_len > lengths.n)"
    " FROM lengths WHERE lengths.n < ?) SELECT n FROM lengths WHERE n IS NOT NULL AND n <= ?")
"""The distinct head lengths of an opening's sessions up to the request's length, each one lookup in
``sessions_by_opening_length`` (the next length above the last): as many lookups as lengths, however many sessions
share them (every request of the peers' benchmark opens one of length 3)."""

_EXTENDED = ("SELECT h.id, h.head_list_id, h.head_len, h.head_digest, h.updated_at,"
             f" NOT {ANSWERED.format(request='(SELECT MAX(r.id) FROM requests r WHERE r.session_id = h.id)')}"
             " FROM sessions h WHERE h.fingerprint = ?")
"""The heads of an opening's sessions with ``pending`` (the head's own request unanswered), to narrow by digest."""

_LAST_REQUEST = "(SELECT MAX(r.id) FROM requests r WHERE r.session_id = {session})"

_INTERRUPTED = ("EXISTS (SELECT 1 FROM responses p WHERE p.request_id = {request}"
                f" AND p.outcome = '{INTERRUPTED}')")

_INTERRUPTED_HEADS = (
    "SELECT s.id FROM sessions s WHERE s.fingerprint = ?"
    f" AND {_INTERRUPTED.format(request=_LAST_REQUEST.format(session='s.id'))} ORDER BY s.updated_at, s.id")
"""The sessions of an opening whose last request was interrupted (``store.recovery``)."""

_LAST_ANSWERED = (
    "SELECT r.list_id, r.received_at, l.length FROM requests r JOIN message_lists l ON l.id = r.list_id"
    f" WHERE r.session_id = ? AND {ANSWERED.format(request='r.id')} AND NOT {_INTERRUPTED.format(request='r.id')}"
    f" AND {_INTERRUPTED.format(request=_LAST_REQUEST.format(session='?'))} ORDER BY r.id DESC LIMIT 1")
"""A session's last answered request, when its last request was interrupted (else no row)."""


def _new_ids(fingerprint: str, siblings: int) -> Iterator[str]:
    """An opening's next session ids, from the one its count of sessions names: ``s-`` and 12 hex digits of the
    fingerprint, then ``-2``, ``-3``... (an id can be in use already: a session named so, or a count read before
    another was opened)."""
    stem = f"s-{fingerprint[:12]}"
    n = siblings + 1
    while True:
        yield stem if n == 1 else f"{stem}-{n}"
        n += 1


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


def _ended_if_dead(conn: Connection, instance: str | None, heads: list[Head]) -> list[Head]:
    """A shared store's pending heads whose request's process is dead (``store.liveness``): journaled
    ``interrupted`` here, as a restart marks a single process's (``store.recovery``), so the agent's resend
    continues the session from its last answer (``_answered_heads``) instead of forking it as a parallel run.
    Under the placement's lock, so two replicas placing requests of the opening agree. ``instance``: this
    process's (None: SQLite, one process, where nothing is asked)."""
    if instance is None:
        return heads
    return [_ended(conn, instance, head) if head.pending else head for head in heads]


def _ended(conn: Connection, instance: str, head: Head) -> Head:
    row = conn.execute("SELECT id, instance FROM requests WHERE session_id = ? ORDER BY id DESC LIMIT 1",
                       [head.id]).fetchone()
    if row is None or row[1] is None or row[1] == instance or not is_dead(conn, str(row[1])):
        return head
    conn.execute(MARK_ABANDONED, [datetime.now(UTC).isoformat(timespec="milliseconds"), int(row[0])])
    return head._replace(pending=0)
