"""The journal's reads for the inspector (``/ctx/ui``): what went upstream per request, and what was cut.

A mixin of ``Journal`` (same connection). The operator's question is "what did the model see, and why": the
forward rows name the list that went upstream (delta-encoded like the client's lists); the decisions and the
overflow rows say what was cut, by whom, and where its body is; the context ops say what the model did itself.
A session's lists are rebuilt in one pass, oldest first, each from the one before it, so a session of R rounds
costs O(total hashes) here, not O(R²) walks down the delta chain.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ctxproxy.store.deltas import rebuild
from ctxproxy.store.sql import Connection

__all__ = ["InspectMixin"]


class InspectMixin:
    conn: Connection

    if TYPE_CHECKING:  # provided by Journal
        def message_hashes(self, list_id: int) -> list[str]: ...
        def blobs(self, hashes: Sequence[str]) -> list[Any]: ...
        def _rows(self, sql: str, params: Sequence[Any]) -> list[dict[str, Any]]: ...

    def forward(self, request_id: int, attempt: int | None = None) -> dict[str, Any] | None:
        """What went upstream for one attempt of a request (the last one by default): the request's parameters
        with the forwarded messages in place of the client's, and the estimate and ratio it was sent under."""
        sql = ("SELECT f.attempt, f.list_id, f.verbatim, f.estimate, f.k, b.body FROM forwards f"
               " JOIN blobs b ON b.hash = f.params_hash WHERE f.request_id = ?")
        params: list[Any] = [request_id]
        if attempt is not None:
            sql, params = sql + " AND f.attempt = ?", [request_id, attempt]
        row = self.conn.execute(sql + " ORDER BY f.attempt DESC LIMIT 1", params).fetchone()
        if row is None:
            return None
        attempts = [a for (a,) in self.conn.execute(
            "SELECT attempt FROM forwards WHERE request_id = ? ORDER BY attempt", [request_id])]
        hashes = self.message_hashes(int(row[1]))
        body = json.loads(row[5]) | {"messages": self.blobs(hashes)}
        return {"request_id": request_id, "attempt": row[0], "attempts": attempts, "verbatim": bool(row[2]),
                "estimate": row[3], "k": row[4], "hashes": hashes, "body": body}

    def session_rounds(self, session_id: str, tail: int = 0) -> list[dict[str, Any]]:
        """Every request of the session (the last ``tail`` if given), oldest first: its answer, and the hashes of
        the list the client sent and of the list that went upstream on its last attempt (``sent_hashes``; None
        when nothing was forwarded)."""
        since = 0
        if tail:
            row = self.conn.execute("SELECT id FROM requests WHERE session_id = ? ORDER BY id DESC LIMIT 1 OFFSET ?",
                                    [session_id, tail - 1]).fetchone()
            since = row[0] if row else 0
        rows = self._rows(_ROUNDS, [session_id, since])
        lists = self._lists({r["list_id"] for r in rows} | {r["sent_list_id"] for r in rows} - {None})
        for row in rows:
            row["hashes"] = lists[row.pop("list_id")]
            sent = row.pop("sent_list_id")
            row["sent_hashes"] = None if sent is None else lists[sent]
        return rows

    def session_cuts(self, session_id: str) -> list[dict[str, Any]]:
        """The session's decisions in order (cuts, pins, folds) with the body each cut stored, if any."""
        return self._rows(_CUTS, [session_id])

    def session_ops(self, session_id: str) -> list[dict[str, Any]]:
        """The context-tool calls the proxy executed for the model in this session, in order."""
        rows = self._rows("SELECT id, request_id, round, op, ok, arguments, result, handles, tokens_freed,"
                          " overflow_ids, created_at FROM context_ops WHERE session_id = ? ORDER BY id", [session_id])
        for row in rows:
            row["ok"] = bool(row["ok"])
            row["handles"], row["overflow_ids"] = json.loads(row["handles"]), json.loads(row["overflow_ids"])
        return rows

    def session_children(self) -> dict[str, list[str]]:
        """Each forked-from session's children."""
        children: dict[str, list[str]] = {}
        for child, parent in self.conn.execute("SELECT id, parent_id FROM sessions WHERE parent_id IS NOT NULL"
                                               " ORDER BY created_at"):
            children.setdefault(parent, []).append(child)
        return children

    def _lists(self, ids: set[int]) -> dict[int, list[str]]:
        """The hashes of lists ``ids``, read in one query and built oldest first, each on its base when the base is
        among them (the usual case: a session's lists extend one another); else from the base's whole chain."""
        known: dict[int, list[str]] = {}
        wanted = sorted(ids)
        rows: list[tuple[int, int | None, int, str]] = []
        for start in range(0, len(wanted), 500):
            chunk = wanted[start:start + 500]
            rows += self.conn.execute("SELECT id, base_id, base_len, added FROM message_lists"
                                      f" WHERE id IN ({','.join('?' * len(chunk))})", chunk).fetchall()
        for list_id, base_id, base_len, added in sorted(rows):
            if base_id is None:
                known[list_id] = json.loads(added)
            else:
                base = known[base_id] if base_id in known else self.message_hashes(base_id)
                known[list_id] = rebuild(base, base_len, added)
        return known


_ROUNDS = """
SELECT r.id AS request_id, r.received_at, r.model, r.list_id, f.list_id AS sent_list_id, f.verbatim, f.estimate,
       f.k, p.outcome, p.status, p.prompt_tokens, p.completion_tokens, p.total_ms,
       (SELECT COUNT(*) FROM responses a WHERE a.request_id = r.id) AS attempts
  FROM requests r
  LEFT JOIN forwards f ON f.request_id = r.id
   AND f.attempt = (SELECT MAX(x.attempt) FROM forwards x WHERE x.request_id = r.id)
  LEFT JOIN responses p ON p.request_id = r.id
   AND p.attempt = (SELECT MAX(a.attempt) FROM responses a WHERE a.request_id = r.id)
 WHERE r.session_id = ? AND r.id >= ?
 ORDER BY r.id
"""

_CUTS = """
SELECT d.id, d.request_id, d.kind, d.target, d.overflow_id, d.until, d.count, d.source, d.created_at,
       COALESCE(o.tool, s.tool) AS tool, COALESCE(o.call_id, s.call_id) AS call_id,
       COALESCE(o.bytes, s.bytes) AS bytes
  FROM decisions d
  LEFT JOIN overflow o ON o.id = d.overflow_id AND o.session_id = d.session_id
  LEFT JOIN overflow_spans s ON s.id = d.overflow_id AND s.session_id = d.session_id  -- a body named by its place
 WHERE d.session_id = ?
 ORDER BY d.id
"""
