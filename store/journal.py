"""The append-only journal: every request, what went upstream and what came back, per session.

``Journal`` is synchronous and owns one connection (``store.sql``): a SQLite file (WAL), or a PostgreSQL database
shared by several proxy processes. It exposes verbs, not SQL: ``record_request``
(which also resolves the session), ``record_response``, and the reads the operator surface needs. The calls of a
process go through ``store.writer``: one thread on SQLite (one writer), a few on PostgreSQL, each with its own
``Journal``.

The class is assembled from cohesive parts on the same connection: the session placement (``store.placement``:
which session a request continues or forks), the reads (``store.reads``; the inspector's: ``store.inspect``), the
forwards and their cut bodies (``store.cuts``), crash recovery (``store.recovery``) and retention
(``store.retention``). Callers name the verbs on ``Journal`` alone (``writer.call(Journal.record_request, ...)``),
wherever they are defined.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import orjson

from ctxproxy.store.cuts import CutsMixin, ForwardRecord
from ctxproxy.store.deltas import added_json
from ctxproxy.store.inspect import InspectMixin
from ctxproxy.store.liveness import instance_id
from ctxproxy.store.migrate import apply
from ctxproxy.store.migrations import STEPS
from ctxproxy.store.placement import Placement, PlacementMixin
from ctxproxy.store.prefixes import PrefixDigests, index_new_list, joined_segment
from ctxproxy.store.reads import ReadsMixin
from ctxproxy.store.records import IncomingRequest, RecordedRequest, ResponseRecord, prefix_digest
from ctxproxy.store.recovery import RecoveryMixin
from ctxproxy.store.retention import RetentionMixin
from ctxproxy.store.sql import Location, connect, is_postgres

__all__ = ["IncomingRequest", "Journal", "RecordedRequest", "ResponseRecord", "prefix_digest"]

T = TypeVar("T")


class Journal(PlacementMixin, ReadsMixin, CutsMixin, InspectMixin, RecoveryMixin, RetentionMixin):
    """One database at ``location`` (``store.sql.Location``): a SQLite file, a ``postgresql://`` URL, or None (SQLite
    in memory, incognito: nothing touches the disk). ``migrate=False``: the schema is known to be current (another
    connection of the same process migrated it)."""

    def __init__(self, location: Location, sync: str = "normal", *, migrate: bool = True) -> None:
        self.location = location
        self.path = None if location is None or is_postgres(location) else Path(location)
        """The SQLite file (None in memory or on PostgreSQL)."""
        self.sync = sync
        self.conn = connect(location, sync)
        if migrate:
            try:
                apply(self.conn, STEPS)
            except BaseException:
                self.conn.close()
                raise
        self.interrupted: dict[str, tuple[str, ...]] = {}
        self.siblings: dict[str, int] = {}
        self.head_digests = {}
        self.digest_rows = {}
        self.ancestries = {}
        self.shown_mirrors: dict[str, Any] = {}
        """Per session, the mirror lists this connection inserted last, with their items and chains' depths
        (``store.session_state.Shown``, which imports this module; ``_SHOWN_KEPT`` sessions at most)."""
        self.instance = instance_id() if self.conn.dialect == "postgresql" else None
        """The process its requests record (``store.liveness``): on a shared store only."""

    def close(self) -> None:
        self.conn.close()

    def reopen(self) -> Journal:
        """Another connection to the same database (a writer thread's own, ``store.writer``)."""
        reopened = Journal(self.location, self.sync, migrate=False)
        reopened.instance = self.instance
        return reopened

    # --- writes -------------------------------------------------------------------------------------------------
    def record_request(self, req: IncomingRequest, claim_opened: bool = False) -> RecordedRequest:
        """Resolve the session and journal the request, in one transaction (its forwards follow, ``record_forward``).

        ``claim_opened``: a session the request opens by its opening is claimed by it (``store.claims``) in the same
        transaction, not in one of its own after: nothing can join such a session before its first answer
        (placement continues no pending head), so nothing can claim it in between. A named session can be joined at
        once (the same name, in parallel): it is claimed under its lock, as any session."""
        # One transaction, committed on success, rolled back on any error; and no other process places a request
        # of this session (its name or opening) until it ends.
        with self.conn.transaction(lock=req.session_name or req.fingerprint):
            digests = PrefixDigests(req.hashes)
            place = self._place(req, digests)
            joined = joined_segment(self.conn, place.base_list_id if place.common else None, place.common)
            list_id = self._insert_list(req, place, joined)
            index_new_list(self.conn, list_id, digests, place.common, joined)
            self._insert_blob(req.params_hash, "params", req.params_body)
            request_id = self._insert_request(req, place.session.id, list_id)
            claimed = request_id if claim_opened and place.created and req.session_name is None else None
            head = digests.at(len(req.hashes))
            self._advance_head(place.session.id, list_id, req, head, claimed)
            self.moved_head(req.fingerprint if req.session_name is None else None, head)
        self.continued_interrupted(req.fingerprint if req.session_name is None else None, place.session.id)
        if place.created:
            self.remember_ancestry(place.session.id, place.parent_id, place.inherit_upto)
            if req.session_name is None:
                self.opened_sibling(req.fingerprint)
        self.after_request()
        forked = place.created and place.parent_id is not None
        return RecordedRequest(request_id, place.session.id, place.parent_id, forked, len(req.hashes) - place.common,
                               list_id, place.common, place.created)

    def record_request_and_read(self, req: IncomingRequest, read: Callable[[Journal, RecordedRequest], T],
                                claim_opened: bool = False) -> tuple[RecordedRequest, T | None]:
        """``record_request``, then ``read``: what the caller reads next about the request, in the same call on the
        journal's thread (each call there costs the request path a thread hand-off). A failed read gives None,
        for the caller to read again; the request is journaled either way."""
        recorded = self.record_request(req, claim_opened)
        try:
            return recorded, read(self, recorded)
        except self.conn.Error:
            return recorded, None

    def record_response(self, rec: ResponseRecord, forward: ForwardRecord | None = None) -> None:
        """The answer to one attempt; with ``forward``, the forward row it answers (a verbatim forward with nothing
        new is journaled with its answer, so the request's path waits for one transaction, not two)."""
        if forward is None:  # one statement is its own transaction: on PostgreSQL one round trip, not three
            self._insert_response(rec)
            return
        with self.conn:
            self.write_forward(forward)
            self._insert_response(rec)

    def mark_interrupted(self, now: str) -> int:
        marked = super().mark_interrupted(now)
        self.forget_interrupted()
        return marked

    def after_request(self) -> None:
        """Runs after each journaled request, outside its transaction: nothing here; the incognito journal keeps
        within its bound (``store.memory``). ``Journal.record_request`` is what callers name, so this is the seam."""

    # --- inserts ------------------------------------------------------------------------------------------------
    def _insert_response(self, rec: ResponseRecord) -> None:
        usage = rec.usage or {}
        self.conn.execute(
            "INSERT INTO responses (request_id, attempt, outcome, status, body, prompt_tokens, completion_tokens,"
            " usage, ttfb_ms, total_ms, finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [rec.request_id, rec.attempt, rec.outcome, rec.status, rec.body,
             _int_or_none(usage.get("prompt_tokens")), _int_or_none(usage.get("completion_tokens")),
             _usage_json(rec.usage) if rec.usage else None, rec.ttfb_ms, rec.total_ms, rec.finished_at],
        )

    def _insert_blob(self, digest: str, kind: str, body: bytes) -> None:
        # ON CONFLICT DO NOTHING: content-addressed, so a body seen before (any session) is already there.
        self.conn.execute("INSERT INTO blobs (hash, kind, body, chars) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                          [digest, kind, body.decode(), len(body)])

    def _insert_list(self, req: IncomingRequest, place: Placement, segment: int | None) -> int:
        added = req.hashes[place.common:]
        self.conn.executemany(
            "INSERT INTO blobs (hash, kind, body, chars) VALUES (?, 'message', ?, ?) ON CONFLICT DO NOTHING",
            [(h, b.decode(), len(b)) for h, b in zip(added, req.bodies[place.common:], strict=True)],
        )
        return self.conn.insert(
            "INSERT INTO message_lists (base_id, base_len, added, length, segment) VALUES (?, ?, ?, ?, ?)",
            [place.base_list_id if place.common else None, place.common, added_json(list(added)), len(req.hashes),
             segment],
        )

    def _insert_request(self, req: IncomingRequest, session_id: str, list_id: int) -> int:
        return self.conn.insert(
            "INSERT INTO requests (session_id, received_at, path, model, stream, list_id, params_hash, headers,"
            " body_bytes, turn, instance) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [session_id, req.received_at, req.path, req.model, int(req.stream), list_id, req.params_hash,
             orjson.dumps(dict(req.headers)).decode(), req.body_bytes, req.turn, self.instance],  # 0.4 µs, not 4
        )


def _usage_json(usage: Mapping[str, Any]) -> str:
    """An answer's usage as JSON: by orjson (0.3 µs, where the stdlib took 4 of every answer), or by the stdlib
    where orjson refuses (an integer past 64 bits, a key that is not a string), so no usage is lost."""
    try:
        return orjson.dumps(usage).decode()
    except TypeError:  # orjson's JSONEncodeError
        return json.dumps(usage)


def _int_or_none(value: Any) -> int | None:
    """An integer SQLite can hold (a larger one would make the insert raise and lose the row), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and -2 ** 63 <= value < 2 ** 63 else None
