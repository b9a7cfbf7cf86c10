"""The journal's verbs for what a projection cut: decisions, overflow bodies, and the forward that used them.

A mixin of ``Journal`` (same connection, same single writer). ``record_forward`` writes, in one transaction and
before anything is forwarded, the decisions a projection made, the bodies it cut (content-addressed blobs scoped
to the session by an ``overflow`` row) and the message list that goes upstream, delta-encoded against the list the
caller names (usually the session's previous projection), so a long session still costs O(total bytes). A body
made of messages the journal holds already (a fold, a result spilled or elided whole) is not stored again: an
``overflow_spans`` row names them in the request's own list, and ``overflow_body`` rebuilds it, byte for byte.
Likewise a decision whose replacement is the whole content of a message that went upstream names that message
(``replaced_by``) instead of holding the text a second time.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ctxproxy.store.ancestry import AncestryMixin
from ctxproxy.store.deltas import added_json, runs
from ctxproxy.store.replaced import ReplacedTexts
from ctxproxy.store.sql import Connection

__all__ = ["CutsMixin", "ForwardRecord", "OverflowBody", "SpansMixin"]

_DECISION_FIELDS = ("kind", "target", "message_hash", "replacement", "overflow_id", "until", "count", "source")


@dataclass(frozen=True)
class OverflowBody:
    overflow_id: str
    body: str
    tool: str
    call_id: str
    span: tuple[int, int] | None = None
    """``[start, end)`` of the request's own messages the body is made of (stored already): the body is named, not
    stored again. ``part`` "messages": their JSON array (a fold; ``body`` is empty); "content": the one message's
    content."""
    size: int = 0
    """With ``span``: the byte length of the body."""
    part: str = "messages"


@dataclass(frozen=True)
class ForwardRecord:
    """One attempt upstream. ``verbatim``: the request's own list and bytes went; else the projected list, given as
    ``added`` hashes and bodies after the first ``base_len`` messages of list ``base_list_id``."""

    request_id: int
    attempt: int
    session_id: str
    created_at: str
    params_hash: str
    verbatim: bool
    own_list: bool = False
    """Not verbatim, but the request's own messages went as they came (what changed is the tool list, e.g. the
    context tools listed): the row names the request's list, as a verbatim one does."""
    length: int = 0
    base_list_id: int | None = None
    base_len: int = 0
    added_hashes: Sequence[str] = ()
    added_bodies: Sequence[bytes | None] = ()
    """None: a message of the request itself, whose body the journal has (``record_request``)."""
    base_hashes: Sequence[str] = ()
    """The hashes of list ``base_list_id``, whole (when known): what the added hashes repeat of it after an early
    change is stored as runs (``store.deltas``), not again."""
    decisions: Sequence[Mapping[str, Any]] = ()
    overflow: Sequence[OverflowBody] = field(default_factory=tuple)
    estimate: int | None = None
    k: float | None = None
    samples: int | None = None
    """The calibration's sample count in force (``k``'s weight): with ``k``, what a restart rebuilds it from."""
    request_list_id: int | None = None
    """The request's own list (``RecordedRequest.list_id``), which a verbatim or own-list row names: given, it is not
    read back from the request's row (one statement of ~20 a small request, issue #13)."""

    def new_bytes(self) -> int:
        """About what journaling it writes: the bodies it adds, and the cut bodies it stores whole (a span names
        stored ones). A forward of a long session's next request adds a few KB, whatever its request's size."""
        return sum(len(b) for b in self.added_bodies if b is not None) + sum(len(o.body) for o in self.overflow)


