"""The append-only journal: every request, what went upstream and what came back, per session.

``Journal`` is synchronous and owns one SQLite connection (WAL). It exposes verbs, not SQL: ``record_request``
(which also resolves the session), ``record_response``, and the reads the operator surface needs. All writes of a
process go through one ``Journal`` driven by one thread (see ``store.writer``), so there is exactly one writer.

Sessions. A request either names its session (the session header) or is matched by fingerprint (first system +
first user message). A fingerprinted request continues the session whose head (its last message list) is a
prefix of the request's messages; if none is, it opens a child of the same-fingerprint session it shares the
most messages with: a second run with the same opening, or an agent that edited its own history, never silently
shares a session. A prefix is checked by a digest over the message hashes, so no earlier list is loaded.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlite_utils import Database

from store.cuts import CutsMixin, ForwardRecord
from store.migrations import migrations
from store.recovery import ANSWERED, INTERRUPTED, RecoveryMixin
from store.retention import RetentionMixin

__all__ = ["IncomingRequest", "Journal", "RecordedRequest", "ResponseRecord", "prefix_digest"]


def prefix_digest(hashes: Sequence[str]) -> str:
    """The identity of a message list: sha256 over its message hashes, joined."""
    return hashlib.sha256("".join(hashes).encode()).hexdigest()


@dataclass(frozen=True)
class IncomingRequest:
    """A validated client request, already reduced to hashes and canonical bodies by the caller."""

    received_at: str
    path: str
    model: str | None
    stream: bool
    session_name: str | None
    fingerprint: str
    hashes: Sequence[str]
    bodies: Sequence[bytes]
    params_hash: str
    params_body: bytes
    headers: Mapping[str, str | None]
    body_bytes: int
    turn: str = ""
    """Hash of the person's latest message in the request: the turn it belongs to."""


@dataclass(frozen=True)
class RecordedRequest:
    request_id: int
    session_id: str
    parent_id: str | None
    forked: bool
    new_messages: int
    list_id: int
    seen: int = 0
    """How many leading messages the session (or the session it forked from) already had."""


@dataclass(frozen=True)
class ResponseRecord:
    request_id: int
    attempt: int
    outcome: str
    status: int
    body: str | None
    usage: Mapping[str, Any] | None
    ttfb_ms: float | None
    total_ms: float | None
    finished_at: str


@dataclass(frozen=True)
class _Head:
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
class _Placement:
    """Where a request lands: its session, and the list its messages are delta-encoded against."""

    session: _Head
    base_list_id: int | None
    common: int
    created: bool
    parent_id: str | None


