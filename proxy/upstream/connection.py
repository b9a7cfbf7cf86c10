"""One HTTP/1.1 connection to the upstream: a request written whole, its answer parsed by httptools as it arrives.

An ``asyncio.Protocol``: the bytes the loop reads go straight into httptools' parser (llhttp, the C parser uvicorn
uses for the proxy's own server), whose callbacks fill the current ``Answer``: status, headers, then body chunks.
The caller awaits the head (``Connection.head``), then the body (``Connection.read``). Each wait is bounded by the
read timeout, which starts again with every byte that arrives: an answer that trickles is alive, one silent for
``read`` seconds is a ``httpx.ReadTimeout``. Body bytes waiting for the caller are bounded too: above
``HIGH_WATER`` the socket is not read until the caller catches up (a slow client slows the upstream, as TCP does).

Errors are httpx's, so the transport's callers map them as for any transport (``proxy.upstream.endpoint``): the
connection closed or reset before a byte of the answer is ``Unanswered`` (a ``RemoteProtocolError`` the transport
may replay), during the head a ``RemoteProtocolError``, during the body a ``ReadError``; bytes httptools rejects
are a ``RemoteProtocolError``.

Framing (RFC 9112 §6.3): llhttp knows bodies by Content-Length, chunked (extensions and trailers parsed and
dropped) or until the connection closes, and none for 1xx, 204 and 304; an answer to HEAD ends with its head
(llhttp would wait for Content-Length bytes: its parser is dropped there). Interim 1xx answers (103 Early Hints)
are skipped, as httpcore does. A connection is reused (``reusable``) only when its answer was read to the end, no
stray byte followed it and neither side said ``Connection: close`` (an HTTP/1.0 answer must say keep-alive).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import Enum
from typing import cast

import httptools
import httpx

__all__ = ["HIGH_WATER", "Answer", "Connection", "Stage", "Unanswered"]

HIGH_WATER = 256 * 1024
"""Body bytes received but not yet read by the caller above which the socket is paused."""
_JOINED = 64 * 1024
"""Bodies below this size are copied behind the head and written in one call."""


class Unanswered(httpx.RemoteProtocolError):
    """The upstream closed or reset the connection before sending a byte of its answer."""


class Stage(Enum):
    HEAD = "head"
    BODY = "body"
    DONE = "done"


class Answer:
    """One response as httptools reports it: its callbacks, called from ``feed_data``."""

    __slots__ = ("buffered", "chunks", "head_only", "headers", "keep_alive", "parser", "reason", "received", "stage",
                 "status", "stray", "until_close", "version")

    def __init__(self, head_only: bool) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.head_only = head_only
        """An answer to HEAD: no body, whatever its Content-Length says."""
        self.stage = Stage.HEAD
        self.status, self.reason, self.version = 0, b"", b"HTTP/1.1"
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        """Body bytes received and not yet read."""
        self.buffered = 0
        """How many: above ``HIGH_WATER`` the socket is not read."""
        self.received = False
        """Whether any byte of the answer came (then it is never sent again)."""
        self.keep_alive = self.until_close = self.stray = False

    @property
    def done(self) -> bool:
        return self.stage is Stage.DONE

    def on_message_begin(self) -> None:
        if self.stage is Stage.DONE:
            self.stray = True  # another answer after this one, in the same read: no request asked for it

    def on_status(self, fragment: bytes) -> None:
        self.reason += fragment  # llhttp hands the reason phrase over in as many pieces as it arrived in

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.stage is Stage.HEAD:  # the trailers of a chunked body come this way too: dropped
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # interim (RFC 9110 §15.2): the answer follows
            self.reason, self.headers = b"", []
            return
        self.status, self.stage = status, Stage.BODY
        self.version = b"HTTP/" + self.parser.get_http_version().encode("ascii")
        self.keep_alive = self.parser.should_keep_alive() and status != 101
        if self.head_only or status == 101:
            self.stage = Stage.DONE
        elif not self.keep_alive:
            self.until_close = _until_close(status, self.headers)

    def on_body(self, chunk: bytes) -> None:
        if self.stage is Stage.DONE:
            self.stray = True  # a body after a HEAD answer: the connection's framing can no longer be trusted
        else:
            self.chunks.append(chunk)
            self.buffered += len(chunk)

    def on_message_complete(self) -> None:
        if self.stage is Stage.BODY:
            self.stage = Stage.DONE


def _until_close(status: int, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the body runs until the connection closes: neither chunked nor a Content-Length (RFC 9112 §6.3)."""
    if status in (204, 304):
        return False
    names = {name.lower() for name, _ in headers}
    return b"content-length" not in names and b"transfer-encoding" not in names


