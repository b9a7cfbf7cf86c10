"""The journal's threads, and the hop to them: a queue the threads take calls from, a loop future each call settles.

Why not ``concurrent.futures.ThreadPoolExecutor`` under ``asyncio.wrap_future``, as before: a round trip through
them cost ~75 µs of CPU on this project's machine (a ``concurrent.futures.Future`` with its ``Condition``, two
futures chained by callbacks, the executor's idle-thread semaphore), ~25 µs this way (a ``SimpleQueue``, one loop
future, settled by one ``call_soon_threadsafe``), and every chat request makes two or three hops to the journal
(``store.writer``). What the executor did that is kept: a call whose caller was cancelled before a thread took it
is not run (one already begun runs to its end); the calls queued when the interpreter exits are run first.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any, TypeVar

__all__ = ["Threads"]

T = TypeVar("T")

_Call = tuple[asyncio.AbstractEventLoop | None, "asyncio.Future[Any] | Future[Any]", Callable[..., Any],
              tuple[Any, ...]]


class Threads:
    """``count`` threads named ``name_0``, ``name_1``…, taking calls in the order they were queued."""

    def __init__(self, count: int, name: str) -> None:
        self._queue: SimpleQueue[_Call | None] = SimpleQueue()
        self._pending = 0
        """Calls queued and not yet run to their end nor skipped (``idle``)."""
        self._pending_lock = threading.Lock()
        self._threads = [threading.Thread(target=_serve, args=(self._queue, self._finished), name=f"{name}_{i}",
                                          daemon=True) for i in range(count)]
        for thread in self._threads:
            thread.start()
        self._at_exit = functools.partial(_stop, self._queue, self._threads)
        atexit.register(self._at_exit)  # daemon threads: run what is queued, as the executor's exit hook did

    def run(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """``fn(*args)`` on a thread; its result (or exception) in the future, on the running loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._began()
        self._queue.put((loop, future, fn, args))
        return future

    @property
    def idle(self) -> bool:
        """No call is queued, nor running: one run elsewhere now cannot overtake one handed in before it."""
        return not self._pending

    def _began(self) -> None:
        with self._pending_lock:
            self._pending += 1

    def _finished(self) -> None:
        with self._pending_lock:
            self._pending -= 1

    def run_blocking(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a thread, its caller waiting (outside any loop: closing)."""
        done: Future[T] = Future()
        self._began()
        self._queue.put((None, done, fn, ()))
        return done.result()

    def stop(self) -> None:
        """Run what is queued, then end the threads."""
        atexit.unregister(self._at_exit)
        self._at_exit()


def _stop(queue: SimpleQueue[_Call | None], threads: list[threading.Thread]) -> None:
    for _ in threads:
        queue.put(None)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()


def _serve(queue: SimpleQueue[_Call | None], finished: Callable[[], None]) -> None:
    while (call := queue.get()) is not None:
        try:
            _one(*call)
        finally:
            del call
            finished()


def _one(loop: asyncio.AbstractEventLoop | None, future: asyncio.Future[Any] | Future[Any], fn: Callable[..., Any],
         args: tuple[Any, ...]) -> None:
    if loop is None:
        _run_blocking(future, fn)  # type: ignore[arg-type]
        return
    if future.cancelled():  # its caller went away before its turn (read across threads: a flag's state)
        return
    try:
        result, error = fn(*args), None
    except BaseException as exc:
        result, error = None, exc
    _settle(loop, future, result, error)  # type: ignore[arg-type]


def _run_blocking(done: Future[Any], fn: Callable[[], Any]) -> None:
    try:
        done.set_result(fn())
    except BaseException as exc:
        done.set_exception(exc)


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any,
            error: BaseException | None) -> None:
    with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits for the answer any more
        loop.call_soon_threadsafe(_resolve, future, result, error)


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled while the call ran
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
