"""Keep-alive connections to the upstream, per origin (scheme, host, port), under one connection limit.

A request takes the most recently used idle connection of its origin (the one the upstream is least likely to
have closed for idleness meanwhile), or opens a new one if the limit allows; at the limit it waits for one to be
given back, up to the request's ``pool`` timeout (``httpx.PoolTimeout``), an idle connection of another origin
being closed to make room first. A connection given back whose answer cannot be followed by another (see
``proxy.upstream.connection``) is closed instead. Idle connections expire after ``keepalive`` seconds, closed by
a timer, and leave the pool at once when the upstream closes them.

The TLS context of ``https`` upstreams is built on the first connection that needs one, not at start: the system
CA bundle it loads costs about 1 MB of memory that an ``http`` upstream (the usual local model server) never uses.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable

import httpx

from ctxproxy.proxy.upstream.connection import Connection

__all__ = ["Origin", "Pool"]

Origin = tuple[str, str, int]
"""(scheme, host, port)."""


class Pool:
    """Connections by origin; the limit (0: none) counts connections being opened, in use and idle."""

    def __init__(self, limit: int, keepalive: float, tls: Callable[[], ssl.SSLContext]) -> None:
        self.limit, self.keepalive = limit, keepalive
        self._tls_factory = tls
        self._tls_context: ssl.SSLContext | None = None
        self._idle: dict[Origin, list[Connection]] = {}
        self._open: set[Connection] = set()
        self._count = 0
        """Connections counted against the limit: those in ``_open`` and those being opened."""
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def tls(self) -> ssl.SSLContext | None:
        """The TLS context, once an ``https`` connection was opened."""
        return self._tls_context

    async def acquire(self, origin: Origin, timeout: dict[str, float | None], request: httpx.Request,
                      fresh: bool = False) -> Connection:
        """A connection to ``origin``: an idle one unless ``fresh``, else a new one once the limit allows."""
        loop = asyncio.get_running_loop()
        wait = timeout.get("pool")
        deadline = None if wait is None else loop.time() + wait
        while True:
            connection = None if fresh else self._take_idle(origin, loop.time())
            if connection is not None:
                return connection
            if self._room():
                return await self._connect(origin, timeout.get("connect"), request)
            await self._wait_for_room(deadline, loop, request)

    def release(self, connection: Connection) -> None:
        """Give ``connection`` back after its exchange: pooled if it can carry another request, else closed."""
        if connection not in self._open:
            return
        if not connection.reusable:
            self.discard(connection)
            return
        connection.idle(asyncio.get_running_loop().time())
        self._idle.setdefault(connection.origin, []).append(connection)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(self.keepalive, self._sweep)
        self._wake_one()

    def discard(self, connection: Connection) -> None:
        """Close ``connection`` and count it out."""
        connection.close()
        self.forget(connection)

    def forget(self, connection: Connection) -> None:
        """Count a closed connection out (idempotent: also called when the connection is lost)."""
        if connection in self._open:
            self._open.remove(connection)
            self._count -= 1
            idle = self._idle.get(connection.origin, [])
            if connection in idle:
                idle.remove(connection)
            self._wake_one()

    async def aclose(self) -> None:
        """Close every connection, idle or in use."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for connection in list(self._open):
            self.discard(connection)

    def _take_idle(self, origin: Origin, now: float) -> Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if not connection.closing and now - connection.idle_since < self.keepalive:
                return connection
            self.discard(connection)
        return None

    def _room(self) -> bool:
        """Whether one more connection may be opened; closes another origin's idle one if that makes room."""
        if not self.limit or self._count < self.limit:
            return True
        oldest = min((c for idle in self._idle.values() for c in idle), key=lambda c: c.idle_since, default=None)
        if oldest is None:
            return False
        self.discard(oldest)
        return True

    async def _wait_for_room(self, deadline: float | None, loop: asyncio.AbstractEventLoop,
                             request: httpx.Request) -> None:
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._wake_one()  # woken as it gave up: the room goes to the next in line
            if isinstance(exc, TimeoutError):
                raise httpx.PoolTimeout(f"no upstream connection came free in time (all {self.limit} in use)",
                                        request=request) from None
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _connect(self, origin: Origin, timeout: float | None, request: httpx.Request) -> Connection:
        self._count += 1
        try:
            connection = await _dial(origin, self._tls() if origin[0] == "https" else None, timeout, request,
                                     self.forget)
        except BaseException:
            self._count -= 1
            self._wake_one()
            raise
        self._open.add(connection)
        return connection

    def _tls(self) -> ssl.SSLContext:
        if self._tls_context is None:
            self._tls_context = self._tls_factory()
        return self._tls_context

    def _sweep(self) -> None:
        """Close the connections idle for ``keepalive`` seconds; come back when the next one will be."""
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        for idle in list(self._idle.values()):
            for connection in [c for c in idle if now - c.idle_since >= self.keepalive]:
                self.discard(connection)
        oldest = min((c.idle_since for idle in self._idle.values() for c in idle), default=None)
        if oldest is not None:
            self._sweeper = asyncio.get_running_loop().call_later(oldest + self.keepalive - now, self._sweep)


async def _dial(origin: Origin, tls: ssl.SSLContext | None, timeout: float | None, request: httpx.Request,
                on_lost: Callable[[Connection], None]) -> Connection:
    """A new connection to ``origin``, TLS included, within ``timeout`` s; failures as httpx's."""
    _, host, port = origin
    try:
        async with asyncio.timeout(timeout):
            _, connection = await asyncio.get_running_loop().create_connection(
                lambda: Connection(origin, on_lost), host, port, ssl=tls, server_hostname=host if tls else None)
    except TimeoutError:
        raise httpx.ConnectTimeout(f"no connection to {host}:{port} within {timeout} s", request=request) from None
    except OSError as exc:  # refused, unresolvable, unreachable, a TLS handshake or certificate refused
        raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc
    return connection
