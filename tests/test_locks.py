"""Session locks: one request of a session at a time, in one process (SQLite) and across processes (PostgreSQL).

The PostgreSQL tests run on the suite's throwaway server on loopback (``tests/postgres.py``): two lock holders in
this process stand for two replicas (each has its own lock connection, as each process does), and a separate
process that holds a lock is killed with SIGKILL to show the server frees it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from ctxproxy.proxy.engine.state import SessionLocks
from ctxproxy.proxy.errors import StorageError
from ctxproxy.store import LocalLocks, LockUnavailable, session_locks
from ctxproxy.store.liveness import instance_id, instance_key, is_dead
from ctxproxy.store.locks import AdvisoryLocks, lock_key


def test_the_key_is_a_signed_64_bit_integer_of_the_sessions_id() -> None:
    keys = {lock_key(f"s-{i}") for i in range(1000)}
    assert len(keys) == 1000 and all(-2 ** 63 <= k < 2 ** 63 for k in keys)
    assert lock_key("s-1") == lock_key("s-1") and min(keys) < 0 < max(keys)


def test_the_store_picks_the_locks() -> None:
    assert isinstance(session_locks(None), LocalLocks)
    assert isinstance(session_locks("/var/lib/ctxproxy"), LocalLocks)
    assert isinstance(session_locks("postgresql://u@127.0.0.1:1/db"), AdvisoryLocks)


async def _order(locks: SessionLocks, sessions: list[str], hold: float = 0) -> list[str]:
    """Each request takes its session's lock, notes its start, waits ``hold`` seconds, notes its end, releases."""
    seen: list[str] = []

    async def request(session: str, n: int) -> None:
        await locks.acquire(session)
        try:
            seen.append(f"{session}{n}<")
            await asyncio.sleep(0)
            await asyncio.sleep(hold)
            seen.append(f">{session}{n}")
        finally:
            locks.release(session)

    await asyncio.gather(*(request(s, n) for n, s in enumerate(sessions)))
    return seen


def test_in_process_a_sessions_requests_run_one_at_a_time_and_others_freely() -> None:
    locks = SessionLocks()
    seen = asyncio.run(_order(locks, ["a", "a", "b"]))
    assert seen[:2] == ["a0<", "b2<"]  # b did not wait for a
    assert seen.index(">a0") < seen.index("a1<")  # a's second waited for its first
    assert len(locks) == 0  # no lock outlives its users


# --- PostgreSQL -----------------------------------------------------------------------------------------------
@pytest.fixture
def pg(postgres_url: str) -> str:
    """A database of this test's own on the suite's throwaway PostgreSQL server (``tests/postgres.py``)."""
    return postgres_url


def _held(dsn: str) -> int:
    """Session locks held on the server now, by anyone: every advisory lock but this process's liveness lock
    (``store.liveness``), which its lock connections hold while they are open."""
    import psycopg

    key = instance_key(instance_id()) & 0xFFFF_FFFF_FFFF_FFFF  # a bigint key is (classid, objid), its two halves
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                           " AND NOT (classid::text::bigint = %s AND objid::text::bigint = %s AND objsubid = 1)",
                           (key >> 32, key & 0xFFFF_FFFF)).fetchone()
        return int(row[0]) if row else 0


def test_a_lock_connection_holds_its_process_liveness_lock_while_open(pg: str) -> None:
    """Another replica tells a dead process's requests from ones in flight by this lock (``store.liveness``)."""
    from ctxproxy.store import Journal

    locks, journal = AdvisoryLocks(pg, instance="a-replica"), Journal(pg)
    try:
        assert is_dead(journal.conn, "a-replica")  # not started: nobody holds it
        locks.start()
        assert not is_dead(journal.conn, "a-replica")
        assert not is_dead(journal.conn, "a-replica")  # asking does not take it
        locks.close()
        deadline = time.monotonic() + 10  # the server frees it once the closed connection's backend has ended
        while not is_dead(journal.conn, "a-replica"):
            assert time.monotonic() < deadline, "the liveness lock outlived its connection"
            time.sleep(0.01)
    finally:
        journal.close()


def test_two_replicas_take_one_sessions_lock_in_turn(pg: str) -> None:
    async def run() -> list[str]:
        first, second = AdvisoryLocks(pg), AdvisoryLocks(pg)  # each replica's own lock connection
        seen: list[str] = []
        try:
            await first.acquire("s")
            async with asyncio.TaskGroup() as group:
                waiting = group.create_task(second.acquire("s"))
                await asyncio.sleep(0.2)
                seen.append(f"second waits: {not waiting.done()}")
                await second.acquire("other")  # another session: free
                second.release("other")
                first.release("s")
            seen.append("second holds it")
            second.release("s")
        finally:
            first.close()
            second.close()
        return seen

    assert asyncio.run(run()) == ["second waits: True", "second holds it"]
    assert _held(pg) == 0


