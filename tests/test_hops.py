"""The journal's threads (``store.hops``): what ``ThreadPoolExecutor`` under ``asyncio.wrap_future`` did, kept."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ctxproxy.store.hops import Threads


def test_a_call_s_result_and_its_exception_come_back_on_the_loop_in_queue_order() -> None:
    threads = Threads(1, "hops-test")
    ran: list[tuple[int, str]] = []

    def note(n: int) -> int:
        ran.append((n, threading.current_thread().name))
        return n * 2

    def fail() -> None:
        raise KeyError("x")

    async def calls() -> list[int]:
        got = await asyncio.gather(*(threads.run(note, n) for n in range(5)))
        with pytest.raises(KeyError):
            await threads.run(fail)
        return got

    try:
        assert asyncio.run(calls()) == [0, 2, 4, 6, 8]
    finally:
        threads.stop()
    assert ran == [(n, "hops-test_0") for n in range(5)]


def test_a_call_whose_caller_went_away_before_its_turn_is_not_run() -> None:
    threads, release, ran = Threads(1, "hops-test"), threading.Event(), []

    async def cancelled_in_the_queue() -> None:
        busy = threads.run(release.wait)
        waiting = threads.run(ran.append, "late")
        waiting.cancel()
        release.set()
        await busy
        await threads.run(ran.append, "next")

    try:
        asyncio.run(cancelled_in_the_queue())
    finally:
        threads.stop()
    assert ran == ["next"]


def test_stopping_runs_what_is_queued_first_and_ends_the_threads() -> None:
    threads, release, ran = Threads(2, "hops-test"), threading.Event(), []

    async def queue_behind_a_slow_call() -> None:
        threads.run(release.wait)
        threads.run(release.wait)
        threads.run(ran.append, "queued")

    asyncio.run(queue_behind_a_slow_call())  # its loop is closed before the calls end: their answers are dropped
    release.set()
    assert threads.run_blocking(lambda: "blocking") == "blocking"
    threads.stop()
    assert ran == ["queued"]
    assert not any(t.name.startswith("hops-test") for t in threading.enumerate())


def test_idle_means_nothing_queued_nor_running_nor_waiting_to_be_skipped() -> None:
    """``store.writer`` runs a call elsewhere only when the threads are idle: a call running, or one queued whose
    caller went away (skipped only when its turn comes), keeps them busy until it is done with."""
    threads, release = Threads(1, "hops-test"), threading.Event()

    async def busy_then_idle() -> list[bool]:
        seen = [threads.idle]
        running = threads.run(release.wait, 10)
        queued = threads.run(lambda: None)
        queued.cancel()
        await asyncio.sleep(0.02)
        seen.append(threads.idle)
        release.set()
        await running
        for _ in range(100):
            if threads.idle:
                break
            await asyncio.sleep(0.01)
        return [*seen, threads.idle]

    try:
        assert asyncio.run(busy_then_idle()) == [True, False, True]
    finally:
        threads.stop()
