"""A streamed answer whose model may call the context tools: one coherent SSE stream to the agent.

Text reaches the agent as it arrives; the agent's own tool calls too (``proxy.streaming.StreamFilter``). When the
model's answer ends having called context tools, the proxy runs them (always: in a mixed answer, and on the last
round too). If the model called only context tools, the proxy asks the upstream again with the calls and their
results spliced in — SSE comments keep the client's connection alive while it waits — and goes on relaying the
new answer in the same stream: the agent sees one answer, one finish, one usage chunk (the final answer's) and
one ``[DONE]``. The totals over the internal rounds travel in a closing SSE comment, the journal and the metrics.
A follow-up the upstream cannot take (too long, an error) ends the stream cleanly with what the agent already has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import orjson
from starlette.responses import Response, StreamingResponse

from proxy.errors import CtxError, UpstreamBrokeOff, UpstreamMalformed, UpstreamTimeout, envelope, sse_error
from proxy.intercept import ContextRunner
from proxy.responses import FinallyResponse
from proxy.sse import last_usage
from proxy.streaming import StreamFilter
from proxy.tools.blocks import has_command, results_message
from proxy.upstream import response_headers, with_headers

if TYPE_CHECKING:
    from proxy.chat import Exchange
    from proxy.planning import Plan

__all__ = ["intercepting_stream", "stream_broke_off"]

log = logging.getLogger("ctxproxy")

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": ctxproxy is running context tools\n\n"
KEEP_ALIVE_SECONDS = 5.0


def intercepting_stream(exchange: Exchange, upstream: httpx.Response, first: bytes, plan: Plan,
                        runner: ContextRunner, raw: bytes, rounds: int) -> Response:
    record: dict[str, Any] = {"outcome": "client_disconnected", "chunks": [], "upstream": upstream, "status": 200}

    async def rounds_of() -> AsyncIterator[bytes]:
        current, head, rules, splice = upstream, first, plan.rules, []
        for internal in range(rounds + 1):
            filtered = StreamFilter(exchange.agent_tools(), blocks=bool(rules.fenced))
            record["upstream"], record["chunks"] = current, []
            async for out in _relay(exchange, current, head, filtered, record["chunks"]):
                yield out
            calls = filtered.context_calls
            if calls:
                results = await runner.execute(calls, rules, exchange.body.get("model"))
                for event in runner.events:  # SSE comments: clients skip them, a person tailing a stream reads them
                    yield b": context_op " + orjson.dumps(event) + b"\n\n"
            mixed = has_command(filtered.forwarded) if rules.fenced else bool(filtered.agent_calls)
            if not calls or mixed or internal == rounds:
                async for out in _close(exchange, filtered, record, calls, mixed):
                    yield out
                return
            await exchange.record_round(200, b"".join(record["chunks"]))
            splice += [{"role": "assistant", "content": filtered.text}, results_message(results)] if rules.fenced else \
                [{"role": "assistant", "content": filtered.text or None, "tool_calls": calls}, *results]
            exchange.internal_rounds = internal + 1
            followed = None
            async for item in _follow_up(exchange, raw, splice, internal + 1 < rounds):
                if isinstance(item, bytes):
                    yield item
                else:
                    followed = item
            if followed is None or isinstance(followed, CtxError):
                async for out in _end_early(exchange, filtered, record, followed):
                    yield out
                return
            current, head, rules = followed[0], followed[1], followed[2].rules

    async def done() -> None:
        await _journal(exchange, record)

    inner = with_headers(StreamingResponse(_guarded(rounds_of(), record), 200, headers=exchange.headers),
                         response_headers(upstream))
    return FinallyResponse(inner, done)


async def _relay(exchange: Exchange, upstream: httpx.Response, head: bytes, filtered: StreamFilter,
                 chunks: list[bytes]) -> AsyncIterator[bytes]:
    """One upstream answer through the filter, its raw bytes kept for the journal."""
    chunks.append(head)
    for out in filtered.feed(head):
        yield out
    async for chunk in exchange.upstream_chunks():
        chunks.append(chunk)
        for out in filtered.feed(chunk):
            yield out
    for out in filtered.flush():
        yield out
    await upstream.aclose()


async def _close(exchange: Exchange, filtered: StreamFilter, record: dict[str, Any],
                 calls: list[Any], mixed: bool) -> AsyncIterator[bytes]:
    exchange.add_usage(filtered.usage.get("usage") if filtered.usage else None)
    if exchange.compact is not None:  # /compact: the agent reads what was freed, as the answer's last words
        report = {"object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"content": "\n" + exchange.compaction_report()}, "finish_reason": None}]}
        yield b"data: " + orjson.dumps(report) + b"\n\n"
    record["outcome"] = "ok"
    for out in filtered.closing("stop" if calls and not mixed else None):
        if out == DONE:  # an agent sends its next request as soon as it reads this: the answer must be journaled
            with anyio.CancelScope(shield=True):
                await _journal(exchange, record)
        yield out
    yield exchange.totals_comment()


async def _journal(exchange: Exchange, record: dict[str, Any]) -> None:
    """Close the upstream's stream and journal the answer (``Exchange.finish`` does it once, releasing the lock).

    Called as ``[DONE]`` goes out, not after the response: the next request of an unnamed session continues the
    session only once this one's answer is journaled (``store.journal``: an unanswered head is a parallel run's),
    and an agent reading a stream sends its next request at ``[DONE]``. Journaled after the response, the answer
    lost that race under load (bench/load.py: unnamed streamed sessions forked into ``-2`` children)."""
    await record["upstream"].aclose()
    text = b"".join(record["chunks"])
    await exchange.finish(record["outcome"], record["status"], text, last_usage(text.decode("utf-8", "replace")))


async def _end_early(exchange: Exchange, filtered: StreamFilter, record: dict[str, Any],
                     failure: CtxError | None) -> AsyncIterator[bytes]:
    """The follow-up failed: the agent keeps the text it has, and the stream ends with the reason."""
    said = envelope(failure.message, failure.type, failure.param, failure.code) if failure is not None else b""
    if said:
        yield b"data: " + said + b"\n\n"
    record["outcome"] = "follow_up_failed"  # the status stays the 200 the client got; the failure is the body
    record["chunks"] = [said]
    for out in filtered.closing("stop"):
        yield out


async def _follow_up(exchange: Exchange, raw: bytes, splice: list[dict[str, Any]],
                     offer: bool) -> AsyncIterator[bytes | tuple[httpx.Response, bytes, Plan] | CtxError]:
    """Ask again, yielding keep-alive comments while waiting; then the new answer, or why there is none."""
    task = asyncio.ensure_future(exchange.forward_fitting(raw, splice, offer))  # kept, awaited or cancelled below
    try:
        yield KEEP_ALIVE
        while not task.done():
            await asyncio.wait({task}, timeout=KEEP_ALIVE_SECONDS)
            if not task.done():
                yield KEEP_ALIVE
        try:
            current, head, plan = task.result()
        except CtxError as exc:
            yield exc
            return
        if current.status_code != 200 or not head:
            await current.aclose()
            detail = (head or b"").decode("utf-8", "replace")[:300]
            yield CtxError(f"The upstream answered the proxy's follow-up with {current.status_code}: {detail}",
                           code="upstream_follow_up_failed")
            return
        yield current, head, plan
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _guarded(events: AsyncIterator[bytes], record: dict[str, Any]) -> AsyncIterator[bytes]:
    """The stream, ending with an error event and ``[DONE]`` whatever breaks: its 200 has left, so an exception
    here would only cut the connection (the client sees a reset, the journal a disconnect)."""
    try:
        async for out in events:
            yield out
    except httpx.TransportError as exc:
        record["outcome"] = "timeout" if isinstance(exc, httpx.TimeoutException) else "upstream_error"
        yield sse_error(stream_broke_off(exc))
    except UpstreamMalformed as exc:
        record["outcome"] = "upstream_malformed"
        yield sse_error(exc)
    except Exception:
        log.exception("a streamed answer failed inside ctxproxy")
        record["outcome"] = "error"
        yield sse_error(CtxError("ctxproxy hit an internal error relaying this stream; the details are in its log."))


def stream_broke_off(exc: httpx.TransportError) -> CtxError:
    """A stream the upstream stopped sending after its first byte (the client has had its 200 already)."""
    error = UpstreamTimeout if isinstance(exc, httpx.TimeoutException) else UpstreamBrokeOff
    return error(f"The upstream stream broke off: {type(exc).__name__}. See the model server's log.",
                 code="upstream_stream_error")
