"""The bytes of a streamed answer on their way to the agent: relayed through the filter, kept alive, guarded.

Nothing here decides a round or journals: the turn engine (``proxy.engine``) does, and calls these to move
bytes. ``relayed`` passes one upstream stream through a ``StreamFilter``, keeping the raw bytes for the journal;
``beating`` waits for work while sending SSE keep-alive comments; ``guarded`` ends a stream whose 200 has left
with an error event and ``[DONE]`` whatever breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import httpx

from ctxproxy.proxy.errors import CtxError, UpstreamBrokeOff, UpstreamMalformed, UpstreamTimeout, sse_error
from ctxproxy.proxy.upstream.streaming import StreamFilter

__all__ = ["DONE", "KEEP_ALIVE", "KEEP_ALIVE_SECONDS", "Box", "StreamRecord", "beating", "guarded", "relayed",
           "stream_broke_off"]

log = logging.getLogger("ctxproxy")

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": ctxproxy is running context tools\n\n"
KEEP_ALIVE_SECONDS = 5.0
T = TypeVar("T")


@dataclass
class StreamRecord:
    """What the journal gets of a stream: its outcome and the upstream's raw bytes of the latest answer."""

    upstream: httpx.Response
    outcome: str = "client_disconnected"
    chunks: list[bytes] = field(default_factory=list)
    status: int = 200
    """The status the client got (a failure after it is in the body)."""


@dataclass
class Box(Generic[T]):
    """Where ``beating`` leaves the result of the work it waited for."""

    value: T | None = None


async def relayed(first: bytes, rest: AsyncIterator[bytes], filtered: StreamFilter,
                  chunks: list[bytes]) -> AsyncIterator[bytes]:
    """One upstream answer through the filter, its raw bytes kept in ``chunks`` for the journal."""
    chunks.append(first)
    for out in filtered.feed(first):
        yield out
    async for chunk in rest:
        chunks.append(chunk)
        for out in filtered.feed(chunk):
            yield out
    for out in filtered.flush():
        yield out


async def beating(work: Awaitable[T], box: Box[T], every: float = KEEP_ALIVE_SECONDS) -> AsyncIterator[bytes]:
    """Keep-alive comments while ``work`` runs (one at once, then one per ``every`` seconds); its result in
    ``box``, its exception raised. The work is a task of its own, kept here and awaited or cancelled before this
    ends: the one place ctxproxy makes a task outside a task group (an async generator cannot hold one across a
    ``yield``)."""
    task = asyncio.ensure_future(work)  # noqa: TID251 -- referenced, and awaited or cancelled below
    try:
        yield KEEP_ALIVE
        while not task.done():
            await asyncio.wait({task}, timeout=every)
            if not task.done():
                yield KEEP_ALIVE
        box.value = task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def guarded(events: AsyncIterator[bytes], record: StreamRecord) -> AsyncIterator[bytes]:
    """The stream, ending with an error event and ``[DONE]`` whatever breaks: its 200 has left, so an exception
    here would only cut the connection (the client sees a reset, the journal a disconnect)."""
    try:
        async for out in events:
            yield out
    except httpx.TransportError as exc:
        record.outcome = "timeout" if isinstance(exc, httpx.TimeoutException) else "upstream_error"
        yield sse_error(stream_broke_off(exc))
    except UpstreamMalformed as exc:
        record.outcome = "upstream_malformed"
        yield sse_error(exc)
    except Exception:
        log.exception("a streamed answer failed inside ctxproxy")
        record.outcome = "error"
        yield sse_error(CtxError("ctxproxy hit an internal error relaying this stream; the details are in its log."))


def stream_broke_off(exc: httpx.TransportError) -> CtxError:
    """A stream the upstream stopped sending after its first byte (the client has had its 200 already)."""
    error = UpstreamTimeout if isinstance(exc, httpx.TimeoutException) else UpstreamBrokeOff
    return error(f"The upstream stream broke off: {type(exc).__name__}. See the model server's log.",
                 code="upstream_stream_error")