class Journal(CutsMixin, RecoveryMixin, RetentionMixin):
    """One SQLite database. ``path=None`` keeps everything in memory (incognito: nothing touches the disk)."""

    def __init__(self, path: Path | None, sync: str = "normal") -> None:
        self.path = path
        if path is None:
            conn = sqlite3.connect(":memory:", check_same_thread=False)
            conn.execute("PRAGMA auto_vacuum=INCREMENTAL")  # before any table: lets store.memory give pages back
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(path), check_same_thread=False, timeout=10)
            conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
        conn.execute("PRAGMA foreign_keys=ON")
        self.db = Database(conn, execute_plugins=False)
        migrations.apply(self.db)
        # The request path uses the raw connection: sqlite-utils' execute/atomic wrappers (tracing, savepoint
        # nesting) cost ~0.1 ms a request and buy nothing for these few fixed statements.
        self.conn = conn

    def close(self) -> None:
        self.db.conn.close()

    # --- writes -------------------------------------------------------------------------------------------------
    def record_request(self, req: IncomingRequest) -> RecordedRequest:
        """Resolve the session and journal the request, in one transaction (its forwards follow, ``record_forward``)."""
        with self.conn:  # one transaction: committed on success, rolled back on any error
            place = self._place(req)
            list_id = self._insert_list(req, place)
            self._insert_blob(req.params_hash, "params", req.params_body)
            request_id = self._insert_request(req, place.session.id, list_id)
            self._advance_head(place.session.id, list_id, req)
        self.after_request()
        forked = place.created and place.parent_id is not None
        return RecordedRequest(request_id, place.session.id, place.parent_id, forked, len(req.hashes) - place.common,
                               list_id, place.common)

    def record_response(self, rec: ResponseRecord, forward: ForwardRecord | None = None) -> None:
        """The answer to one attempt; with ``forward``, the forward row it answers (a verbatim forward with nothing
        new is journaled with its answer, so the request's path waits for one transaction, not two)."""
        usage = rec.usage or {}
        with self.conn:
            if forward is not None:
                self.write_forward(forward)
            self.conn.execute(
                "INSERT INTO responses (request_id, attempt, outcome, status, body, prompt_tokens, completion_tokens,"
                " usage, ttfb_ms, total_ms, finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [rec.request_id, rec.attempt, rec.outcome, rec.status, rec.body,
                 _int_or_none(usage.get("prompt_tokens")), _int_or_none(usage.get("completion_tokens")),
                 json.dumps(rec.usage) if rec.usage else None,
                 rec.ttfb_ms, rec.total_ms, rec.finished_at],
            )

    def after_request(self) -> None:
        """Runs after each journaled request, outside its transaction: nothing here; the incognito journal keeps
        within its bound (``store.memory``). ``Journal.record_request`` is what callers name, so this is the seam."""

    # --- session placement --------------------------------------------------------------------------------------
    def _place(self, req: IncomingRequest) -> _Placement:
        if req.session_name is not None:
            head = self._head(req.session_name)
            if head is None:
                return self._open(req, req.session_name, parent=None, shared=0, fingerprint=None)
            return _Placement(head, head.list_id, self._common_with(head, req.hashes), False, None)
        candidates = self._heads_by_fingerprint(req.fingerprint)
        head = _continued(candidates, req.hashes, self._answered_heads(candidates))
        if head is not None:
            return _Placement(head, head.list_id, head.length, False, None)
        parent, shared = self._closest(candidates[-_FORK_CANDIDATES:], req.hashes)
        return self._open(req, self._new_id(req.fingerprint, len(candidates)), parent, shared, req.fingerprint)

    def _open(self, req: IncomingRequest, session_id: str, parent: _Head | None, shared: int,
              fingerprint: str | None) -> _Placement:
        self.conn.execute(
            "INSERT INTO sessions (id, fingerprint, named, parent_id, shared_len, created_at, updated_at,"
            " head_list_id, head_len, head_digest, requests, model) VALUES (?, ?, ?, ?, ?, ?, ?, NULL, 0, ?, 0, ?)",
            [session_id, fingerprint, int(fingerprint is None), parent.id if parent else None, shared,
             req.received_at, req.received_at, prefix_digest([]), req.model],
        )
        if parent is not None:
            self.conn.execute("UPDATE sessions SET inherit_upto = (SELECT COALESCE(MAX(id), 0) FROM decisions"
                              " WHERE session_id = ?) WHERE id = ?", [parent.id, session_id])
        head = _Head(session_id, None, 0, prefix_digest([]), req.received_at)
        base = parent.list_id if parent and shared else None
        return _Placement(head, base, shared if base else 0, True, parent.id if parent else None)

    def _new_id(self, fingerprint: str, siblings: int) -> str:
        stem = f"s-{fingerprint[:12]}"
        n = siblings + 1
        candidate = stem if n == 1 else f"{stem}-{n}"
        while self._head(candidate) is not None:
            n += 1
            candidate = f"{stem}-{n}"
        return candidate

    def _closest(self, candidates: Sequence[_Head], hashes: Sequence[str]) -> tuple[_Head | None, int]:
        """The same-fingerprint session sharing the longest message prefix with ``hashes`` (a fork's parent)."""
        best: tuple[_Head | None, int] = (None, 0)
        for head in candidates:
            common = self._common_with(head, hashes)
            if common > best[1] or best[0] is None:
                best = (head, common)
        return best

    def _common_with(self, head: _Head, hashes: Sequence[str]) -> int:
        if head.length <= len(hashes) and prefix_digest(hashes[: head.length]) == head.digest:
            return head.length
        stored = self.message_hashes(head.list_id) if head.list_id is not None else []
        return next((i for i, (a, b) in enumerate(zip(stored, hashes, strict=False)) if a != b),
                    min(len(stored), len(hashes)))

    def _advance_head(self, session_id: str, list_id: int, req: IncomingRequest) -> None:
        self.conn.execute(
            "UPDATE sessions SET head_list_id = ?, head_len = ?, head_digest = ?, updated_at = ?,"
            " requests = requests + 1, model = COALESCE(?, model) WHERE id = ?",
            [list_id, len(req.hashes), prefix_digest(req.hashes), req.received_at, req.model, session_id],
        )

    # --- inserts ------------------------------------------------------------------------------------------------
    def _insert_blob(self, digest: str, kind: str, body: bytes) -> None:
        # INSERT OR IGNORE: content-addressed, so a body seen before (any session) is already there.
        self.conn.execute("INSERT OR IGNORE INTO blobs (hash, kind, body, chars) VALUES (?, ?, ?, ?)",
                        [digest, kind, body.decode(), len(body)])

    def _insert_list(self, req: IncomingRequest, place: _Placement) -> int:
        added = req.hashes[place.common:]
        self.conn.executemany(
            "INSERT OR IGNORE INTO blobs (hash, kind, body, chars) VALUES (?, 'message', ?, ?)",
            [(h, b.decode(), len(b)) for h, b in zip(added, req.bodies[place.common:], strict=True)],
        )
        cursor = self.conn.execute(
            "INSERT INTO message_lists (base_id, base_len, added, length) VALUES (?, ?, ?, ?)",
            [place.base_list_id if place.common else None, place.common, json.dumps(list(added)), len(req.hashes)],
        )
        return int(cursor.lastrowid or 0)

    def _insert_request(self, req: IncomingRequest, session_id: str, list_id: int) -> int:
        cursor = self.conn.execute(
            "INSERT INTO requests (session_id, received_at, path, model, stream, list_id, params_hash, headers,"
            " body_bytes, turn) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [session_id, req.received_at, req.path, req.model, int(req.stream), list_id, req.params_hash,
             json.dumps(dict(req.headers)), req.body_bytes, req.turn],
        )
        return int(cursor.lastrowid or 0)

    # --- reads --------------------------------------------------------------------------------------------------
    def _head(self, session_id: str) -> _Head | None:
        row = self.conn.execute(
            "SELECT id, head_list_id, head_len, head_digest, updated_at FROM sessions WHERE id = ?", [session_id]
        ).fetchone()
        return _Head(*row) if row else None

    def _heads_by_fingerprint(self, fingerprint: str) -> list[_Head]:
        rows = self.conn.execute(
            "SELECT h.id, h.head_list_id, h.head_len, h.head_digest, h.updated_at,"
            f" NOT {ANSWERED.format(request='h.last')},"
            f" EXISTS (SELECT 1 FROM responses p WHERE p.request_id = h.last AND p.outcome = '{INTERRUPTED}')"
            " FROM (SELECT s.*, (SELECT MAX(r.id) FROM requests r WHERE r.session_id = s.id) AS last"
            "       FROM sessions s WHERE s.fingerprint = ?) h ORDER BY h.updated_at, h.id", [fingerprint]
        ).fetchall()
        return [_Head(*row) for row in rows]

    def _answered_heads(self, candidates: Sequence[_Head]) -> list[_Head]:
        """For a session whose last request was interrupted: its history as of its last answered request, which
        the client's next step after the crash may extend instead of retrying the lost one."""
        out: list[_Head] = []
        for head in (h for h in candidates if h.interrupted):
            row = self.conn.execute(
                "SELECT r.list_id, r.received_at FROM requests r WHERE r.session_id = ?"
                f" AND {ANSWERED.format(request='r.id')} AND NOT EXISTS (SELECT 1 FROM responses p"
                f" WHERE p.request_id = r.id AND p.outcome = '{INTERRUPTED}') ORDER BY r.id DESC LIMIT 1",
                [head.id]).fetchone()
            if row is not None:
                hashes = self.message_hashes(int(row[0]))
                out.append(_Head(head.id, int(row[0]), len(hashes), prefix_digest(hashes), row[1]))
        return out

    def message_hashes(self, list_id: int) -> list[str]:
        """Rebuild a delta-encoded list by walking its bases (newest first), then concatenating."""
        pieces: list[tuple[int, list[str]]] = []
        current: int | None = list_id
        while current is not None:
            base_id, base_len, added = self.conn.execute(
                "SELECT base_id, base_len, added FROM message_lists WHERE id = ?", [current]).fetchone()
            pieces.append((base_len, json.loads(added)))
            current = base_id
        hashes: list[str] = []
        for base_len, added in reversed(pieces):
            hashes = hashes[:base_len] + added
        return hashes

    def blobs(self, hashes: Sequence[str]) -> list[Any]:
        """The decoded JSON bodies of ``hashes``, in order."""
        found: dict[str, Any] = {}
        unique = list(dict.fromkeys(hashes))
        for start in range(0, len(unique), 500):
            chunk = unique[start:start + 500]
            marks = ",".join("?" * len(chunk))
            for digest, body in self.conn.execute(f"SELECT hash, body FROM blobs WHERE hash IN ({marks})", chunk):
                found[digest] = json.loads(body)
        return [found[h] for h in hashes]

    def sessions(self) -> list[dict[str, Any]]:
        return self._rows(_SESSION_SUMMARY + " GROUP BY s.id ORDER BY s.updated_at DESC", [])

    def session(self, session_id: str) -> dict[str, Any] | None:
        rows = self._rows(_SESSION_SUMMARY + " WHERE s.id = ? GROUP BY s.id", [session_id])
        return rows[0] if rows else None

    def session_journal(self, session_id: str, after: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        return self._rows(_JOURNAL_ROWS, [session_id, after, limit])

    def request(self, request_id: int) -> dict[str, Any] | None:
        """One journaled request in full: its messages (rebuilt), parameters, forward and answer."""
        rows = self._rows("SELECT r.*, b.body AS params FROM requests r JOIN blobs b ON b.hash = r.params_hash"
                          " WHERE r.id = ?", [request_id])
        if not rows:
            return None
        row = rows[0]
        row["params"] = json.loads(row["params"])
        row["headers"] = json.loads(row["headers"])
        row["messages"] = self.blobs(self.message_hashes(row["list_id"]))
        row["responses"] = self._rows("SELECT * FROM responses WHERE request_id = ? ORDER BY attempt", [request_id])
        return row

    def _rows(self, sql: str, params: Sequence[Any]) -> list[dict[str, Any]]:
        cursor = self.conn.execute(sql, list(params))
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


_FORK_CANDIDATES = 8
"""A new run's parent is looked for among the most recently active sessions of its opening only."""


def _continued(candidates: Sequence[_Head], hashes: Sequence[str], answered: Sequence[_Head] = ()) -> _Head | None:
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


def _extends(hashes: Sequence[str], head: _Head) -> bool:
    return head.length <= len(hashes) and prefix_digest(hashes[: head.length]) == head.digest


def _int_or_none(value: Any) -> int | None:
    """An integer SQLite can hold (a larger one would make the insert raise and lose the row), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and -2 ** 63 <= value < 2 ** 63 else None


_SESSION_SUMMARY = """
SELECT s.id, s.parent_id, s.shared_len, s.named, s.created_at, s.updated_at, s.requests, s.head_len AS messages,
       s.model,
       (SELECT p.prompt_tokens FROM requests r2 JOIN responses p ON p.request_id = r2.id
         WHERE r2.session_id = s.id AND p.prompt_tokens IS NOT NULL ORDER BY r2.id DESC LIMIT 1) AS last_prompt_tokens,
       COALESCE(SUM(resp.prompt_tokens), 0) AS prompt_tokens,
       COALESCE(SUM(resp.completion_tokens), 0) AS completion_tokens
  FROM sessions s
  LEFT JOIN requests r ON r.session_id = s.id
  LEFT JOIN responses resp ON resp.request_id = r.id
"""

_JOURNAL_ROWS = """
SELECT r.id AS request_id, r.received_at, r.model, r.stream, r.body_bytes, l.length AS messages,
       json_array_length(l.added) AS new_messages, p.outcome, p.status, p.prompt_tokens, p.completion_tokens,
       p.ttfb_ms, p.total_ms,
       (SELECT COUNT(*) FROM responses a WHERE a.request_id = r.id) AS attempts
  FROM requests r
  JOIN message_lists l ON l.id = r.list_id
  LEFT JOIN responses p ON p.request_id = r.id
   AND p.attempt = (SELECT MAX(a.attempt) FROM responses a WHERE a.request_id = r.id)
 WHERE r.session_id = ? AND r.id > ?
 ORDER BY r.id
 LIMIT ?
"""
"""A request's row shows its last attempt, the answer the client got (an overflow retried, a context round, an
upstream error on a follow-up are earlier attempts: ``request()`` lists them all, and ``attempts`` counts them)."""
