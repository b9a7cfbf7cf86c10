"""A streamed answer whose model may call the context tools: one coherent SSE stream to the agent.

Text reaches the agent as it arrives; the agent's own tool calls too (``proxy.streaming.StreamFilter``). When the
model's answer ends and it called context tools only, the proxy runs them (an SSE comment keeps the client's
connection alive meanwhile), asks the upstream again with the calls and their results spliced in, and goes on
relaying the new answer in the same stream: the agent sees one answer, one finish, one usage chunk (the final
answer's) and one ``[DONE]``. The totals over the internal rounds travel in a closing SSE comment, the journal
and the metrics.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
import orjson
from starlette.responses import Response, StreamingResponse

from proxy.errors import CtxError, envelope
from proxy.intercept import ContextRunner
from proxy.responses import FinallyResponse
from proxy.sse import last_usage
from proxy.streaming import StreamFilter
from proxy.upstream import response_headers, with_headers

if TYPE_CHECKING:
    from proxy.chat import Exchange
    from proxy.planning import Plan

__all__ = ["intercepting_stream"]

KEEP_ALIVE = b": ctxproxy is running context tools\n\n"


def intercepting_stream(exchange: Exchange, upstream: httpx.Response, first: bytes, plan: Plan,
                        runner: ContextRunner, raw: bytes, rounds: int) -> Response:
    record: dict[str, Any] = {"outcome": "client_disconnected", "chunks": [], "upstream": upstream}

    async def forward() -> AsyncIterator[bytes]:
        nonlocal plan
        current, head, splice = upstream, first, []
        for internal in range(rounds + 1):
            filtered = StreamFilter(exchange.agent_tools())
            record["upstream"], record["chunks"] = current, []
            try:
                async for out in _relay(exchange, current, head, filtered, record["chunks"]):
                    yield out
            except httpx.TransportError as exc:
                record["outcome"] = "timeout" if isinstance(exc, httpx.TimeoutException) else "upstream_error"
                yield _sse_error(f"The upstream stream broke off: {type(exc).__name__}.")
                return
            calls = filtered.context_calls
            if not calls or filtered.agent_calls or internal == rounds:
                for out in filtered.closing("stop" if calls and not filtered.agent_calls else None):
                    yield out
                yield exchange.totals_comment()
                record["outcome"] = "ok"
                return
            await exchange.record_round(200, b"".join(record["chunks"]))
            yield KEEP_ALIVE
            results = await runner.execute(calls, plan.rules, exchange.body.get("model"))
            for event in runner.events:  # SSE comments: clients ignore them, a person tailing the stream sees them
                yield b": context_op " + orjson.dumps(event) + b"\n\n"
            splice += [{"role": "assistant", "content": filtered.text or None, "tool_calls": calls}, *results]
            exchange.internal_rounds = internal + 1
            try:
                current, maybe_head, plan = await exchange.forward_fitting(raw, splice, internal + 1 < rounds)
            except CtxError as exc:
                record["outcome"] = "error"
                yield b"data: " + envelope(exc.message, exc.type, exc.param, exc.code) + b"\n\n"
                return
            if current.status_code != 200 or not maybe_head:
                record["outcome"] = "upstream_error"
                yield _sse_error(f"The upstream answered the proxy's follow-up with {current.status_code}.")
                await current.aclose()
                return
            head = maybe_head

    async def done() -> None:
        await record["upstream"].aclose()
        text = b"".join(record["chunks"])
        await exchange.finish(record["outcome"], 200, text, last_usage(text.decode("utf-8", "replace")))

    inner = with_headers(StreamingResponse(forward(), 200, headers=exchange.headers), response_headers(upstream))
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
    await upstream.aclose()


def _sse_error(message: str) -> bytes:
    return b"data: " + envelope(message, "upstream_error", None, "upstream_stream_error") + b"\n\n"
