"""``context_op`` events: published by the context-tool runner, streamed to operators at ``GET /ctx/events``.

Every event is catalogued in ``docs/api/sse_events.json`` (a JSON Schema per event type); the tests validate
every event the suite emits against it. Subscribers that fall behind lose events rather than slow the proxy.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["EventBus"]


class EventBus:
    def __init__(self, recent: int = 1000, queue: int = 256) -> None:
        self.recent: deque[dict[str, Any]] = deque(maxlen=recent)
        """The latest events, newest last (what a new subscriber can catch up on)."""
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        self._queue = queue

    def publish(self, event: dict[str, Any]) -> None:
        self.recent.append(event)
        for queue in self._subscribers:
            if queue.qsize() < self._queue:
                queue.put_nowait(event)

    async def subscribe(self) -> AsyncIterator[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.discard(queue)