class Connection(asyncio.Protocol):
    """One keep-alive connection: one exchange at a time (``send``, ``head``, ``read``), pooled between them."""

    def __init__(self, origin: tuple[str, str, int], on_lost: Callable[[Connection], None]) -> None:
        self.origin = origin
        self.exchanges = 0
        """Requests sent on this connection, the current one included: above 1 it was reused."""
        self.idle_since = 0.0
        self.lost = False
        self.answer: Answer | None = None
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._request: httpx.Request | None = None
        self._close_after = False
        self._error: httpx.TransportError | None = None
        self._waiter: asyncio.Future[bool] | None = None
        self._paused = False
        self._on_lost = on_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None or answer.stage is Stage.DONE:
            self.close()  # bytes no request asked for: this connection's framing can no longer be trusted
            return
        answer.received = True
        try:
            answer.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # a 101's bytes after its head: not HTTP any more, the connection is not reused
        except httptools.HttpParserError as exc:
            if answer.done:  # (the parser's callbacks moved it on: not the stage checked above)
                answer.stray = True  # bytes after a whole answer: it stands, the connection does not
            else:
                self._error = httpx.RemoteProtocolError(f"the upstream's answer is not HTTP/1.1: {exc}",
                                                        request=self._request)
            self.close()
        if answer.buffered > HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        answer = self.answer
        if answer is not None and answer.stage is not Stage.DONE and self._error is None:
            self._error = self._broken(answer, exc)
            if self._error is None:
                answer.stage = Stage.DONE
        self._wake()
        self._on_lost(self)

    def _broken(self, answer: Answer, exc: Exception | None) -> httpx.TransportError | None:
        """What the connection's loss means for the answer under way; None: it ended the answer (until close)."""
        how, why = ("reset", f" ({exc})") if exc else ("closed", "")
        if not answer.received:
            return Unanswered(f"the upstream {how} the connection without answering{why}", request=self._request)
        if answer.stage is Stage.HEAD:
            return httpx.RemoteProtocolError(f"the upstream {how} the connection in the middle of the answer's "
                                             f"head{why}", request=self._request)
        if answer.until_close and exc is None:
            return None
        return httpx.ReadError(f"the upstream {how} the connection in the middle of the answer's body{why}",
                               request=self._request)

    def send(self, request: httpx.Request, head: bytes, body: bytes, close_after: bool) -> None:
        """Write ``request`` (``head`` and ``body`` as they go on the wire) and begin its answer."""
        assert self._transport is not None and self.answer is None
        self.exchanges += 1
        self.answer, self._request, self._close_after = Answer(request.method == "HEAD"), request, close_after
        if self.lost:  # lost while it was being opened: nothing will come
            self._error = Unanswered("the upstream closed the connection before the request", request=request)
            return
        if len(body) < _JOINED:
            self._transport.write(head + body)  # one segment, one syscall
        else:
            self._transport.writelines((head, body))  # no copy of a large body

    async def head(self, timeout: float | None) -> Answer:
        """The answer, once its head is in (status, reason, headers); its body follows through ``read``."""
        answer = self.answer
        assert answer is not None
        while answer.stage is Stage.HEAD:
            if self._error is not None:
                raise self._error
            await self._wait(timeout)
        return answer

    async def read(self, timeout: float | None) -> bytes:
        """The body bytes that came since the last call, as soon as there are any; ``b""`` at the end."""
        answer = self.answer
        assert answer is not None
        while not answer.chunks:
            if answer.stage is Stage.DONE:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait(timeout)
        return self.take()

    def take(self) -> bytes:
        """The body bytes received and not yet read, at once."""
        assert self.answer is not None
        chunks, self.answer.chunks, self.answer.buffered = self.answer.chunks, [], 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    @property
    def reusable(self) -> bool:
        """Whether the answer was read to the end and the connection can carry another request."""
        answer = self.answer
        return (answer is not None and answer.stage is Stage.DONE and answer.keep_alive and not answer.stray
                and not answer.chunks and not self._close_after and not self.lost and self._error is None)

    @property
    def closing(self) -> bool:
        """Whether the connection is closed or closing (then it carries no other request)."""
        return self.lost or self._transport is None or self._transport.is_closing()

    def idle(self, now: float) -> None:
        """Between two exchanges, in the pool since ``now``."""
        self.answer, self._request, self.idle_since = None, None, now

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    async def _wait(self, timeout: float | None) -> None:
        """Until a byte arrives or the connection ends; ``httpx.ReadTimeout`` after ``timeout`` s of silence."""
        waiter = self._waiter = self._loop.create_future()
        timer = None if timeout is None else self._loop.call_later(timeout, _expire, waiter)
        try:
            if await waiter:
                return
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        raise httpx.ReadTimeout(f"the upstream sent nothing for {timeout} s", request=self._request)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)
