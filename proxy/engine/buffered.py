"""The buffered sink: an answer read whole, and one response once the turn is over.

An error answer (or a stream the upstream did not open with a 200) goes to the agent as it came. A follow-up
refused as too long leaves the agent the previous answer, without its context calls.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from starlette.responses import Response

from ctxproxy.proxy.engine.exchange import Exchange
from ctxproxy.proxy.engine.forward import FollowUpTooLong, Forwarder, Opened, read_whole
from ctxproxy.proxy.engine.intercept import ContextRunner
from ctxproxy.proxy.engine.replies import answered, compaction_report, usage_of, with_report
from ctxproxy.proxy.engine.responses import FinallyResponse
from ctxproxy.proxy.engine.turn import Event, Failed, Forward, Refused, Reply
from ctxproxy.proxy.upstream.answers import parse_completion
from ctxproxy.proxy.upstream.endpoint import response_headers, with_headers

__all__ = ["BufferedSink"]

_NO_ANSWER = httpx.Response(502)
"""Stands for the upstream's answer until the first one is read (never sent): built once, not per request (15 µs)."""


class BufferedSink:
    def __init__(self, exchange: Exchange, runner: ContextRunner, compact: str | None) -> None:
        self.exchange, self.runner, self.compact = exchange, runner, compact
        self.event: Event = Failed()
        self.upstream = _NO_ANSWER
        self.content = self.stripped = b""
        self.previous: tuple[httpx.Response, bytes] | None = None
        """The latest internal round's answer without its context calls: the agent's if the follow-up fails."""
        self.response: Response | None = None
        self.ending: tuple[str, int, bytes, dict[str, object] | None] | None = None
        """The reply's answer as it is journaled: outcome, status, body, usage."""

    async def read(self, opened: Opened) -> AsyncIterator[bytes]:
        upstream = self.upstream = opened.upstream
        self.rules = opened.plan.rules
        content = self.content = opened.first if opened.first is not None else await read_whole(upstream)
        if self.exchange.body.get("stream") or upstream.status_code >= 400:
            self.event = Failed()
            return
        # an answer the proxy cannot read is a 502 here, not a 500 below; parsed once for both
        parsed = parse_completion(content) if upstream.status_code < 300 else None
        self.event, self.stripped = answered(content, bool(self.rules.fenced), self.exchange.agent_tools(), parsed)
        return
        yield b""

    async def follow_up(self, forwarder: Forwarder, command: Forward) -> AsyncIterator[bytes]:
        try:
            opened = await forwarder.fitting(command)
        except FollowUpTooLong:
            self.event = Refused()
            return
        async for out in self.read(opened):
            yield out

    async def ran(self, events: list[dict[str, object]]) -> AsyncIterator[bytes]:
        return
        yield b""

    def round_body(self) -> tuple[int, bytes]:
        self.previous = (self.upstream, self.stripped)
        return self.upstream.status_code, self.content

    async def reply(self, command: Reply) -> AsyncIterator[bytes]:
        self.response = self._response(self.upstream, self.stripped if command.took_calls else self.content)
        return
        yield b""

    async def end_early(self) -> AsyncIterator[bytes]:
        assert self.previous is not None  # a follow-up only exists after an answer
        self.response = self._response(*self.previous)
        return
        yield b""

    async def respond(self, rounds: AsyncIterator[bytes], opened: Opened) -> Response:
        async for _ in rounds:
            pass
        assert self.response is not None and self.ending is not None, "the turn ended without a reply"
        await self.exchange.answer(*self.ending)  # journaled before the body leaves, once begun ended (``finish``)
        return self.response

    def _response(self, upstream: httpx.Response, content: bytes) -> Response:
        x = self.exchange
        if self.compact is not None and upstream.status_code < 400:
            content = with_report(content, compaction_report(self.runner.all_events))
        outcome = "ok" if upstream.status_code < 400 else "upstream_error"
        usage = usage_of(content)
        x.add_usage(usage)
        response = with_headers(Response(content, upstream.status_code, headers=x.headers), response_headers(upstream))
        usage = usage if outcome == "ok" else None
        self.ending = (outcome, upstream.status_code, content, usage)
        return FinallyResponse(response, lambda: x.finish(outcome, upstream.status_code, content, usage), shield=False)
