"""Large requests: their CPU-heavy steps run on a worker thread, and their size has limits.

Why: every client is served by one event loop. Work that grows with a request's size (parsing and validating its
JSON, hashing its messages, projecting them) done on that loop freezes every other client for as long as it
runs: one 50 MB message held ``/healthz`` for 112 s (issue #10). So a large request (``is_heavy``) does those
steps on a worker thread (``Offload``), a few at a time, while the loop keeps answering. A small one does them on
the loop: a thread hop costs about 0.1 ms, more than its whole work.

What a thread cannot fix is a single C call that holds the GIL: ``orjson.loads`` of a 50 MB body holds it for
about 0.1 s. Token counting is bounded in the core instead (``proxy.core.tokens``), and ``max_body_bytes``
and ``max_messages`` bound the rest, with clear 413s.

The journal draws the same line: its calls run on the loop when they are quick (``store.writer``), and those that
store a large request's new messages, a MiB of cut bodies or a long mirror whole (``heavy_journaling``) run on its
own thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

from ctxproxy.proxy.core.pieces import Pieces
from ctxproxy.proxy.errors import PayloadTooLarge

if TYPE_CHECKING:
    from ctxproxy.store import StateChange

__all__ = ["OFFLOAD_BYTES", "OFFLOAD_MESSAGES", "OFFLOAD_OBJECTS", "WHOLE_MIRROR_CHARS", "Offload",
           "check_message_count", "heavy_journaling", "is_heavy", "is_large"]

T = TypeVar("T")

OFFLOAD_BYTES = 1 << 20
"""A body from this size on is parsed, hashed and projected on the worker. Below it the loop's share of the work
is a few milliseconds: the 630 KB history of the latency bench parses in about 2 ms, and its messages are hashed
and counted once, then reused (``proxy.engine.hashing``, ``MessageCounter``)."""

OFFLOAD_OBJECTS = 4096
"""A body with this many ``{`` is heavy whatever its size: many small messages cost as much per message as a few
large ones (200 000 tiny messages held the loop for 5.6 s). Every message is a JSON object, and a structural
``{`` cannot be escaped, so the count of ``{`` bytes is never below the count of messages."""

OFFLOAD_MESSAGES = 1000
"""A parsed request with this many messages is projected on the worker whatever its size: a projection that
starts afresh (after a restart, or once the session's decisions changed) walks every message, some 20-50 µs each."""

WHOLE_MIRROR_CHARS = 100_000
"""A mirror's text this long, journaled whole as one blob (a session resumed from a journal kept before mirrors were
journaled as what they show), is stored on the journal's thread, not on the loop (``heavy_journaling``)."""

WORKERS = 2
"""Heavy steps running at once: the machine's cores; more would only share them, and hold more memory."""


def is_heavy(raw: bytes | Pieces, shared: int = 0) -> bool:
    """Before parsing: does this body's parsing and hashing belong on the worker? Only the bytes after the
    ``shared`` ones are parsed and hashed (``proxy.core.prefix``: they repeat a recent body's), so only they
    count: the next request of a 6.5 MB session parses a few KB, on the loop. (``bytes.count`` scans 630 KB in
    about 0.1 ms; once per request: after parsing, ``is_large`` decides.)"""
    return len(raw) - shared >= OFFLOAD_BYTES or raw.count(b"{", shared) >= OFFLOAD_OBJECTS


def is_large(body_bytes: int, messages: int) -> bool:
    """Once parsed: does projecting this request belong on the worker?"""
    return body_bytes >= OFFLOAD_BYTES or messages >= OFFLOAD_MESSAGES


def heavy_journaling(change: StateChange | None, forward_bytes: int = 0) -> bool:
    """Whether journaling the working state ``change`` (``proxy.engine.context.SessionContext.state_change``'s),
    with a forward that stores ``forward_bytes``, belongs on the journal's thread (``JournalWriter.call``'s
    ``heavy``): a MiB of cut bodies, a mirror of a thousand messages or more (its two lists, delta-encoded), or a
    long mirror's text stored whole."""
    if forward_bytes >= OFFLOAD_BYTES:
        return True
    if change is None:
        return False
    text, shown = change.state.mirror_text, change.state.mirror_shown
    return (text is not None and len(text) >= WHOLE_MIRROR_CHARS) or (
        shown is not None and len(shown.ids) >= OFFLOAD_MESSAGES)


class Offload:
    """Runs a heavy request's steps on a worker thread, ``WORKERS`` at a time; a light one's on the loop."""

    def __init__(self, workers: int = WORKERS) -> None:
        self._workers = workers
        self._limiter: anyio.CapacityLimiter | None = None  # made in the loop that uses it

    async def run(self, heavy: bool, step: Callable[..., T], *args: Any) -> T:
        """``step(*args)``, on the worker if ``heavy``. A cancelled caller waits for the step to end (it may be
        mutating the session's state), then sees the cancellation."""
        if not heavy:
            return step(*args)
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self._workers)
        return await anyio.to_thread.run_sync(step, *args, limiter=self._limiter)


def check_message_count(count: int, limit: int) -> None:
    """413 when a request carries more messages than ``max_messages``."""
    if count > limit:
        raise PayloadTooLarge(f"The request has {count} messages, more than the limit of {limit}. Start a new "
                              "session or compact this one; raise max_messages (CTXPROXY_MAX_MESSAGES) if such "
                              "requests are expected.", param="messages", code="too_many_messages")
