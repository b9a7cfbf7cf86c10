"""The one async driver of the turn engine: it performs ``Turn``'s commands, for a buffered and a streamed answer.

The first forward is made before any response exists, so that its failure is an HTTP error. Then the answer goes to a
sink: ``BufferedSink`` reads it whole and builds one response; ``StreamSink`` relays it as it arrives
(``proxy.upstream.streaming.StreamFilter`` takes the context calls out). Both turn what they read into the engine's
events (``Answered``, ``Failed``, ``Refused``) and the driver feeds them to the ``Turn``; the commands that come back
are the same whichever way the answer travels. The sinks never decide a round: they read, relay and journal bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, cast

from starlette.responses import Response

from ctxproxy.proxy.core.pieces import Pieces
from ctxproxy.proxy.core.state import Rules
from ctxproxy.proxy.engine.buffered import BufferedSink
from ctxproxy.proxy.engine.exchange import Exchange
from ctxproxy.proxy.engine.forward import Forwarder, Opened
from ctxproxy.proxy.engine.intercept import ContextRunner
from ctxproxy.proxy.engine.replies import usage_of
from ctxproxy.proxy.engine.stream import StreamSink
from ctxproxy.proxy.engine.turn import (
    Command,
    Event,
    Forward,
    RecordRound,
    Reply,
    RunTools,
    Start,
    ToolsRan,
    Turn,
)
from ctxproxy.proxy.upstream.sse import last_usage

__all__ = ["Sink", "drive"]


class Sink(Protocol):
    """How an answer travels to the agent. Each async iterator yields the bytes the client gets (none, buffered)."""

    event: Event
    """What the latest ``read`` or ``follow_up`` found."""
    rules: Rules
    """The rules of the round being read (the tools run under them)."""

    def read(self, opened: Opened) -> AsyncIterator[bytes]: ...
    def follow_up(self, forwarder: Forwarder, command: Forward) -> AsyncIterator[bytes]: ...
    def ran(self, events: list[dict[str, object]]) -> AsyncIterator[bytes]: ...
    def round_body(self) -> tuple[int, bytes]: ...
    def reply(self, command: Reply) -> AsyncIterator[bytes]: ...
    def end_early(self) -> AsyncIterator[bytes]: ...
    async def respond(self, rounds: AsyncIterator[bytes], opened: Opened) -> Response: ...


async def drive(exchange: Exchange, raw: bytes | Pieces, compact: str | None) -> Response:
    """Run one request's turn: the first forward here, the rest of the rounds as the sink's response goes out."""
    context = await exchange.load_context()
    messages = cast(list[dict[str, Any]], exchange.body["messages"])
    runner = ContextRunner(exchange.state, exchange.writer, context, exchange.recorded.session_id,
                           exchange.recorded.request_id, messages, list(exchange.incoming.hashes))
    turn = Turn(exchange.state.settings.for_model(exchange.model).max_context_rounds)
    forwarder = Forwarder(exchange, raw, compact)
    [first] = turn.handle(Start())
    assert isinstance(first, Forward)
    opened = await forwarder.fitting(first)
    streamed = forwarder.streamed and opened.upstream.status_code == 200
    sink: Sink = StreamSink(exchange, runner, compact) if streamed else BufferedSink(exchange, runner, compact)
    return await sink.respond(_Rounds(exchange, turn, forwarder, runner, sink).run(opened), opened)


class _Rounds:
    """The loop: read an answer, hand its event to the turn, perform the commands, until a reply."""

    def __init__(self, exchange: Exchange, turn: Turn, forwarder: Forwarder, runner: ContextRunner,
                 sink: Sink) -> None:
        self.exchange, self.turn, self.forwarder, self.runner, self.sink = exchange, turn, forwarder, runner, sink
        self.done = False

    async def run(self, opened: Opened) -> AsyncIterator[bytes]:
        async for out in self.sink.read(opened):
            yield out
        while not self.done:
            for command in self.turn.handle(self.sink.event):
                async for out in self._perform(command):
                    yield out

    async def _perform(self, command: Command) -> AsyncIterator[bytes]:
        if isinstance(command, RunTools):
            results, events = await self.runner.execute(list(command.calls), self.sink.rules, self.exchange.model)
            async for out in self.sink.ran(events):
                yield out
            self.sink.event = ToolsRan(tuple(results))
        elif isinstance(command, RecordRound):
            await record_round(self.exchange, *self.sink.round_body())
            self.exchange.internal_rounds = command.rounds
        elif isinstance(command, Forward):
            async for out in self.sink.follow_up(self.forwarder, command):
                yield out
        else:
            self.done = True
            async for out in self.sink.reply(command) if isinstance(command, Reply) else self.sink.end_early():
                yield out


async def record_round(exchange: Exchange, status: int, content: bytes) -> None:
    """Journal an answer that only called context tools (the agent never gets it)."""
    usage = usage_of(content) or last_usage(content.decode("utf-8", "replace"))
    exchange.add_usage(usage)
    exchange.state.metrics.answered("context_round", usage)
    await exchange.record("context_round", status, content.decode("utf-8", "replace"), usage)
