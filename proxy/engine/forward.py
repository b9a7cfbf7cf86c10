"""One round trip upstream that fits: plan, forward, and on an overflow learn, cut harder and retry once.

If the upstream answers that the prompt is too long (``proxy.upstream.overflow``), the calibration is corrected from
what the upstream counted, the request is projected again with the stricter ratio and retried once; if it still does not
fit, the client gets a clear ``context_length_exceeded`` error. A llama.cpp stream that overflows says nothing (a 200
that ends, or a connection closed, before its first byte): the upstream is asked why (``Forwarder._probe``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, cast

import httpx
import orjson

from ctxproxy.proxy.core.pieces import Pieces
from ctxproxy.proxy.engine.exchange import Exchange, target_of
from ctxproxy.proxy.engine.planning import Ask, Plan, plan_forward
from ctxproxy.proxy.engine.refusals import what_takes_room
from ctxproxy.proxy.engine.turn import Forward
from ctxproxy.proxy.errors import ContextTooLarge, CtxError, UpstreamBrokeOff, UpstreamTimeout
from ctxproxy.proxy.upstream.endpoint import client_headers
from ctxproxy.proxy.upstream.loop import VIA_HEADER
from ctxproxy.proxy.upstream.overflow import Overflow, detect_overflow
from ctxproxy.proxy.upstream.streaming import sse_error_chunk

__all__ = ["ATTEMPTS", "UPSTREAM_CODEC", "FollowUpTooLong", "Forwarder", "Opened", "UpstreamCodec", "read_whole"]

ATTEMPTS = 2
"""The first forward, and one retry after the upstream said the prompt is too long."""
_CHAT_DROP = frozenset({"accept-encoding"})
_IDENTITY = [(b"accept-encoding", b"identity")]  # the proxy reads the answer (usage), so it must arrive plain
_BROKE_OFF = httpx.Response(502)
"""Stands for a streamed forward the upstream closed before its first byte: llama-cpp-python's way of refusing
a streamed prompt over its ``n_ctx`` (its log: "Requested tokens (N) exceed context window"). When the probe
(``Forwarder._probe``) confirms an overflow, it is retried once, cut smaller, like any overflow."""


UPSTREAM_CODEC = "ctxproxy.upstream_codec"
"""The request scope's key for an ``UpstreamCodec``: set by a front (``proxy.edge.fronts.codec``) whose upstream speaks
its client's protocol; absent, the chat body goes to the upstream's chat route as it is."""


class UpstreamCodec(Protocol):
    """An upstream that speaks another protocol than chat: each forward's chat body is encoded into it, and its
    answer decoded back into chat (a buffered completion, a chat SSE stream, an error envelope), so the engine
    reads what it always reads. The codec carries whatever the encoding back needs (the client's original body)."""

    path: str
    """Where the upstream takes the protocol (``/v1/messages``)."""
    query: str
    """The client's query string, forwarded as it came."""

    def request(self, body: bytes) -> bytes: ...
    def response(self, answer: httpx.Response) -> httpx.Response: ...


class FollowUpTooLong(CtxError):
    """A follow-up round (the conversation plus the context tools' results) was refused as too long."""

    status, type, code = 400, "invalid_request_error", "context_length_exceeded"


@dataclass(frozen=True)
class Opened:
    """An upstream answer as the forward left it: an error read whole, a stream's first chunk read ahead."""

    upstream: httpx.Response
    first: bytes | None
    """An error's whole body, a stream's first chunk; None for a buffered answer not read yet."""
    plan: Plan
    rest: AsyncIterator[bytes]
    """The rest of a stream (after ``first``)."""


class Forwarder:
    """The request's forwards: each planned (``proxy.engine.planning``), sent, and judged for an overflow."""

    def __init__(self, exchange: Exchange, raw: bytes | Pieces, compact: str | None) -> None:
        self.exchange, self.raw, self.compact = exchange, raw, compact
        self.streamed = bool(exchange.body.get("stream"))

    async def fitting(self, command: Forward) -> Opened:
        """Forward; if the upstream says the prompt is too long, learn its window and count, cut harder and retry
        once (the same bytes if nothing more can be cut: the refusal may have been the upstream's hiccup)."""
        x, splice = self.exchange, list(command.splice)
        for attempt in range(ATTEMPTS):
            assert x.context is not None
            ask = Ask(x.body, self.raw, x.incoming, x.recorded, x.attempt, x.incognito, splice, command.offer,
                      self.compact)
            plan = await plan_forward(x.state, x.writer, x.context, ask)
            x.estimate = 0 if splice else plan.estimate  # usage with a splice does not measure the estimate
            x.deferred = plan.deferred
            x.planned(plan.cuts, plan.tally)
            opened, overflow = await self._attempt(plan)
            if overflow is None:
                return opened
            await self._refused(opened, overflow, splice, last=attempt == ATTEMPTS - 1)
        raise ContextTooLarge(self._refusal(plan, overflow))

    async def _refused(self, opened: Opened, overflow: Overflow, splice: list[Any], last: bool) -> None:
        if splice:  # the spliced tool results made it too long, not the conversation: learn nothing from it
            await self.exchange.record("context_overflow", opened.upstream.status_code, overflow.message, None)
            raise FollowUpTooLong("The follow-up with the context tools' results did not fit.")
        self._learn(opened.plan, overflow)
        if not last:
            self.exchange.retries += 1
            await self.exchange.record("context_overflow", opened.upstream.status_code, overflow.message, None)

    async def _attempt(self, plan: Plan) -> tuple[Opened, Overflow | None]:
        """One forward: the answer, its read-ahead first chunk, and the overflow it signals (if any). A stream
        that ends or breaks off before its first byte says nothing of why; the upstream is asked (``_probe``)."""
        upstream: httpx.Response | None = None
        try:
            async with _alongside(plan.journal):
                upstream = await self._open(plan.body)
                opened, overflow = await self._inspect(upstream, plan)
        except UpstreamBrokeOff as exc:
            if not self.streamed:
                raise
            asked, probed = await self._probe(plan.body)
            if probed is None:
                raise exc from None  # the upstream takes this prompt (or cannot be asked): it failed otherwise
            return Opened(_BROKE_OFF, b"", plan, _nothing()), probed
        except BaseException:
            if upstream is not None:  # the journal refused (a full disk): the answer is not the client's
                await upstream.aclose()
            raise
        if overflow is not None and overflow.limit is None and self.streamed:
            asked, probed = await self._probe(plan.body)
            if asked and probed is None:
                raise UpstreamBrokeOff("The upstream ended the stream before its first byte, yet takes the same "
                                       "prompt unstreamed: it is not too long. See the model server's log.")
            overflow = probed or overflow
        return opened, overflow

    async def _probe(self, body: bytes) -> tuple[bool, Overflow | None]:
        """Why a stream ended before its first byte: the same prompt, not streamed and for one token, gets the
        upstream's own error with its counts (llama-cpp-python: "maximum context length is M ... requested N
        tokens"). Returns (answered, its overflow): (True, None) means the upstream takes the prompt, (False,
        None) that it could not be asked. Asked twice: the first may go out on the pooled connection the failed
        stream left dead. The first attempt's time to first byte is kept."""
        probe = orjson.loads(body)
        for key in ("stream_options", "max_completion_tokens"):
            probe.pop(key, None)
        probe |= {"stream": False, "max_tokens": 1}
        ttfb = self.exchange.ttfb_ms
        try:
            for _ in range(2):
                try:
                    answer = await self._open(orjson.dumps(probe))
                    return True, detect_overflow(answer.status_code, await read_whole(answer))
                except UpstreamBrokeOff:
                    continue
                except CtxError:
                    break
            return False, None
        finally:
            self.exchange.ttfb_ms = ttfb

    def _learn(self, plan: Plan, overflow: Overflow) -> None:
        """What an overflow teaches: the upstream's count (the ratio k) and a ceiling on its window."""
        x = self.exchange
        assert x.context is not None
        corrected = x.context.calibration(x.model).overflow(plan.estimate, overflow.prompt_tokens)
        x.context.calibrations[x.model] = corrected
        failed = overflow.limit or plan.rules.scaled(plan.estimate)  # the prompt we sent did not fit
        limits = x.state.contexts.window_limits
        limits[x.model] = min(limits.get(x.model, plan.rules.budget.window), failed, plan.rules.budget.window)

    def _refusal(self, plan: Plan, overflow: Overflow | None) -> str:
        state = plan.projection.state
        largest = sorted(zip(state.ids, state.counts, strict=True), key=lambda p: -p[1])[:5]
        messages = cast(list[Any], self.exchange.body["messages"])
        room = what_takes_room(largest, messages, state.ids, plan.rules.scaled)
        said = f" The upstream said: {overflow.message}" if overflow else ""
        return (f"The upstream refused the prompt as too long twice, the second time after ctxproxy cut it to about "
                f"{plan.rules.scaled(plan.estimate)} tokens as it counts them. What takes the room: {room}.{said} "
                "Set ctx_window to the model's real window, or start a new session.")

    async def _open(self, body: bytes) -> httpx.Response:
        x = self.exchange
        request = x.request
        headers = client_headers(request.headers.raw, x.state.own_headers, _CHAT_DROP) + _IDENTITY
        codec: UpstreamCodec | None = request.scope.get(UPSTREAM_CODEC)
        path, query = (codec.path, codec.query) if codec else target_of(request)
        sent = x.elapsed()
        x.sent_ms = sent if x.sent_ms is None else x.sent_ms
        upstream = await x.state.upstream.send("POST", path, query, headers, codec.request(body) if codec else body,
                                               via=request.headers.get(VIA_HEADER, ""))
        x.ttfb_ms = x.elapsed()
        x.upstream_ms.append(x.ttfb_ms - sent)
        return codec.response(upstream) if codec else upstream

    async def _inspect(self, upstream: httpx.Response, plan: Plan) -> tuple[Opened, Overflow | None]:
        """An error answer is read whole (to recognise an overflow); a stream's first chunk is read ahead (a
        llama.cpp stream that overflows is a 200 that ends before it starts)."""
        if upstream.status_code >= 400:
            content = await read_whole(upstream)
            return Opened(upstream, content, plan, _nothing()), detect_overflow(upstream.status_code, content)
        if not self.streamed:
            return Opened(upstream, None, plan, _nothing()), None
        rest = upstream.aiter_raw()
        first = await _first_chunk(upstream, rest)
        overflow = _refused_in_an_error_field(first)
        if first and overflow is None:
            return Opened(upstream, first, plan, rest), None
        if overflow is not None:
            await upstream.aclose()
            return Opened(upstream, b"", plan, rest), overflow
        await upstream.aclose()
        return Opened(upstream, b"", plan, rest), Overflow(
            None, "the upstream ended the stream without a byte (llama.cpp's overflow)")


@asynccontextmanager
async def _alongside(step: Callable[[], Awaitable[None]] | None) -> AsyncIterator[None]:
    """``step`` run while the body runs (the forward journaled and the mirror's file written while the request is
    upstream: the agent sees either only through the answer) and done when the body is, however it ends. A caller
    cancelled meanwhile still waits for it (it writes the session's state under its lock), then sees the
    cancellation. A task of its own, not a task group's: a group would cancel it when the body raises, and wrap the
    body's errors in a group."""
    if step is None:
        yield
        return
    running = asyncio.ensure_future(step())  # noqa: TID251 -- referenced, and always awaited below
    try:
        yield
    finally:
        await _done(running)


async def _done(running: asyncio.Future[None]) -> None:
    cancelled = False
    while not running.done():
        try:
            await asyncio.shield(running)
        except asyncio.CancelledError:
            cancelled = True
    running.result()
    if cancelled:
        raise asyncio.CancelledError


async def _first_chunk(upstream: httpx.Response, rest: AsyncIterator[bytes]) -> bytes:
    try:
        return await anext(rest, b"")
    except httpx.TimeoutException:
        await upstream.aclose()
        raise UpstreamTimeout("The upstream did not start its answer in time.") from None
    except httpx.TransportError as exc:
        await upstream.aclose()
        raise UpstreamBrokeOff(f"The upstream closed the connection before the first byte of its answer: "
                               f"{exc or type(exc).__name__}. See the model server's log.") from None


def _refused_in_an_error_field(first: bytes) -> Overflow | None:
    """An older llama.cpp server's refusal of a streamed prompt: a 200 whose first event is an ``error:`` field
    (``exceed_context_size_error``, with its counts), read as the overflow it is."""
    if not first.startswith(b"error:"):
        return None
    event = first.replace(b"\r\n", b"\n").split(b"\n\n", 1)[0]
    return detect_overflow(400, sse_error_chunk(event)[len(b"data: "):])


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""


async def read_whole(upstream: httpx.Response) -> bytes:
    """The answer's body. One that came whole with its head (``proxy.upstream.transport``) and is not encoded is
    taken as it is: read through httpx's decoders and async iterators, it cost ~20 µs of a small request."""
    try:
        if isinstance(upstream.stream, httpx.ByteStream) and "content-encoding" not in upstream.headers:
            return b"".join(upstream.stream)
        return await upstream.aread()
    except httpx.TimeoutException:
        raise UpstreamTimeout("The upstream stopped sending its answer in time.") from None
    except httpx.TransportError as exc:
        raise UpstreamBrokeOff(f"The upstream broke off its answer: {exc or type(exc).__name__}.") from None
    finally:
        await upstream.aclose()
