"""``POST /v1/chat/completions``: validate, journal, project, forward, relay, journal the answer.

The order is the contract: the request is journaled before anything else; the session's lock is held from then
until the answer is journaled, whatever happens in between (an upstream failure, a client that disconnects
mid-stream). The projection's decisions and cut bodies are journaled before a byte goes upstream
(``proxy.planning``). When nothing is rewritten the client's body goes upstream byte for byte; a streamed answer
is relayed chunk by chunk as it arrives.

If the upstream answers that the prompt is too long (``proxy.overflow``), the calibration is corrected from what
the upstream counted, the request is projected again with the stricter ratio and retried once; if it still does not
fit, the client gets a clear ``context_length_exceeded`` error. A llama.cpp stream that overflows says nothing (a
200 that ends, or a connection closed, before its first byte): the upstream is asked why (``Exchange._probe``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, cast

import anyio
import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from proxy.answers import parse_completion, usage_figure
from proxy.callers import as_header, incognito_requested, requested_session, scoped_fingerprint
from proxy.context import SessionContext
from proxy.edge import parse_chat_body, read_body
from proxy.errors import (
    ContextTooLarge,
    CtxError,
    UpstreamBrokeOff,
    UpstreamMalformed,
    UpstreamTimeout,
    envelope,
    error_response,
    sse_error,
)
from proxy.heavy import check_message_count, is_heavy
from proxy.intercept import ContextRunner, strip_calls
from proxy.loop import VIA_HEADER, refuse_loop
from proxy.overflow import Overflow, detect_overflow
from proxy.planning import Plan, plan_forward, what_takes_room
from proxy.relay import intercepting_stream, stream_broke_off
from proxy.responses import FinallyResponse
from proxy.rewrite import canonical_json, content_hash, fingerprint
from proxy.sse import last_usage
from proxy.state import AppState
from proxy.tools.blocks import extract_blocks, has_command, results_message
from proxy.tools.offer import turn_of
from proxy.upstream import client_headers, redact, response_headers, with_headers
from proxy.wire import ChatBody
from store import ForwardRecord, IncomingRequest, Journal, JournalWriter, RecordedRequest, ResponseRecord

__all__ = ["chat_completions", "incoming_request"]

SESSION_RESPONSE_HEADER = "X-Ctx-Session"
ATTEMPTS = 2
"""The first forward, and one retry after the upstream said the prompt is too long."""
_CHAT_DROP = frozenset({"accept-encoding"})
_IDENTITY = [(b"accept-encoding", b"identity")]  # the proxy reads the answer (usage), so it must arrive plain
_BROKE_OFF = httpx.Response(502)
"""Stands for a streamed forward the upstream closed before its first byte: llama-cpp-python's way of refusing
a streamed prompt over its ``n_ctx`` (its log: "Requested tokens (N) exceed context window"). When the probe
(``Exchange._probe``) confirms an overflow, it is retried once, cut smaller, like any overflow."""


async def chat_completions(request: Request) -> Response:
    state: AppState = request.app.state.ctx
    refuse_loop(request.headers, state.upstream.instance)
    incognito = incognito_requested(request) or state.settings.incognito
    raw = await read_body(request, state.settings.max_body_bytes, state.settings.client_body_timeout)
    body, incoming = await state.offload.run(is_heavy(raw), _admit, request, raw, state)
    writer = state.journal_for(incognito)
    with anyio.CancelScope(shield=True):  # once begun, the request's row is written, so its answer row can follow
        recorded = await writer.call(Journal.record_request, incoming)
    exchange = Exchange(state, writer, recorded, request, body, incoming, incognito)
    try:
        await exchange.lock()
        return await exchange.run(raw)
    except CtxError as exc:
        with anyio.CancelScope(shield=True):
            await exchange.finish(_outcome_of(exc), exc.status, envelope(exc.message, exc.type, exc.param, exc.code))
        return error_response(exc, headers=exchange.headers)
    except BaseException as exc:
        cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
        with anyio.CancelScope(shield=True):
            await exchange.finish(_outcome_of(exc), 499 if cancelled else 500, None)
        raise


def _admit(request: Request, raw: bytes, state: AppState) -> tuple[ChatBody, IncomingRequest]:
    """Parse, validate and hash: sized by the request, so a large one's runs on the worker (``proxy.heavy``)."""
    body = parse_chat_body(raw)
    check_message_count(len(body["messages"]), state.settings.max_messages)
    return body, incoming_request(request, raw, body, state)