class SpansMixin:
    """Cut bodies the journal holds already, as spans of the cutting request's own message list: written in O(1),
    whatever they cover, and rebuilt on read from the stored message bodies."""

    conn: Connection

    if TYPE_CHECKING:  # provided by Journal
        def message_hashes(self, list_id: int) -> list[str]: ...

    def _insert_spans(self, session_id: str, spans: Sequence[OverflowBody], created_at: str,
                      request_id: int | None, list_id: int | None = None) -> None:
        """``list_id``: the request's list, when the caller knows it (``ForwardRecord.request_list_id``)."""
        row = (list_id,) if list_id is not None else self.conn.execute(
            "SELECT list_id FROM requests WHERE id = ?", [request_id]).fetchone()
        if row is None:
            raise ValueError(f"a cut names messages of request {request_id}, which the journal does not hold")
        self.conn.executemany(
            "INSERT INTO overflow_spans (session_id, id, list_id, start, count, part, tool, call_id, bytes, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            [(session_id, b.overflow_id, row[0], b.span[0], b.span[1] - b.span[0], b.part, b.tool, b.call_id, b.size,
              created_at) for b in spans if b.span is not None])

    def _span_body(self, overflow_id: str, sessions: Sequence[str] | None) -> dict[str, Any] | None:
        """A body rebuilt from the stored messages it is made of: the JSON array of them (a fold), or the one
        message's content (a result); None when no such span is in scope, or it does not hash to its id."""
        row = self.conn.execute(*_first_in(
            "SELECT session_id, list_id, start, count, part, tool, call_id, bytes, created_at FROM overflow_spans"
            " WHERE id = ?", overflow_id, "session_id", sessions)).fetchone()
        if row is None:
            return None
        session_id, list_id, start, count, part, tool, call_id, nbytes, created_at = row
        bodies = self._raw_bodies(self.message_hashes(int(list_id))[start:start + count])
        body = "[" + ",".join(bodies) + "]" if part == "messages" else json.loads(bodies[0])["content"]
        if hashlib.sha256(body.encode()).hexdigest() != overflow_id:
            return None
        return {"id": overflow_id, "session_id": session_id, "tool": tool, "call_id": call_id, "bytes": nbytes,
                "created_at": created_at, "body": body}

    def _raw_bodies(self, hashes: Sequence[str]) -> list[str]:
        """The stored text of each message of ``hashes``, in order (undecoded: byte for byte what was hashed)."""
        found: dict[str, str] = {}
        unique = list(dict.fromkeys(hashes))
        for start in range(0, len(unique), 500):
            chunk = unique[start:start + 500]
            query = f"SELECT hash, body FROM blobs WHERE hash IN ({','.join('?' * len(chunk))})"
            found.update(self.conn.execute(query, chunk).fetchall())
        return [found[h] for h in hashes]


class OpsMixin:
    """The model's context-tool calls as the journal keeps them, and the scorecard read from them."""

    conn: Connection

    def record_context_op(self, op: Mapping[str, Any]) -> None:
        """One context-tool call the proxy executed (``op``: the columns of ``context_ops`` but ``id``)."""
        with self.conn:
            self.conn.execute(
                "INSERT INTO context_ops (session_id, request_id, round, op, ok, arguments, result, handles,"
                " tokens_freed, overflow_ids, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [op["session_id"], op["request_id"], op["round"], op["op"], int(op["ok"]), op["arguments"],
                 op["result"], json.dumps(op["handles"]), op["tokens_freed"], json.dumps(op["overflow_ids"]),
                 op["created_at"]])

    def mirror_revisions(self, session_id: str) -> int:
        """How many mirror revisions of the session were accepted: ``ctx commit`` calls that applied cuts (a commit
        that cut nothing names no handle)."""
        row = self.conn.execute("SELECT COUNT(*) FROM context_ops WHERE session_id = ? AND op = 'commit' AND ok = 1"
                                " AND handles != '[]'", [session_id]).fetchone()
        return int(row[0])

    def scorecard(self) -> list[dict[str, Any]]:
        """One row per turn (a person's message and the rounds it started): tokens in and out, per round and per
        tool call, and the model's context ops."""
        rows = self.conn.execute(_SCORECARD).fetchall()
        keys = ("session_id", "turn", "rounds", "tool_calls", "input_tokens", "output_tokens", "status", "pins",
                "unpins", "drops", "notes", "tokens_freed")
        return [_score(dict(zip(keys, row, strict=True))) for row in rows]


