"""One writer: every journal call of the process runs on one dedicated thread.

SQLite allows one writer at a time; rather than contend for the lock, all calls (writes and the few operator
reads) are queued on a single-thread executor that owns the connection, as datasette's write thread does. The
event loop only awaits a future, so a commit never blocks other requests.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from store.journal import Journal

__all__ = ["JournalWriter"]

T = TypeVar("T")


class JournalWriter:
    """Runs ``Journal`` methods on the writer thread: ``await writer.call(Journal.record_request, req)``."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctxproxy-journal")

    async def call(self, method: Callable[..., T], *args: object) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(method, self.journal, *args))

    def close(self) -> None:
        self._executor.submit(self.journal.close).result()
        self._executor.shutdown(wait=True)