def incoming_request(request: Request, raw: bytes, body: ChatBody, state: AppState) -> IncomingRequest:
    """The journal's view of a request: content hashes and canonical bodies, credentials redacted."""
    messages = body["messages"]
    session_name = requested_session(request, state.settings)
    opening = scoped_fingerprint(fingerprint(messages), request, state.settings)
    hashed = state.hasher.hash(session_name or opening, messages)
    params = canonical_json({k: v for k, v in body.items() if k != "messages"})
    turn = turn_of(cast(list[dict[str, Any]], messages))
    return IncomingRequest(
        received_at=_now(), path=request.url.path, model=body.get("model"), stream=bool(body.get("stream")),
        session_name=session_name, fingerprint=opening, hashes=hashed.hashes, bodies=hashed.bodies,
        params_hash=content_hash(params), params_body=params, headers=redact(request.headers.raw, state.own_headers),
        body_bytes=len(raw), turn=hashed.hashes[turn.start] if messages[turn.start].get("role") == "user" else "",
    )


class Exchange:
    """One request's round trips upstream, and the single place its answer is journaled and its lock released."""

    def __init__(self, state: AppState, writer: JournalWriter, recorded: RecordedRequest, request: Request,
                 body: ChatBody, incoming: IncomingRequest, incognito: bool) -> None:
        self.state, self.writer, self.recorded, self.request = state, writer, recorded, request
        self.body, self.incoming, self.incognito = body, incoming, incognito
        self.started = time.perf_counter()
        self.ttfb_ms: float | None = None
        self.attempt = 0
        self.estimate = 0
        self.internal_rounds = 0
        self.totals = {"prompt_tokens": 0, "completion_tokens": 0}
        self.context: SessionContext | None = None
        self._chunks: AsyncIterator[bytes] = _nothing()
        self.deferred: ForwardRecord | None = None
        self.compact = _compact_request(body)
        self.runner_events: list[dict[str, Any]] = []
        """``/compact [instruction]`` typed by the person: the instruction ("" without one), else None."""
        self._locked = False
        self._finished = False

    @property
    def headers(self) -> dict[str, str]:
        headers = {SESSION_RESPONSE_HEADER: as_header(self.recorded.session_id)}
        if self.internal_rounds:  # the usage the agent reads is the final answer's; the totals are here
            headers |= {"X-Ctx-Internal-Rounds": str(self.internal_rounds),
                        "X-Ctx-Total-Prompt-Tokens": str(self.totals["prompt_tokens"]),
                        "X-Ctx-Total-Completion-Tokens": str(self.totals["completion_tokens"])}
        return headers

    def add_usage(self, usage: dict[str, object] | None) -> None:
        for key in self.totals:
            self.totals[key] += usage_figure(usage, key) or 0

    async def lock(self) -> None:
        await self.state.locks.acquire(self.recorded.session_id)
        self._locked = True

    async def run(self, raw: bytes) -> Response:
        """Forward, and while the model answers with context-tool calls only, execute them and ask again (the
        last round without the tools). The agent gets the final answer, or the model's own calls of a mixed one."""
        model = self.body.get("model")
        self.context = await self.state.contexts.get(self.writer, self.recorded.session_id, model)
        runner = ContextRunner(self.state, self.writer, self.context, self.recorded.session_id,
                               self.recorded.request_id, cast(list[dict[str, Any]], self.body["messages"]),
                               list(self.incoming.hashes))
        self.runner_events = runner.all_events
        rounds = self.state.settings.for_model(model).max_context_rounds
        splice: list[dict[str, Any]] = []
        last: tuple[httpx.Response, bytes] | None = None
        for internal in range(rounds + 1):
            try:
                upstream, first, plan = await self.forward_fitting(raw, splice, offer=internal < rounds)
            except FollowUpTooLong:
                assert last is not None  # a follow-up only exists after an answer
                return self._buffered_response(*last)
            if self.body.get("stream") and upstream.status_code == 200:
                return intercepting_stream(self, upstream, first or b"", plan, runner, raw, rounds)
            if self.body.get("stream") or upstream.status_code >= 400:
                return await self._respond(upstream, first)
            content = first if first is not None else await _read(upstream)
            if upstream.status_code < 300:
                parse_completion(content)  # an answer the proxy cannot read is a 502 here, not a 500 below
            fenced = bool(plan.rules.fenced)
            answer, calls, said = _fenced_calls(content) if fenced else (*_context_calls(content, self.agent_tools()),
                                                                        "")
            if not calls:
                return self._buffered_response(upstream, content)
            results = await runner.execute(calls, plan.rules, model)
            stripped = orjson.dumps(answer)
            if (has_command(_message(answer).get("content") or "") if fenced else _has_agent_calls(answer)) \
                    or internal == rounds:
                return self._buffered_response(upstream, stripped)
            await self.record_round(upstream.status_code, content)
            last = (upstream, stripped)
            splice += [{"role": "assistant", "content": said}, results_message(results)] if fenced else \
                [{"role": "assistant", "content": _message(answer).get("content"), "tool_calls": calls}, *results]
            self.internal_rounds = internal + 1
        raise AssertionError("unreachable: the last round returns")

    async def forward_fitting(self, raw: bytes, splice: list[dict[str, Any]],
                               offer: bool) -> tuple[httpx.Response, bytes | None, Plan]:
        """Forward; if the upstream says the prompt is too long, learn its window and count, cut harder and retry
        once (the same bytes if nothing more can be cut: the refusal may have been the upstream's hiccup)."""
        for attempt in range(ATTEMPTS):
            assert self.context is not None
            plan = await plan_forward(self.state, self.writer, self.context, self.recorded, self.body, raw,
                                      self.incoming, self.attempt, self.incognito, splice, offer, self.compact)
            self.estimate = 0 if splice else plan.estimate  # usage with a splice does not measure the estimate
            self.deferred = plan.deferred
            upstream, first, overflow = await self._attempt(plan.body)
            if overflow is None:
                return upstream, first, plan
            if splice:  # the spliced tool results made it too long, not the conversation: learn nothing from it
                await self._record_overflow(overflow, upstream.status_code)
                self.attempt += 1
                raise FollowUpTooLong("The follow-up with the context tools' results did not fit.")
            self._learn(plan, overflow)
            if attempt == ATTEMPTS - 1:
                break
            await self._record_overflow(overflow, upstream.status_code)
            self.attempt += 1
        raise ContextTooLarge(self._refusal(plan, overflow))

    async def _attempt(self, body: bytes) -> tuple[httpx.Response, bytes | None, Overflow | None]:
        """One forward: the answer, its read-ahead first chunk, and the overflow it signals (if any). A stream
        that ends or breaks off before its first byte says nothing of why; the upstream is asked (``_probe``)."""
        try:
            upstream = await self._open(body)
            first, overflow = await self._inspect(upstream)
        except UpstreamBrokeOff as exc:
            if not self.body.get("stream"):
                raise
            asked, probed = await self._probe(body)
            if probed is None:
                raise exc from None  # the upstream takes this prompt (or cannot be asked): it failed otherwise
            return _BROKE_OFF, b"", probed
        if overflow is not None and overflow.limit is None and self.body.get("stream"):
            asked, probed = await self._probe(body)
            if asked and probed is None:
                raise UpstreamBrokeOff("The upstream ended the stream before its first byte, yet takes the same "
                                       "prompt unstreamed: it is not too long. See the model server's log.")
            overflow = probed or overflow
        return upstream, first, overflow

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
        ttfb = self.ttfb_ms
        try:
            for _ in range(2):
                try:
                    answer = await self._open(orjson.dumps(probe))
                    return True, detect_overflow(answer.status_code, await _read(answer))
                except UpstreamBrokeOff:
                    continue
                except CtxError:
                    break
            return False, None
        finally:
            self.ttfb_ms = ttfb

    def _learn(self, plan: Plan, overflow: Overflow) -> None:
        """What an overflow teaches: the upstream's count (the ratio k) and a ceiling on its window."""
        assert self.context is not None
        model = self.body.get("model")
        corrected = self.context.calibration(model).overflow(plan.estimate, overflow.prompt_tokens)
        self.context.calibrations[model] = corrected
        failed = overflow.limit or plan.rules.scaled(plan.estimate)  # the prompt we sent did not fit
        limits = self.state.contexts.window_limits
        limits[model] = min(limits.get(model, plan.rules.budget.window), failed, plan.rules.budget.window)

    def _refusal(self, plan: Plan, overflow: Overflow | None) -> str:
        state = plan.projection.state
        largest = sorted(zip(state.ids, state.counts, strict=True), key=lambda p: -p[1])[:5]
        room = what_takes_room(largest, cast(list[Any], self.body["messages"]), state.ids)
        said = f" The upstream said: {overflow.message}" if overflow else ""
        return (f"The upstream refused the prompt as too long twice, the second time after ctxproxy cut it to about "
                f"{plan.rules.scaled(plan.estimate)} tokens as it counts them. What takes the room: {room}.{said} "
                "Set ctx_window to the model's real window, or start a new session.")

    def agent_tools(self) -> frozenset[str]:
        tools = self.body.get("tools") or []  # checked at the edge; tolerant anyway, a tool list is not ours
        functions = [t.get("function") for t in tools if isinstance(t, dict)]
        return frozenset(f["name"] for f in functions if isinstance(f, dict) and isinstance(f.get("name"), str))

    def upstream_chunks(self) -> AsyncIterator[bytes]:
        """The rest of the current upstream stream (its first chunk was read ahead by ``_inspect``)."""
        return self._chunks

    def totals_comment(self) -> bytes:
        """For a stream, whose headers left before the internal rounds ran: their totals as an SSE comment."""
        if not self.internal_rounds:
            return b""
        return (f": ctxproxy internal_rounds={self.internal_rounds} total_prompt_tokens={self.totals['prompt_tokens']}"
                f" total_completion_tokens={self.totals['completion_tokens']}\n\n").encode()

    async def record_round(self, status: int, content: bytes) -> None:
        """Journal an answer that only called context tools (the agent never gets it)."""
        usage = _usage_of(content) or last_usage(content.decode("utf-8", "replace"))
        self.add_usage(usage)
        self.state.metrics.answered("context_round", usage)
        await self.writer.call(Journal.record_response, ResponseRecord(
            self.recorded.request_id, self.attempt, "context_round", status, content.decode("utf-8", "replace"),
            usage, self.ttfb_ms, self._elapsed(), _now()), self._take_deferred())
        self.attempt += 1

    async def _open(self, body: bytes) -> httpx.Response:
        headers = client_headers(self.request.headers.raw, self.state.own_headers, _CHAT_DROP) + _IDENTITY
        upstream = await self.state.upstream.send("POST", self.request.url.path, self.request.url.query, headers,
                                                  body, via=self.request.headers.get(VIA_HEADER, ""))
        self.ttfb_ms = self._elapsed()
        return upstream

    async def _inspect(self, upstream: httpx.Response) -> tuple[bytes | None, Overflow | None]:
        """An error answer is read whole (to recognise an overflow); a stream's first chunk is read ahead (a
        llama.cpp stream that overflows is a 200 that ends before it starts)."""
        if upstream.status_code >= 400:
            content = await _read(upstream)
            return content, detect_overflow(upstream.status_code, content)
        if not self.body.get("stream"):
            return None, None
        self._chunks = upstream.aiter_raw()
        try:
            first = await anext(self._chunks, b"")
        except httpx.TimeoutException:
            await upstream.aclose()
            raise UpstreamTimeout("The upstream did not start its answer in time.") from None
        except httpx.TransportError as exc:
            await upstream.aclose()
            raise UpstreamBrokeOff(f"The upstream closed the connection before the first byte of its answer: "
                                   f"{exc or type(exc).__name__}. See the model server's log.") from None
        if first:
            return first, None
        await upstream.aclose()
        return b"", Overflow(None, "the upstream ended the stream without a byte (llama.cpp's overflow)")

    async def _record_overflow(self, overflow: Overflow, status: int) -> None:
        await self.writer.call(Journal.record_response, ResponseRecord(
            self.recorded.request_id, self.attempt, "context_overflow", status, overflow.message, None,
            self.ttfb_ms, self._elapsed(), _now()), self._take_deferred())

    async def _respond(self, upstream: httpx.Response, first: bytes | None) -> Response:
        if self.body.get("stream") and upstream.status_code == 200:
            return self._relay(upstream, first or b"")
        content = first if first is not None else await _read(upstream)
        return self._buffered_response(upstream, content)

    def compaction_report(self) -> str:
        """What /compact did, for the agent: the model's context ops over this request, summed."""
        ops = [e for e in self.runner_events if e["ok"] and e["op"] in ("drop", "note", "clear")]
        freed = sum(e["tokens_freed"] for e in ops)
        kinds = ", ".join(f"{op} x{n}" for op, n in sorted(Counter(e["op"] for e in ops).items())) or "nothing cut"
        return f"[ctxproxy] Context compacted: about {freed} tokens freed ({kinds}); everything cut is restorable."

    def _with_report(self, content: bytes) -> bytes:
        try:
            answer = orjson.loads(content)
            message = answer["choices"][0]["message"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            return content
        said = message.get("content") if isinstance(message.get("content"), str) else ""
        message["content"] = self.compaction_report() + (f"\n{said}" if said else "")
        return orjson.dumps(answer)

    def _buffered_response(self, upstream: httpx.Response, content: bytes) -> Response:
        if self.compact is not None and upstream.status_code < 400:
            content = self._with_report(content)
        outcome = "ok" if upstream.status_code < 400 else "upstream_error"
        self.add_usage(_usage_of(content))
        response = with_headers(Response(content, upstream.status_code, headers=self.headers),
                                response_headers(upstream))
        usage = _usage_of(content) if outcome == "ok" else None
        return FinallyResponse(response, lambda: self.finish(outcome, upstream.status_code, content, usage))

    def _relay(self, upstream: httpx.Response, first: bytes) -> Response:
        chunks: list[bytes] = [first]
        state = {"outcome": "client_disconnected"}

        async def forward() -> AsyncIterator[bytes]:
            yield first
            try:
                async for chunk in self._chunks:
                    chunks.append(chunk)
                    yield chunk
                state["outcome"] = "ok"
            except httpx.TransportError as exc:
                state["outcome"] = "timeout" if isinstance(exc, httpx.TimeoutException) else "upstream_error"
                yield sse_error(stream_broke_off(exc))

        async def done() -> None:
            await upstream.aclose()
            text = b"".join(chunks)
            await self.finish(state["outcome"], upstream.status_code, text, last_usage(text.decode("utf-8", "replace")))

        inner = with_headers(StreamingResponse(forward(), upstream.status_code, headers=self.headers),
                             response_headers(upstream))
        return FinallyResponse(inner, done)

    async def finish(self, outcome: str, status: int, body: bytes | None,
                     usage: dict[str, object] | None = None) -> None:
        """Journal the answer (exactly once), learn from its usage, and release the session's lock."""
        if self._finished:
            return
        self._finished = True
        try:  # the row first: what is learnt from the answer after, so that nothing in it can cost the row
            await self.writer.call(Journal.record_response, ResponseRecord(
                self.recorded.request_id, self.attempt, outcome, status,
                body.decode("utf-8", "replace") if body else None, usage, self.ttfb_ms, self._elapsed(), _now()),
                self._take_deferred())
            self._calibrate(usage)
            self.state.metrics.answered(outcome, usage)
        finally:
            if self._locked:
                self.state.locks.release(self.recorded.session_id)

    def _calibrate(self, usage: dict[str, object] | None) -> None:
        prompt = usage_figure(usage, "prompt_tokens")
        if self.context is None or not prompt or not self.estimate:
            return
        model = self.body.get("model")
        calibration = self.context.calibration(model).observe(self.estimate, prompt)
        self.context.calibrations[model] = self.state.contexts.models[model] = calibration

    def _take_deferred(self) -> ForwardRecord | None:
        """The current attempt's forward row if it waits for its answer (then it is written with it, once)."""
        deferred, self.deferred = self.deferred, None
        return deferred

    def _elapsed(self) -> float:
        return round((time.perf_counter() - self.started) * 1000, 3)


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""


async def _read(upstream: httpx.Response) -> bytes:
    try:
        return await upstream.aread()
    except httpx.TimeoutException:
        raise UpstreamTimeout("The upstream stopped sending its answer in time.") from None
    except httpx.TransportError as exc:
        raise UpstreamBrokeOff(f"The upstream broke off its answer: {exc or type(exc).__name__}.") from None
    finally:
        await upstream.aclose()


class FollowUpTooLong(CtxError):
    """A follow-up round (the conversation plus the context tools' results) was refused as too long."""

    status, type, code = 400, "invalid_request_error", "context_length_exceeded"


def _context_calls(content: bytes, agent_tools: frozenset[str]) -> tuple[dict[str, Any], list[Any]]:
    try:
        answer = orjson.loads(content)
    except orjson.JSONDecodeError:
        return {}, []
    return strip_calls(answer, agent_tools)


def _compact_request(body: ChatBody) -> str | None:
    """The person's ``/compact [instruction]``, if their latest message is one."""
    last = body["messages"][-1]
    content = last.get("content")
    if last.get("role") != "user" or not isinstance(content, str) or not content.strip().startswith("/compact"):
        return None
    rest = content.strip()[len("/compact"):]
    return rest.strip() if not rest or rest[0].isspace() else None


def _fenced_calls(content: bytes) -> tuple[dict[str, Any], list[Any], str]:
    """A text-protocol answer: without its context blocks, their calls, and the text as the model wrote it."""
    try:
        answer = orjson.loads(content)
        message = answer["choices"][0]["message"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return {}, [], ""
    said = message.get("content") if isinstance(message.get("content"), str) else ""
    text, calls = extract_blocks(said)
    if not calls:
        return answer, [], said
    kept = {**message, "content": text}
    return {**answer, "choices": [{**answer["choices"][0], "message": kept}, *answer["choices"][1:]]}, calls, said


def _message(answer: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = answer["choices"][0]["message"]
    return message


def _has_agent_calls(answer: dict[str, Any]) -> bool:
    return bool(_message(answer).get("tool_calls"))


def _usage_of(content: bytes) -> dict[str, object] | None:
    try:
        usage = orjson.loads(content).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def _outcome_of(exc: BaseException) -> str:
    if isinstance(exc, ContextTooLarge):
        return "context_too_large"
    if isinstance(exc, UpstreamMalformed):
        return "upstream_malformed"
    if isinstance(exc, CtxError):
        return {502: "unreachable", 504: "timeout"}.get(exc.status, "error")
    return "client_disconnected" if isinstance(exc, anyio.get_cancelled_exc_class()) else "error"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
