"""Which process handles a request, and whether it still lives: a dead replica's request told apart from one in flight.

On a shared store (PostgreSQL, several replicas) a request whose process was SIGKILLed stays unanswered, and its
session's head looks in flight: the agent's resend, matched by fingerprint, would be taken for a parallel run
and fork the session (``store.placement``). A restart marks such requests on SQLite (``store.recovery``); on a
shared store no starting replica may mark the others' (they may be running).

So each process holds, for its whole life, an advisory lock keyed by its own instance id (``instance_key``) on its
lock connection (``store.locks.AdvisoryLocks``), and every request it journals records that id (``requests.instance``).
The server frees a dead process's locks with its connection: whoever can take an instance's lock knows that
process is gone (``is_dead``, which gives the lock back at once). Placement asks it of a pending head's request
before it calls that head a parallel run. SQLite (one process) records no instance and asks nothing.
"""

from __future__ import annotations

import hashlib
import os
import uuid

from ctxproxy.store.sql import Connection

__all__ = ["instance_id", "instance_key", "is_dead"]

INSTANCE_LOCKS = "ctxproxy:instance:"
"""What an instance id is hashed after: a key apart from the sessions' (``store.locks.SESSION_LOCKS``) and the
placements' (``store.sql.lock_key``)."""

_IDS: dict[int, str] = {}


def instance_id() -> str:
    """This process's id, new for each process (a forked worker gets its own)."""
    return _IDS.setdefault(os.getpid(), uuid.uuid4().hex)


def instance_key(instance: str) -> int:
    """The liveness lock's key: a signed 64-bit integer from the sha256 of the instance id."""
    return int.from_bytes(hashlib.sha256((INSTANCE_LOCKS + instance).encode()).digest()[:8], "big", signed=True)


def is_dead(conn: Connection, instance: str) -> bool:
    """Whether the process ``instance`` is gone: its liveness lock is free (taken here, and given back at once)."""
    key = instance_key(instance)
    row = conn.execute("SELECT pg_try_advisory_lock(?)", [key]).fetchone()
    if not (row and row[0]):
        return False
    conn.execute("SELECT pg_advisory_unlock(?)", [key])
    return True
