"""A response that always cleans up after itself.

Starlette runs a response's ``background`` task only when sending succeeded; a client that disconnects (or a
cancelled task) skips it. The proxy must still close the upstream stream, journal the answer and release the
session lock, so it wraps responses in ``FinallyResponse``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["FinallyResponse"]


class FinallyResponse(Response):
    """Sends ``inner``, then runs ``cleanup`` whatever happened: a disconnect or a cancellation included.

    ``shield``: the cleanup runs in a shielded cancel scope, which nothing cancels; False for one that ends its
    journal calls once begun by itself (``proxy.engine.shielded``) and awaits nothing else: the scope costs ~7 µs."""

    def __init__(self, inner: Response, cleanup: Callable[[], Awaitable[None]], shield: bool = True) -> None:
        self.inner, self.cleanup, self.shield = inner, cleanup, shield
        self.status_code, self.raw_headers, self.background = inner.status_code, inner.raw_headers, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            if self.shield:
                with anyio.CancelScope(shield=True):
                    await self.cleanup()
            else:
                await self.cleanup()
