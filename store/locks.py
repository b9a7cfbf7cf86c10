"""Per-session locks: one request of a session at a time, in this process and in every other sharing the store.

The proxy handles a session's requests one at a time (its decisions are made in order, each on the last one's
state). One process on SQLite needs no more than an asyncio lock per session in memory (``LocalLocks``). Several
processes on one PostgreSQL database (replicas behind a load balancer) need a lock the server holds:
``AdvisoryLocks`` takes a session-level advisory lock keyed by the session (``lock_key``) on a connection of its
own, one per process, in autocommit, for as long as the request runs. A process that dies drops that connection,
and the server frees its locks with it: a killed replica never leaves a session locked. The same connection holds
the process's liveness lock for its life (``store.liveness``, taken at ``start``): its freedom tells the other
replicas that this process's unanswered requests will never be answered.

Local waiters queue on the in-process lock in front, so only the request about to run asks the server; one held
by another process is asked again after a short, growing pause (``pg_try_advisory_lock``: a blocking
``pg_advisory_lock`` would hold the lock connection, and every other session's lock behind it). The calls run on
one thread of their own: the event loop never waits on the database. If the lock connection breaks, the request
that finds out fails with ``LockUnavailable`` (the proxy answers 503) and the next one reconnects, taking back
first the locks its in-flight requests hold; no request ever runs without its lock.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from ctxproxy.store.liveness import instance_id, instance_key

if TYPE_CHECKING:
    import psycopg

__all__ = ["AdvisoryLocks", "LocalLocks", "LockUnavailable", "SessionLocking", "lock_key", "session_locks"]

log = logging.getLogger("ctxproxy")

FIRST_PAUSE, LONGEST_PAUSE = 0.002, 0.05
"""Seconds between two asks for a lock another process holds: doubling from the first, up to the longest."""


class LockUnavailable(Exception):
    """The lock server cannot be reached: the request cannot be serialised with the other replicas', so it is
    refused rather than run unlocked."""


class SessionLocking(Protocol):
    """What the engine needs of a lock backend (``proxy.engine.state.SessionLocks`` wraps one)."""

    def start(self) -> None: ...
    async def acquire(self, session_id: str) -> None: ...
    def release(self, session_id: str) -> None: ...
    def __len__(self) -> int: ...
    def close(self) -> None: ...


SESSION_LOCKS = "ctxproxy:session-lock:"
"""What the session's id is hashed after. ``Journal.record_request`` locks the placement of a request by the
session's name (``store.sql.lock_key``), which is a named session's id: hashed alone, both would be one lock, and
a session's next requests, queued in that transaction on every writer thread behind the session's lock, would
leave none free to journal the answer of the request that holds it."""


def lock_key(session_id: str) -> int:
    """The advisory lock's key: a signed 64-bit integer from the sha256 of the session's id (``SESSION_LOCKS``)."""
    return int.from_bytes(hashlib.sha256((SESSION_LOCKS + session_id).encode()).digest()[:8], "big", signed=True)


def session_locks(store: str | None) -> SessionLocking:
    """The locks a store calls for: PostgreSQL's (a ``postgresql://`` or ``postgres://`` URL) or the process's own."""
    if store and store.startswith(("postgresql://", "postgres://")):
        return AdvisoryLocks(store)
    return LocalLocks()


class LocalLocks:
    """One asyncio lock per session, in this process. A lock lives only while some request holds or waits for it:
    the table never grows with old sessions."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: defaultdict[str, int] = defaultdict(int)

    async def acquire(self, session_id: str) -> None:
        lock = self._locks.setdefault(session_id, asyncio.Lock())
        self._users[session_id] += 1
        try:
            await lock.acquire()
        except BaseException:
            self._forget(session_id)
            raise

    def release(self, session_id: str) -> None:
        self._locks[session_id].release()
        self._forget(session_id)

    def _forget(self, session_id: str) -> None:
        self._users[session_id] -= 1
        if self._users[session_id] == 0:
            del self._users[session_id]
            del self._locks[session_id]

    def __len__(self) -> int:
        return len(self._locks)

    def start(self) -> None:
        """Nothing to announce: one process, whose restart marks what it left (``store.recovery``)."""

    def close(self) -> None:
        """Nothing to give back: the locks die with the process."""


