"""The values the journal's verbs take and give: a request as the proxy saw it, where it was journaled, an answer.

Plain frozen dataclasses, apart from ``Journal`` so that the modules it is built from (``store.placement``) can
name them without importing the journal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["IncomingRequest", "RecordedRequest", "ResponseRecord", "prefix_digest"]


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
    created: bool = False
    """The request opened its session (a new run, a fork, a new name): nothing of it is known in memory yet."""


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
