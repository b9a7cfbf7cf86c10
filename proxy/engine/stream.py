"""The streamed sink: one coherent SSE stream to the agent, whatever rounds the turn takes.

Text reaches the agent as it arrives; the agent's own tool calls too (``proxy.upstream.streaming.StreamFilter``). The
context-tool calls are held back; when the turn runs them, each call's event goes out as an SSE comment (clients
skip them, a person tailing a stream reads them). A follow-up is asked while SSE comments keep the client's
connection alive, and its answer is relayed in the same stream: the agent sees one answer, one finish, one usage
chunk (the final answer's) and one ``[DONE]``. The totals over the internal rounds travel in a closing SSE
comment, the journal and the metrics. A follow-up the upstream cannot take (too long, an error) ends the stream
cleanly with what the agent already has.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import orjson
from starlette.responses import Response, StreamingResponse

from ctxproxy.proxy.core.state import Rules
from ctxproxy.proxy.engine.exchange import Exchange
from ctxproxy.proxy.engine.forward import Forwarder, Opened
from ctxproxy.proxy.engine.intercept import ContextRunner
from ctxproxy.proxy.engine.replies import compaction_report
from ctxproxy.proxy.engine.responses import FinallyResponse
from ctxproxy.proxy.engine.turn import Answered, Event, Failed, Forward, Refused, Reply
from ctxproxy.proxy.errors import CtxError, envelope
from ctxproxy.proxy.tools.blocks import has_command
from ctxproxy.proxy.upstream.endpoint import response_headers, with_headers
from ctxproxy.proxy.upstream.relay import DONE, Box, StreamRecord, beating, guarded, relayed
from ctxproxy.proxy.upstream.sse import last_usage
from ctxproxy.proxy.upstream.streaming import StreamFilter

__all__ = ["StreamSink"]


class StreamSink:
    def __init__(self, exchange: Exchange, runner: ContextRunner, compact: str | None) -> None:
        self.exchange, self.runner, self.compact = exchange, runner, compact
        self.event: Event = Failed()
        self.filtered = StreamFilter(frozenset())
        self.record: StreamRecord | None = None
        self.failure: CtxError | None = None

    async def read(self, opened: Opened) -> AsyncIterator[bytes]:
        self.rules: Rules = opened.plan.rules
        fenced = bool(self.rules.fenced)
        filtered = self.filtered = StreamFilter(self.exchange.agent_tools(), blocks=fenced)
        record = self._record(opened)
        record.upstream, record.chunks = opened.upstream, []
        async for out in relayed(opened.first or b"", opened.rest, filtered, record.chunks):
            yield out
        await opened.upstream.aclose()
        acts = has_command(filtered.forwarded) if fenced else bool(filtered.agent_calls)
        text = filtered.text if fenced else filtered.text or None
        self.event = Answered(tuple(filtered.context_calls), acts, text, fenced)

    def _record(self, opened: Opened) -> StreamRecord:
        if self.record is None:
            self.record = StreamRecord(opened.upstream)
        return self.record

    async def follow_up(self, forwarder: Forwarder, command: Forward) -> AsyncIterator[bytes]:
        """Ask again, with keep-alive comments while waiting; then relay the new answer, or say why there is none."""
        box: Box[Opened] = Box()
        try:
            async for beat in beating(forwarder.fitting(command), box):
                yield beat
        except CtxError as exc:
            self.failure, self.event = exc, Refused()
            return
        opened = box.value
        assert opened is not None
        if opened.upstream.status_code != 200 or not opened.first:
            await opened.upstream.aclose()
            detail = (opened.first or b"").decode("utf-8", "replace")[:300]
            self.failure = CtxError(f"The upstream answered the proxy's follow-up with "
                                    f"{opened.upstream.status_code}: {detail}", code="upstream_follow_up_failed")
            self.event = Refused()
            return
        async for out in self.read(opened):
            yield out

    async def ran(self, events: list[dict[str, object]]) -> AsyncIterator[bytes]:
        for event in events:  # SSE comments: clients skip them, a person tailing a stream reads them
            yield b": context_op " + orjson.dumps(event) + b"\n\n"

    def round_body(self) -> tuple[int, bytes]:
        assert self.record is not None
        return 200, b"".join(self.record.chunks)

    async def reply(self, command: Reply) -> AsyncIterator[bytes]:
        filtered, record = self.filtered, self.record
        assert record is not None
        self.exchange.add_usage(filtered.usage.get("usage") if filtered.usage else None)
        if self.compact is not None:  # /compact: the agent reads what was freed, as the answer's last words
            report = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {
                "content": "\n" + compaction_report(self.runner.all_events)}, "finish_reason": None}]}
            yield b"data: " + orjson.dumps(report) + b"\n\n"
        record.outcome = "ok"
        for out in filtered.closing("stop" if command.took_calls and not command.acts else None):
            yield out
        yield self.exchange.totals_comment()

    async def end_early(self) -> AsyncIterator[bytes]:
        """The follow-up failed: the agent keeps the text it has, and the stream ends with the reason."""
        failure, record = self.failure, self.record
        assert record is not None
        said = envelope(failure.message, failure.type, failure.param, failure.code) if failure is not None else b""
        if said:
            yield b"data: " + said + b"\n\n"
        record.outcome = "follow_up_failed"  # the status stays the 200 the client got; the failure is the body
        record.chunks = [said]
        for out in self.filtered.closing("stop"):
            yield out

    async def respond(self, rounds: AsyncIterator[bytes], opened: Opened) -> Response:
        record = self._record(opened)
        inner = StreamingResponse(self._journaled(guarded(rounds, record)), 200, headers=self.exchange.headers)
        return FinallyResponse(with_headers(inner, response_headers(opened.upstream)), self._journal)

    async def _journaled(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The stream, its answer journaled before the ``[DONE]`` that ends it (an answer, a failed follow-up, an
        error event): an agent sends its next request as soon as it reads it (``_journal``)."""
        async for out in events:
            if out.endswith(DONE):
                with anyio.CancelScope(shield=True):
                    await self._journal()
            yield out

    async def _journal(self) -> None:
        """Close the upstream's stream and journal the answer (``Exchange.finish`` does it once, releasing the lock).

        Called as ``[DONE]`` goes out, not after the response: the next request of an unnamed session continues
        the session only once this one's answer is journaled (``store.journal``: an unanswered head is a parallel
        run's), and an agent reading a stream sends its next request at ``[DONE]``. Journaled after the response,
        the answer lost that race under load (bench/load.py: unnamed streamed sessions forked into ``-2``
        children)."""
        record = self.record
        assert record is not None
        await record.upstream.aclose()
        text = b"".join(record.chunks)
        await self.exchange.answer(record.outcome, record.status, text, last_usage(text.decode("utf-8", "replace")))
