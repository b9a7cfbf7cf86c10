"""Which request last held a session's lock: how a process knows that what it remembers of a session is stale.

A process keeps what it knows of a session between two of its requests (``proxy.engine.context``: decisions,
calibration, the offer, confirmations, the mirror). With several processes on one store (replicas behind a load
balancer, ``ctxproxy prune`` beside a server), another one may have handled the session in between. Each request,
under the session's lock and before it uses that memory, ``claim`` s the session: it writes its own request id in
``sessions.claimed_by`` and gets back the one there before. If that is the request this process handled last, no
other process touched the session since; anything else (another process's request, NULL after an operator's
change, no row at all after a prune) means: read the session back, as after a restart.

The claim is written when the lock is taken, not when the answer is journaled: a process killed mid-request has
claimed the session before it wrote any of that request's rows, so whatever it left is seen. And it is the
request's id, not a counter: a request journaled before another's handling but handled after it is still told
apart. One primary-key read (with whether its holder was answered) and one primary-key write, in one transaction.

Plain functions over a ``Journal`` (``writer.call(claim, ...)``), so the Journal class stays as is.
"""

from __future__ import annotations

from datetime import UTC, datetime

from ctxproxy.store.journal import Journal
from ctxproxy.store.recovery import ANSWERED, MARK_ABANDONED

__all__ = ["claim", "unclaim"]


def claim(journal: Journal, session_id: str, request_id: int) -> int | None:
    """Mark ``request_id`` as the session's current holder; returns the previous one (None: none, or no row).

    A previous holder still unanswered let go of the lock without journaling its answer: its process died (the
    lock server frees a dead connection's locks). It gets its final ``interrupted`` row here, as a restart gives
    one (``store.recovery``), which on a shared store no starting replica may do for the others."""
    with journal.conn:
        row = journal.conn.execute(_HOLDER, [session_id]).fetchone()
        journal.conn.execute("UPDATE sessions SET claimed_by = ? WHERE id = ?", [request_id, session_id])
        previous = None if row is None or row[0] is None else int(row[0])
        if previous is not None and previous != request_id and not row[1]:
            journal.conn.execute(MARK_ABANDONED, [datetime.now(UTC).isoformat(timespec="milliseconds"), previous])
    return previous


_HOLDER = f"SELECT s.claimed_by, {ANSWERED.format(request='s.claimed_by')} FROM sessions s WHERE s.id = ?"
"""The session's holder, and whether it was answered: only an unanswered one is marked (``MARK_ABANDONED``), and
an agent's previous request almost always was (that statement ran on every request of a session, to insert
nothing)."""


def unclaim(journal: Journal, session_id: str) -> None:
    """Something changed the session outside a request (an operator's pin or drop): every process reads it back."""
    with journal.conn:
        journal.conn.execute("UPDATE sessions SET claimed_by = NULL WHERE id = ?", [session_id])