class AdvisoryLocks:
    """PostgreSQL session-level advisory locks on one dedicated connection, behind this process's ``LocalLocks``."""

    def __init__(self, dsn: str, connect_timeout: int = 5, instance: str | None = None) -> None:
        self._dsn, self._connect_timeout = dsn, connect_timeout
        self.instance = instance or instance_id()
        """The process whose liveness lock the connection holds for its life (``store.liveness``)."""
        self._local = LocalLocks()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctxproxy-locks")
        """Every call on the connection, in order: a release's unlock runs before the next holder's lock."""
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        self._held: set[int] = set()
        """The keys this process holds (taken back first on a new connection)."""

    async def acquire(self, session_id: str) -> None:
        await self._local.acquire(session_id)
        key = lock_key(session_id)
        try:
            pause = FIRST_PAUSE
            while not await self._on_thread(self._try_lock, key):
                await asyncio.sleep(pause)
                pause = min(pause * 2, LONGEST_PAUSE)
        except BaseException:
            self._local.release(session_id)
            raise
        self._held.add(key)

    def release(self, session_id: str) -> None:
        """Unlocks on the lock thread without waiting for it: a release never fails, and whoever asks next (here)
        asks after the unlock."""
        key = lock_key(session_id)
        self._held.discard(key)
        self._thread.submit(self._unlock, key)
        self._local.release(session_id)

    def __len__(self) -> int:
        return len(self._local)

    def start(self) -> None:
        """Connect now, taking the process's liveness lock before it journals a request: a request recorded with
        its instance while nobody held that lock would look like a dead replica's to the others. Raises
        ``LockUnavailable`` when the server cannot be reached."""
        self._thread.submit(self._connection).result()

    def close(self) -> None:
        self._thread.submit(self._disconnect).result()
        self._thread.shutdown(wait=True)

    async def _on_thread(self, call: Callable[[int], bool], key: int) -> bool:
        future = asyncio.get_running_loop().run_in_executor(self._thread, call, key)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:  # the call runs on: a lock it takes after all is given back
            future.add_done_callback(functools.partial(self._give_back, key))
            raise

    def _give_back(self, key: int, future: asyncio.Future[bool]) -> None:
        if not future.cancelled() and future.exception() is None and future.result():
            self._thread.submit(self._unlock, key)

    # --- on the lock thread -------------------------------------------------------------------------------------
    def _try_lock(self, key: int) -> bool:
        conn = self._connection()
        try:
            row = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
        except Exception as exc:  # psycopg.Error, or the connection gone under it: never go on unlocked
            self._disconnect()
            raise LockUnavailable(_LOST.format(detail=exc)) from exc
        return bool(row and row[0])

    def _unlock(self, key: int) -> None:
        conn = self._conn
        if conn is None or conn.closed:
            return  # the server freed it with the connection
        try:
            conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
        except Exception as exc:  # the connection is gone, and the lock with it
            log.warning("the session lock connection broke while releasing a lock: %s", exc)
            self._disconnect()

    def _connection(self) -> psycopg.Connection[tuple[object, ...]]:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        import psycopg  # only a PostgreSQL store needs it

        try:
            conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=self._connect_timeout,
                                   application_name="ctxproxy-locks")
        except psycopg.Error as exc:
            raise LockUnavailable(_UNREACHABLE.format(detail=exc)) from exc
        if not conn.execute("SELECT pg_try_advisory_lock(%s)", (instance_key(self.instance),)).fetchone()[0]:  # type: ignore[index]
            log.warning("another lock connection of this process holds its liveness lock (instance %s): two apps"
                        " in one process share it while both run", self.instance)
        for key in list(self._held):  # in-flight requests' locks, lost with the old connection: taken back first
            if not conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]:  # type: ignore[index]
                log.error("a session lock was lost with its connection and another process holds it now (key %d)",
                          key)
        self._conn = conn
        return conn

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception as exc:  # closing a broken connection: nothing more to free
                log.debug("closing the session lock connection: %s", exc)


_UNREACHABLE = ("The session lock server (PostgreSQL) cannot be reached ({detail}). The request was not handled: "
                "without its session's lock it could interleave with another replica's. Check that the database "
                "is up and reachable, then retry.")
_LOST = ("The connection holding the session locks (PostgreSQL) broke ({detail}). The request was not handled: "
         "without its session's lock it could interleave with another replica's. Retry: the next request "
         "reconnects.")