class CutsMixin(SpansMixin, OpsMixin, AncestryMixin):
    conn: Connection

    if TYPE_CHECKING:  # provided by Journal
        def message_hashes(self, list_id: int) -> list[str]: ...
        def blobs(self, hashes: Sequence[str]) -> list[Any]: ...

    def record_forward(self, rec: ForwardRecord) -> int:
        """Journal one forward with its decisions and cut bodies; returns the id of the list that went upstream."""
        with self.conn:
            return self.write_forward(rec)

    def write_forward(self, rec: ForwardRecord) -> int:
        """``record_forward`` inside the caller's transaction."""
        if rec.overflow:
            self._insert_overflow(rec.session_id, rec.overflow, rec.created_at, rec.request_id, rec.request_list_id)
        if rec.decisions:
            self.insert_decisions(rec.session_id, rec.request_id, rec.decisions, rec.created_at)
        list_id = self._forward_list(rec)
        self.conn.execute(
            "INSERT INTO forwards (request_id, attempt, list_id, params_hash, verbatim, estimate, k, samples)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [rec.request_id, rec.attempt, list_id, rec.params_hash, int(rec.verbatim), rec.estimate, rec.k,
             rec.samples])
        return list_id

    def add_decisions(self, session_id: str, decisions: Sequence[Mapping[str, Any]], created_at: str,
                      request_id: int | None = None, overflow: Sequence[OverflowBody] = ()) -> None:
        """Decisions from outside a projection (the operator's pins, the model's context tools), with the bodies
        they cut, in one transaction."""
        with self.conn:
            self._insert_overflow(session_id, overflow, created_at, request_id)
            self.insert_decisions(session_id, request_id, decisions, created_at)

    def insert_decisions(self, session_id: str, request_id: int | None, decisions: Sequence[Mapping[str, Any]],
                         created_at: str) -> None:
        """``decisions``: the fields of ``_DECISION_FIELDS``, and ``replaced_by`` when the replacement is the whole
        content of that message of the forward (its hash): the text is then not stored again (``m013``)."""
        self.conn.executemany(
            "INSERT INTO decisions (session_id, request_id, kind, target, message_hash, replacement, overflow_id,"
            " until, count, source, created_at, replaced_by) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [(session_id, request_id, *_decision_values(d), created_at, d.get("replaced_by")) for d in decisions])

    def _insert_overflow(self, session_id: str, bodies: Sequence[OverflowBody], created_at: str,
                         request_id: int | None = None, list_id: int | None = None) -> None:
        spans = [b for b in bodies if b.span is not None and request_id is not None]
        if spans:  # the journal holds these bodies already: named, not stored again
            self._insert_spans(session_id, spans, created_at, request_id, list_id)
            bodies = [b for b in bodies if b.span is None or request_id is None]
        self.conn.executemany("INSERT INTO blobs (hash, kind, body, chars) VALUES (?, 'overflow', ?, ?)"
                              " ON CONFLICT DO NOTHING",
                              [(b.overflow_id, b.body, len(b.body)) for b in bodies])
        self.conn.executemany(
            "INSERT INTO overflow (session_id, id, tool, call_id, bytes, created_at) VALUES (?, ?, ?, ?, ?, ?)"
            " ON CONFLICT DO NOTHING",
            [(session_id, b.overflow_id, b.tool, b.call_id, len(b.body.encode()), created_at) for b in bodies])

    def _forward_list(self, rec: ForwardRecord) -> int:
        if rec.verbatim or rec.own_list:
            if rec.request_list_id is not None:
                return rec.request_list_id
            row = self.conn.execute("SELECT list_id FROM requests WHERE id = ?", [rec.request_id]).fetchone()
            return int(row[0])
        self.conn.executemany(
            "INSERT INTO blobs (hash, kind, body, chars) VALUES (?, 'message', ?, ?) ON CONFLICT DO NOTHING",
            [(h, b.decode(), len(b)) for h, b in zip(rec.added_hashes, rec.added_bodies, strict=True)
             if b is not None])
        return self.insert_forward_list(rec)

    def insert_forward_list(self, rec: ForwardRecord) -> int:
        """The forwarded list after the first ``base_len`` messages of its base: the hashes added, a stretch of the
        base's after an early change named as a run (``store.deltas``, given the base's hashes)."""
        added = runs(rec.base_hashes, rec.added_hashes)
        based = rec.base_len > 0 or any(not isinstance(item, str) for item in added)
        return self.conn.insert(
            "INSERT INTO message_lists (base_id, base_len, added, length) VALUES (?, ?, ?, ?)",
            [rec.base_list_id if based else None, rec.base_len, added_json(added), rec.length])

    # --- reads ------------------------------------------------------------------------------------------------
    def decisions(self, session_id: str) -> list[dict[str, Any]]:
        """The session's decisions in order, after those it inherited from its ancestors up to each fork."""
        ancestors, own = self.decision_chain(session_id)
        return [row for sid, upto in ancestors for _, row in self.decisions_upto(sid, upto)] + own

    def decision_chain(self, session_id: str) -> tuple[list[tuple[str, int]], list[dict[str, Any]]]:
        """``decisions`` in two parts: the (ancestor, last decision inherited) pairs, oldest first, whose rows never
        change (the journal only appends: a caller may share them between forks), and the session's own rows."""
        ancestors = [(sid, upto) for sid, upto in self._ancestry(session_id)[:-1] if upto is not None]
        return ancestors, [row for _, row in self.decisions_upto(session_id, None)]

    def decisions_upto(self, session_id: str, upto: int | None, after: int = 0) -> list[tuple[int, dict[str, Any]]]:
        """(id, row) of a session's own decisions after decision ``after``, up to decision ``upto`` (None: all)."""
        sql, params = _DECISIONS, [session_id, after]
        if upto is not None:
            sql, params = sql + " AND id <= ?", [*params, upto]
        rows = self.conn.execute(sql + " ORDER BY id", params).fetchall()
        texts = self.replaced_texts.read(self.conn, (row[-1] for row in rows if row[-1] is not None))
        return [(row[0], _decision_row(row, texts)) for row in rows]

    @cached_property
    def replaced_texts(self) -> ReplacedTexts:
        """The replacement texts read back by reference (``store.replaced``), kept for the next load."""
        return ReplacedTexts()

    def overflow_body(self, overflow_id: str, session_id: str | None = None) -> dict[str, Any] | None:
        """A cut body, restorable byte for byte: for a session, only one cut in it or inherited by it."""
        sessions = [sid for sid, _ in self._ancestry(session_id)] if session_id else None
        row = self.conn.execute(*_first_in(
            "SELECT o.session_id, o.tool, o.call_id, o.bytes, o.created_at, b.body FROM overflow o"
            " JOIN blobs b ON b.hash = o.id WHERE o.id = ?", overflow_id, "o.session_id", sessions)).fetchone()
        if row is None:
            return self._span_body(overflow_id, sessions)
        keys = ("session_id", "tool", "call_id", "bytes", "created_at", "body")
        return {"id": overflow_id} | dict(zip(keys, row, strict=True))

    def head_messages(self, session_id: str) -> list[Any]:
        """The messages of the session's latest request, decoded."""
        row = self.conn.execute("SELECT head_list_id FROM sessions WHERE id = ?", [session_id]).fetchone()
        if row is None or row[0] is None:
            return []
        hashes = self.message_hashes(int(row[0]))
        return self.blobs(hashes)

    def calibration_samples(self, session_id: str, model: str | None, limit: int = 8) -> list[tuple[int, int]]:
        """(estimate, prompt_tokens) of the session's latest answered forwards for ``model``, oldest first."""
        rows = self.conn.execute(
            "SELECT f.estimate, p.prompt_tokens FROM forwards f JOIN requests r ON r.id = f.request_id"
            " JOIN responses p ON p.request_id = f.request_id AND p.attempt = f.attempt"
            " WHERE r.session_id = ? AND r.model IS NOT DISTINCT FROM ? AND f.estimate > 0 AND p.prompt_tokens > 0"
            " ORDER BY f.id DESC LIMIT ?", [session_id, model, limit]).fetchall()
        return [(int(e), int(p)) for e, p in reversed(rows)]


_DECISIONS = (f"SELECT id, {', '.join(_DECISION_FIELDS)}, replaced_by FROM decisions"
              " WHERE session_id = ? AND id > ?")
"""A session's decisions, each with the message its replacement is the content of (``m013``; NULL: none)."""


def _decision_values(decision: Mapping[str, Any]) -> list[Any]:
    """The columns of ``_DECISION_FIELDS``, the replacement left out ('') when the decision names the message
    whose content it is."""
    values = [decision[f] for f in _DECISION_FIELDS]
    if decision.get("replaced_by"):
        values[_DECISION_FIELDS.index("replacement")] = ""
    return values


def _decision_row(row: Sequence[Any], texts: Mapping[str, str]) -> dict[str, Any]:
    """A decision as it was made: a replacement stored by reference is the named message's content (``texts``, by
    hash: decoded from its canonical JSON, the string exactly as it went upstream)."""
    decision = dict(zip(_DECISION_FIELDS, row[1:-1], strict=True))
    if row[-1] is not None:
        decision["replacement"] = texts[row[-1]]
    return decision


def _score(row: dict[str, Any]) -> dict[str, Any]:
    total = row["input_tokens"] + row["output_tokens"]
    ops = {k: row.pop(k) for k in ("status", "pins", "unpins", "drops", "notes", "tokens_freed")}
    out = {**row, "total_tokens": total,
           "tokens_per_round": round(total / row["rounds"], 1) if row["rounds"] and total else None,
           "tokens_per_tool_call": round(total / row["tool_calls"], 1) if row["tool_calls"] and total else None}
    if any(ops.values()):
        out["context_ops"] = ops
    return out


_SCORECARD = """
WITH turns AS (
    SELECT session_id, turn, MIN(id) AS first_request, COUNT(*) AS rounds, MAX(received_at) AS last_seen
      FROM requests GROUP BY session_id, turn
), per_request AS (
    SELECT r.session_id, r.turn, r.id,
           (SELECT COUNT(*) FROM json_each((SELECT added FROM message_lists WHERE id = r.list_id)) j
              JOIN blobs b ON b.hash = j.value
             WHERE CASE WHEN b.kind = 'message' THEN json_extract(b.body, '$.role') END = 'tool') AS tool_results,
           (SELECT CAST(COALESCE(SUM(p.prompt_tokens), 0) AS BIGINT) FROM responses p WHERE p.request_id = r.id)
               AS input_tokens,
           (SELECT CAST(COALESCE(SUM(p.completion_tokens), 0) AS BIGINT) FROM responses p WHERE p.request_id = r.id)
               AS output_tokens
      FROM requests r
), ops AS (
    SELECT r.session_id, r.turn,
           CAST(SUM(CASE WHEN c.op = 'status' THEN 1 ELSE 0 END) AS BIGINT) AS status,
           CAST(SUM(CASE WHEN c.op = 'pin' AND c.ok = 1 THEN 1 ELSE 0 END) AS BIGINT) AS pins,
           CAST(SUM(CASE WHEN c.op = 'unpin' AND c.ok = 1 THEN 1 ELSE 0 END) AS BIGINT) AS unpins,
           CAST(SUM(CASE WHEN c.op = 'drop' AND c.ok = 1 THEN 1 ELSE 0 END) AS BIGINT) AS drops,
           CAST(SUM(CASE WHEN c.op = 'note' AND c.ok = 1 THEN 1 ELSE 0 END) AS BIGINT) AS notes,
           CAST(SUM(c.tokens_freed) AS BIGINT) AS tokens_freed
      FROM context_ops c JOIN requests r ON r.id = c.request_id GROUP BY r.session_id, r.turn
)
SELECT t.session_id, t.first_request, t.rounds,
       (SELECT CAST(SUM(q.tool_results) AS BIGINT) FROM per_request q
         WHERE q.session_id = t.session_id AND q.turn = t.turn),
       (SELECT CAST(SUM(q.input_tokens) AS BIGINT) FROM per_request q
         WHERE q.session_id = t.session_id AND q.turn = t.turn),
       (SELECT CAST(SUM(q.output_tokens) AS BIGINT) FROM per_request q
         WHERE q.session_id = t.session_id AND q.turn = t.turn),
       COALESCE(o.status, 0), COALESCE(o.pins, 0), COALESCE(o.unpins, 0), COALESCE(o.drops, 0),
       COALESCE(o.notes, 0), COALESCE(o.tokens_freed, 0)
  FROM turns t LEFT JOIN ops o ON o.session_id = t.session_id AND o.turn = t.turn
 ORDER BY t.last_seen DESC
"""


def _first_in(sql: str, overflow_id: str, column: str, sessions: Sequence[str] | None) -> tuple[str, list[Any]]:
    """``sql`` (one ``?``: the id) narrowed to the rows whose ``column`` is one of ``sessions`` (None: any), first
    row only."""
    if sessions is None:
        return sql + " LIMIT 1", [overflow_id]
    return f"{sql} AND {column} IN ({','.join('?' * len(sessions))}) LIMIT 1", [overflow_id, *sessions]
