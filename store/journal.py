"""The append-only journal: every request, what went upstream and what came back, per session.

``Journal`` is synchronous and owns one SQLite connection (WAL). It exposes verbs, not SQL: ``record_request``
(which also resolves the session), ``record_response``, and the reads the operator surface needs. All writes of a
process go through one ``Journal`` driven by one thread (see ``store.writer``), so there is exactly one writer.

The class is assembled from cohesive parts on the same connection: the session placement (``store.placement``:
which session a request continues or forks), the reads (``store.reads``; the inspector's: ``store.inspect``), the
forwards and their cut bodies (``store.cuts``), crash recovery (``store.recovery``) and retention
(``store.retention``). Callers name the verbs on ``Journal`` alone (``writer.call(Journal.record_request, ...)``),
wherever they are defined.
"""
from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlite_utils import Database

from ctxproxy.store.cuts import CutsMixin, ForwardRecord
from ctxproxy.store.inspect import InspectMixin
from ctxproxy.store.migrations import migrations
from ctxproxy.store.placement import Placement, PlacementMixin
from ctxproxy.store.prefixes import PrefixDigests, index_list
from ctxproxy.store.reads import ReadsMixin
from ctxproxy.store.records import IncomingRequest, RecordedRequest, ResponseRecord, prefix_digest
from ctxproxy.store.recovery import RecoveryMixin
from ctxproxy.store.retention import RetentionMixin

__all__ = ["IncomingRequest", "Journal", "RecordedRequest", "ResponseRecord", "prefix_digest"]

T = TypeVar("T")


class Journal(PlacementMixin, ReadsMixin, CutsMixin, InspectMixin, RecoveryMixin, RetentionMixin):
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
        self.interrupted = {}

    def close(self) -> None:
        self.db.conn.close()

    # --- writes -------------------------------------------------------------------------------------------------
    def record_request(self, req: IncomingRequest) -> RecordedRequest:
        """Resolve the session and journal the request, in one transaction (its forwards follow, ``record_forward``)."""
        with self.conn:  # one transaction: committed on success, rolled back on any error
            digests = PrefixDigests(req.hashes)
            place = self._place(req, digests)
            list_id = self._insert_list(req, place)
            index_list(self.conn, list_id, digests, place.base_list_id if place.common else None, place.common)
            self._insert_blob(req.params_hash, "params", req.params_body)
            request_id = self._insert_request(req, place.session.id, list_id)
            self._advance_head(place.session.id, list_id, req, digests.at(len(req.hashes)))
        self.continued_interrupted(req.fingerprint if req.session_name is None else None, place.session.id)
        self.after_request()
        forked = place.created and place.parent_id is not None
        return RecordedRequest(request_id, place.session.id, place.parent_id, forked, len(req.hashes) - place.common,
                               list_id, place.common, place.created)

    def record_request_and_read(self, req: IncomingRequest,
                                read: Callable[[Journal, RecordedRequest], T]) -> tuple[RecordedRequest, T | None]:
        """``record_request``, then ``read``: what the caller reads next about the request, in the same call on the
        journal's thread (each call there costs the request path a thread hand-off). A failed read gives None,
        for the caller to read again; the request is journaled either way."""
        recorded = self.record_request(req)
        try:
            return recorded, read(self, recorded)
        except sqlite3.Error:
            return recorded, None

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

    def mark_interrupted(self, now: str) -> int:
        marked = super().mark_interrupted(now)
        self.forget_interrupted()
        return marked

    def after_request(self) -> None:
        """Runs after each journaled request, outside its transaction: nothing here; the incognito journal keeps
        within its bound (``store.memory``). ``Journal.record_request`` is what callers name, so this is the seam."""

    # --- inserts ------------------------------------------------------------------------------------------------
    def _insert_blob(self, digest: str, kind: str, body: bytes) -> None:
        # INSERT OR IGNORE: content-addressed, so a body seen before (any session) is already there.
        self.conn.execute("INSERT OR IGNORE INTO blobs (hash, kind, body, chars) VALUES (?, ?, ?, ?)",
                        [digest, kind, body.decode(), len(body)])

    def _insert_list(self, req: IncomingRequest, place: Placement) -> int:
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


def _int_or_none(value: Any) -> int | None:
    """An integer SQLite can hold (a larger one would make the insert raise and lose the row), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and -2 ** 63 <= value < 2 ** 63 else None
