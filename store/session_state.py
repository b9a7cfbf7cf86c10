"""A session's working state, journaled: the offer, the reminder, pending confirmations and the live mirror.

The projection is rebuilt from the decisions; these few values are not derived from anything else, and losing
them (a restart, a session evicted from the proxy's working cache) changed what went upstream: an offer vanished
mid-turn (the tool list changed, the prefix cache broke), a confirmation was never told, the reminder came twice,
a draft of the mirror was overwritten. Each change is one row; the newest row of a session is its state. The
mirror's text as last written is a content-addressed blob, stored once however many rows name it.

Plain functions over a ``Journal`` (``writer.call(record_session_state, ...)``), so the Journal class stays as is.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from store.journal import Journal

__all__ = ["CalibrationInForce", "SessionState", "calibration_in_force", "record_session_state", "session_state"]


@dataclass(frozen=True)
class SessionState:
    offered_turn: str | None = None
    reminded_turn: str | None = None
    confirmations: tuple[str, ...] = ()
    mirror: str | None = None
    """Where LIVE_CONTEXT.json is written (None: the mirror is off)."""
    mirror_text: str | None = None
    """The mirror as last written, while a draft of it may be pending (None once committed or refused)."""


def record_session_state(journal: Journal, session_id: str, request_id: int, state: SessionState,
                         created_at: str) -> None:
    """Journal the session's state as it is after ``request_id`` changed it."""
    digest = None
    with journal.conn:
        if state.mirror_text is not None:
            digest = hashlib.sha256(state.mirror_text.encode()).hexdigest()
            journal.conn.execute("INSERT OR IGNORE INTO blobs (hash, kind, body, chars) VALUES (?, 'mirror', ?, ?)",
                                 [digest, state.mirror_text, len(state.mirror_text)])
        journal.conn.execute(
            "INSERT INTO session_state (session_id, request_id, offered_turn, reminded_turn, confirmations, mirror,"
            " mirror_hash, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [session_id, request_id, state.offered_turn, state.reminded_turn, json.dumps(list(state.confirmations)),
             state.mirror, digest, created_at])


def session_state(journal: Journal, session_id: str) -> SessionState:
    """The session's latest journaled state (the defaults when nothing was journaled)."""
    row = journal.conn.execute(
        "SELECT s.offered_turn, s.reminded_turn, s.confirmations, s.mirror, b.body FROM session_state s"
        " LEFT JOIN blobs b ON b.hash = s.mirror_hash WHERE s.session_id = ? ORDER BY s.id DESC LIMIT 1",
        [session_id]).fetchone()
    if row is None:
        return SessionState()
    offered, reminded, confirmations, mirror, text = row
    return SessionState(offered, reminded, tuple(json.loads(confirmations)), mirror, text)


@dataclass(frozen=True)
class CalibrationInForce:
    """The calibration the session's latest forward for a model was sent under, and what its answer taught."""

    k: float
    samples: int
    learnt: tuple[int, int] | None
    """(estimate, prompt_tokens) when the proxy learnt from that answer: the agent's answer (not a context round)
    to a forward that carried an estimate (not a splice), with a usage."""


def calibration_in_force(journal: Journal, session_id: str, model: str | None) -> CalibrationInForce | None:
    """None when the session has no such forward (or only ones journaled before the sample count was)."""
    row = journal.conn.execute(
        "SELECT f.k, f.samples, f.estimate, p.prompt_tokens, p.outcome FROM requests r"
        " JOIN forwards f ON f.request_id = r.id"
        " LEFT JOIN responses p ON p.request_id = f.request_id AND p.attempt = f.attempt"
        " WHERE r.session_id = ? AND r.model IS ? ORDER BY r.id DESC, f.attempt DESC LIMIT 1",
        [session_id, model]).fetchone()
    if row is None or row[0] is None or row[1] is None:
        return None
    k, samples, estimate, prompt, outcome = row
    taught = bool(estimate and prompt and estimate > 0 and prompt > 0 and outcome != "context_round")
    return CalibrationInForce(float(k), int(samples), (int(estimate), int(prompt)) if taught else None)
