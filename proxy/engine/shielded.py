"""Journal calls that end once begun, whatever cancels the request meanwhile.

A request's rows follow one another: its request row, then its answer row. Once a call has begun, what comes after
relies on its rows being written, so a cancellation of the request (anyio's: a cancel scope around it) must wait
for the call to end. A call the writer runs on the loop (``JournalWriter.call_here``) never yields, so nothing can
cancel it halfway: only a call sent to the writer's thread is awaited in a shielded scope. Opening one for every
call cost ~7 µs each (anyio looks up the task and its backend), three times a small request (issue #13).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import anyio

from ctxproxy.store import JournalWriter

__all__ = ["journaled"]

T = TypeVar("T")


async def journaled(writer: JournalWriter, method: Callable[..., T], *args: object, heavy: bool = False) -> T:
    """``writer.call(method, *args, heavy=heavy)``, ended before any cancellation of the caller goes on."""
    ran, result = writer.call_here(method, *args, heavy=heavy)
    if ran:
        return cast(T, result)
    with anyio.CancelScope(shield=True):
        answer = await writer.call(method, *args, heavy=heavy)
    return answer