def test_a_sessions_requests_in_one_replica_queue_in_process(pg: str) -> None:
    async def run() -> list[str]:
        locks = SessionLocks(AdvisoryLocks(pg))
        try:
            return await _order(locks, ["a", "a", "b"], hold=0.2)
        finally:
            locks.close()

    seen = asyncio.run(run())
    assert seen.index(">a0") < seen.index("a1<") and seen.index("b2<") < seen.index(">a0")
    assert _held(pg) == 0


_HOLDER = """
import sys, psycopg
conn = psycopg.connect(sys.argv[1], autocommit=True)
conn.execute("SELECT pg_advisory_lock(%s)", (int(sys.argv[2]),))
print("held", flush=True)
sys.stdin.read()
"""


def test_a_killed_process_leaves_no_session_locked(pg: str) -> None:
    """A replica SIGKILLed mid-request: its connection drops, the server frees its lock, another takes it."""
    with subprocess.Popen([sys.executable, "-c", _HOLDER, pg, str(lock_key("s"))], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            assert asyncio.run(_take_after_kill(pg, holder))
        finally:
            if holder.poll() is None:
                holder.kill()
    assert _held(pg) == 0  # the wait cancelled above took nothing it did not give back


async def _take_after_kill(pg: str, holder: subprocess.Popen[str]) -> bool:
    locks = AdvisoryLocks(pg)
    try:
        with pytest.raises(TimeoutError):  # held by the other process
            await asyncio.wait_for(locks.acquire("s"), 0.3)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(5)
        await asyncio.wait_for(locks.acquire("s"), 5)
        locks.release("s")
        return True
    finally:
        locks.close()


def test_a_broken_lock_connection_refuses_the_request_then_reconnects(pg: str) -> None:

    async def run() -> str:
        locks = SessionLocks(AdvisoryLocks(pg))
        try:
            await locks.acquire("s")
            locks.release("s")
            while _held(pg):  # the unlock has run (it is not awaited)
                await asyncio.sleep(0.01)
            _drop_lock_connections(pg)
            with pytest.raises(StorageError) as refused:
                await locks.acquire("s")
            await locks.acquire("s")  # the next one reconnects
            locks.release("s")
            return str(refused.value)
        finally:
            locks.close()

    message = asyncio.run(run())
    assert "session locks" in message and "Retry" in message
    assert _held(pg) == 0


def test_an_unreachable_lock_server_refuses_the_request_with_what_to_do() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed

    async def run() -> int:
        locks = AdvisoryLocks(f"postgresql://u@127.0.0.1:{port}/db", connect_timeout=2)
        try:
            with pytest.raises(LockUnavailable, match="cannot be reached"):
                await locks.acquire("s")
            return len(locks)
        finally:
            locks.close()

    assert asyncio.run(run()) == 0  # the request that was refused holds nothing here either


def test_a_held_session_lock_does_not_hold_up_journaling_the_sessions_next_request(pg: str) -> None:
    """``record_request`` locks a named session's placement by its name, which is the session's id: the session's
    lock must be another key, or its next requests would wait, on every writer thread, for the one that holds it
    (which then could not journal its answer)."""
    from ctxproxy.store import Journal
    from tests.test_journal import incoming, run

    async def hold_and_record() -> int:
        locks = AdvisoryLocks(pg)
        journal = Journal(pg)
        try:
            await locks.acquire("named")
            recorded = await asyncio.wait_for(asyncio.to_thread(
                journal.record_request, incoming(run(1)[0], "named", n=1)), 10)
            locks.release("named")
            return recorded.request_id
        finally:
            locks.close()
            journal.close()

    assert asyncio.run(hold_and_record()) > 0


def _drop_lock_connections(dsn: str) -> None:
    """The server ends every lock connection (a failover, an idle timeout), and they are gone when this returns."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                      " WHERE application_name = 'ctxproxy-locks'")
        while admin.execute("SELECT count(*) FROM pg_stat_activity"
                            " WHERE application_name = 'ctxproxy-locks'").fetchone() != (0,):
            time.sleep(0.01)


def test_locks_in_flight_when_the_connection_broke_are_taken_back_on_the_new_one(pg: str) -> None:
    async def run() -> list[int]:
        locks = AdvisoryLocks(pg)
        try:
            await locks.acquire("in-flight")
            _drop_lock_connections(pg)  # the server freed "in-flight" with it
            with pytest.raises(LockUnavailable):
                await locks.acquire("next")
            await locks.acquire("next")  # a new connection: "in-flight" is taken back first
            held = [_held(pg)]
            locks.release("in-flight")
            locks.release("next")
            await locks.acquire("after")
            _drop_lock_connections(pg)
            locks.release("after")  # its unlock finds the connection gone: nothing left to free
            held.append(_held(pg))
            return held
        finally:
            locks.close()

    assert asyncio.run(run()) == [2, 0]
