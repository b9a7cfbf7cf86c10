"""The Responses API's stored responses, kept so that ``previous_response_id`` chains can be expanded.

A Responses client may send only its newest input and name the response it continues; the upstream (a chat
server) keeps nothing, so the proxy keeps each response it produced as the whole conversation up to it (input
items, then output items), and the front expands a chained request from it (``proxy.edge.fronts.responses``).

Plain functions over a ``Journal`` (``writer.call(keep_response, ...)``), so the Journal class stays as is.
"""

from __future__ import annotations

import json
from typing import Any

from ctxproxy.store.journal import Journal

__all__ = ["keep_response", "kept_response"]


def keep_response(journal: Journal, response_id: str, items: list[Any], created_at: str) -> None:
    """Keep the conversation ``items`` (inputs then outputs) as response ``response_id``; a repeat is ignored."""
    with journal.conn:
        journal.conn.execute("INSERT INTO kept_responses (id, items, created_at) VALUES (?, ?, ?)"
                             " ON CONFLICT DO NOTHING",
                             (response_id, json.dumps(items, ensure_ascii=False), created_at))


def kept_response(journal: Journal, response_id: str) -> list[Any] | None:
    """The conversation kept as ``response_id``, or None when the proxy holds no such response."""
    row = journal.conn.execute("SELECT items FROM kept_responses WHERE id = ?", (response_id,)).fetchone()
    return None if row is None else list(json.loads(row[0]))
