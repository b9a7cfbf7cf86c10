"""How the proxy is served: uvicorn, with its HTTP protocol guarded against slow and too many clients.

uvicorn (0.54) bounds only the idle time between a keep-alive connection's requests (``timeout_keep_alive``): a
connection that sends half a request line and then nothing is kept forever, and its keep-alive timer is
cancelled by the first byte of a request, so a client that trickles its headers is never closed either (2000
such connections held 2000 descriptors). ``limit_concurrency`` answers 503 only once a request's headers are
complete, so it does not bound them. ``GuardedProtocol`` adds what is missing, per connection:

- ``client_header_timeout``: from the connection's start, and again from the end of each answer, the next
  request's headers must be complete in time; otherwise the connection is closed (with a 408 if the client had
  begun a request, silently if it sent nothing, as the keep-alive timer does);
- ``max_connections``: a connection over the cap gets a 503 and is closed at once.

It also hands the body's pieces to the app as httptools made them: uvicorn appends each to a ``bytearray`` and
hands the app ``bytes`` of it, two copies of every body (about 1 ms for 6.5 MB, warm, and fresh memory when the
app keeps them); the app compares large ones with the bodies it keeps and keeps only what they do not repeat
(``proxy.core.arrival``), so a piece handed as it came is not copied at all.

The body is the app's to bound (``client_body_timeout`` in ``proxy.edge.body.read_body``, a 408 in the OpenAI envelope).
"""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ctxproxy.config import Settings
from ctxproxy.proxy.errors import envelope

__all__ = ["GuardedProtocol", "HeldPieces", "guarded_protocol", "port_taken", "uvicorn_options"]


def _raw_response(status: str, message: str, code: str) -> bytes:
    body = envelope(message, "invalid_request_error" if status.startswith("4") else "server_error", None, code)
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


class HeldPieces:
    """What uvicorn's request cycle buffers a body in between two of the app's ``receive`` calls, in place of its
    ``bytearray``: it appends (``+=``), measures (``len``) and hands over (``bytes(...)``) the pieces, the one piece
    as it came when it holds one (the usual case: the app takes each as soon as it arrives)."""

    __slots__ = ("pieces", "size")

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.size = 0

    def __iadd__(self, piece: bytes) -> HeldPieces:
        self.pieces.append(piece)
        self.size += len(piece)
        return self

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return self.pieces[0] if len(self.pieces) == 1 else b"".join(self.pieces)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline and a connection cap (subclassed per settings by
    ``guarded_protocol``, since uvicorn builds protocols from a class)."""

    header_timeout: float = 30.0
    max_connections: int = 512
    _timer: asyncio.TimerHandle | None = None
    _waiting_for: object = None
    """The request cycle that was current when the deadline was armed: another one means headers came in time."""
    _began = False
    """Whether the client sent any byte since the deadline was armed (then a 408 is owed, not silence)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(_raw_response("503 Service Unavailable", f"ctxproxy serves at most {self.max_connections}"
                                          " connections at once. Retry shortly, or raise max_connections.",
                                          "too_many_connections"))
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        self._began = True
        super().data_received(data)

    def on_body(self, body: bytes) -> None:
        if self.cycle is not None and not isinstance(self.cycle.body, HeldPieces) and not self.cycle.body:
            self.cycle.body = HeldPieces()  # type: ignore[assignment]  # what uvicorn's cycle does with it, it does
        super().on_body(body)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._waiting_for, self._began = self.cycle, False
        self._timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._timer = None
        if self.cycle is not self._waiting_for or self.transport.is_closing():
            return  # a request's headers arrived in time (or the connection is already going)
        if self._began:
            self.transport.write(_raw_response("408 Request Timeout", f"The request's headers did not arrive within "
                                               f"{self.header_timeout:g} seconds; the connection is closed.",
                                               "request_timeout"))
        self.transport.close()


def guarded_protocol(settings: Settings) -> type[GuardedProtocol]:
    """The protocol class uvicorn should build connections from, with these settings' limits."""
    return type("GuardedProtocol", (GuardedProtocol,), {"header_timeout": settings.client_header_timeout,
                                                         "max_connections": settings.max_connections})


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's options for serving the proxy (besides host, port and log level)."""
    return {"http": guarded_protocol(settings), "proxy_headers": False, "server_header": False,
            "access_log": settings.access_log,
            "ws": "none"}  # no WebSocket route here; uvicorn's "auto" would import websockets at every start


def port_taken(host: str, port: int) -> str:
    """Why ``host:port`` cannot be bound, in one line ("" if it can): uvicorn's own way is a log line, a traceback
    of the lifespan's shutdown and ``Errno 98`` among them. Bound the way uvicorn binds (``SO_REUSEADDR``)."""
    if port == 0:
        return ""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (f"port {port} on {host} is already in use (another ctxproxy?). Stop it, or pick another "
                        "with --port or CTXPROXY_PORT.")
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}. Check --host and --port."
    return ""
