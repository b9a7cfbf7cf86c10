"""The journal's reads: message lists rebuilt from their deltas, bodies by hash, and the operator's summaries.

A mixin of ``Journal`` (same connection): what ``/ctx`` and the CLI show, and what the writes need to know of the
past (a list's hashes).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ctxproxy.store.deltas import rebuild
from ctxproxy.store.sql import Connection

__all__ = ["ReadsMixin", "chain", "chain_hashes"]


class ReadsMixin:
    conn: Connection

    def message_hashes(self, list_id: int) -> list[str]:
        """A list's message hashes, rebuilt from its delta chain (the operator's reads; placement asks the prefix
        index, ``store.prefixes``, instead)."""
        return chain_hashes(self.conn, list_id)

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

    def cuts_by_request(self, session_id: str) -> dict[int, dict[str, int]]:
        """The decisions each request of the session made, counted by kind (the operator's own are not a
        request's): what ``ctxproxy show`` lists per round."""
        out: dict[int, dict[str, int]] = {}
        for request_id, kind, n in self.conn.execute(
                "SELECT request_id, kind, COUNT(*) FROM decisions WHERE session_id = ? AND request_id IS NOT NULL"
                " GROUP BY request_id, kind ORDER BY request_id, kind", [session_id]):
            out.setdefault(request_id, {})[kind] = n
        return out

    def _rows(self, sql: str, params: Sequence[Any]) -> list[dict[str, Any]]:
        cursor = self.conn.execute(sql, list(params))
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def chain_hashes(conn: Connection, list_id: int) -> list[str]:
    """Rebuild a delta-encoded list: its chain of bases in one recursive query (newest first), then the pieces
    concatenated oldest first. One query, not one per base: a list 600 requests deep took 600."""
    return chain(conn, list_id)[0]


def chain(conn: Connection, list_id: int) -> tuple[list[str], int]:
    """``chain_hashes``, and how many lists the chain has."""
    hashes: list[str] = []
    rows = conn.execute(_CHAIN, [list_id]).fetchall()
    for base_len, added in reversed(rows):
        hashes = rebuild(hashes, base_len, added)
    return hashes, len(rows)


_CHAIN = """
WITH RECURSIVE chain(id, base_id, base_len, added, depth) AS (
    SELECT id, base_id, base_len, added, 0 FROM message_lists WHERE id = ?
    UNION ALL
    SELECT l.id, l.base_id, l.base_len, l.added, c.depth + 1 FROM message_lists l JOIN chain c ON l.id = c.base_id
)
SELECT base_len, added FROM chain ORDER BY depth
"""

_SESSION_SUMMARY = """
SELECT s.id, s.parent_id, s.shared_len, s.named, s.created_at, s.updated_at, s.requests, s.head_len AS messages,
       s.model,
       (SELECT p.prompt_tokens FROM requests r2 JOIN responses p ON p.request_id = r2.id
         WHERE r2.session_id = s.id AND p.prompt_tokens IS NOT NULL ORDER BY r2.id DESC LIMIT 1) AS last_prompt_tokens,
       CAST(COALESCE(SUM(resp.prompt_tokens), 0) AS BIGINT) AS prompt_tokens,
       CAST(COALESCE(SUM(resp.completion_tokens), 0) AS BIGINT) AS completion_tokens
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
