"""``POST /v1/chat/completions``: validate, journal, forward, relay, journal the answer.

The order is the contract: the request is journaled (committed) before a byte goes upstream; the session's lock
is held from then until the answer is journaled, whatever happens in between (an upstream failure, a client that
disconnects mid-stream). When nothing is rewritten the client's body goes upstream byte for byte, and a streamed
answer is relayed chunk by chunk as it arrives.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import anyio
import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from proxy.edge import parse_chat_body, read_body
from proxy.errors import CtxError, UpstreamTimeout, envelope
from proxy.responses import FinallyResponse
from proxy.rewrite import canonical_json, content_hash, fingerprint
from proxy.sse import last_usage
from proxy.state import AppState
from proxy.upstream import client_headers, redact, response_headers
from proxy.wire import ChatBody
from store import IncomingRequest, Journal, JournalWriter, RecordedRequest, ResponseRecord

__all__ = ["chat_completions", "incoming_request"]

SESSION_RESPONSE_HEADER = "X-Ctx-Session"
_CHAT_DROP = frozenset({"accept-encoding"})
_IDENTITY = [(b"accept-encoding", b"identity")]  # the proxy reads the answer (usage), so it must arrive plain


async def chat_completions(request: Request) -> Response:
    state: AppState = request.app.state.ctx
    raw = await read_body(request, state.settings.max_body_bytes)
    body = parse_chat_body(raw)
    incognito = request.headers.get("x-ctx-incognito", "").lower() in ("1", "true", "yes")
    writer = state.journal_for(incognito)
    incoming = incoming_request(request, raw, body, state)
    recorded = await writer.call(Journal.record_request, incoming)
    await state.locks.acquire(recorded.session_id)
    exchange = Exchange(state, writer, recorded)
    try:
        upstream = await exchange.open(request, raw)
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await exchange.finish(_outcome_of(exc), getattr(exc, "status", 499), None)
        raise
    if body.get("stream") and upstream.status_code == 200:
        return exchange.relay(upstream)
    return await exchange.buffered(upstream)


def incoming_request(request: Request, raw: bytes, body: ChatBody, state: AppState) -> IncomingRequest:
    """The journal's view of a request: content hashes and canonical bodies, credentials redacted."""
    messages = body["messages"]
    session_name = request.headers.get(state.settings.session_header) or None
    opening = fingerprint(messages)
    hashed = state.hasher.hash(session_name or opening, messages)
    params = canonical_json({k: v for k, v in body.items() if k != "messages"})
    return IncomingRequest(
        received_at=_now(),
        path=request.url.path,
        model=body.get("model"),
        stream=bool(body.get("stream")),
        session_name=session_name,
        fingerprint=opening,
        hashes=hashed.hashes,
        bodies=hashed.bodies,
        params_hash=content_hash(params),
        params_body=params,
        headers=redact(request.headers.raw),
        body_bytes=len(raw),
    )


class Exchange:
    """One request's round trip upstream, and the single place its answer is journaled and its lock released."""

    def __init__(self, state: AppState, writer: JournalWriter, recorded: RecordedRequest) -> None:
        self.state, self.writer, self.recorded = state, writer, recorded
        self.started = time.perf_counter()
        self.ttfb_ms: float | None = None
        self._finished = False

    @property
    def headers(self) -> dict[str, str]:
        return {SESSION_RESPONSE_HEADER: self.recorded.session_id}

    async def open(self, request: Request, raw: bytes) -> httpx.Response:
        own = self.state.own_headers
        headers = client_headers(request.headers.raw, own, _CHAT_DROP) + _IDENTITY
        upstream = await self.state.upstream.send("POST", request.url.path, request.url.query, headers, raw)
        self.ttfb_ms = self._elapsed()
        return upstream

    async def buffered(self, upstream: httpx.Response) -> Response:
        try:
            content = await upstream.aread()
        except httpx.TimeoutException:
            raise UpstreamTimeout("The upstream stopped sending its answer in time.") from None
        finally:
            await upstream.aclose()
        outcome = "ok" if upstream.status_code < 400 else "upstream_error"
        response = Response(content, upstream.status_code, headers=response_headers(upstream) | self.headers)
        usage = _usage_of(content)
        return FinallyResponse(response, lambda: self.finish(outcome, upstream.status_code, content, usage))

    def relay(self, upstream: httpx.Response) -> Response:
        chunks: list[bytes] = []
        state = {"outcome": "client_disconnected"}

        async def forward() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    chunks.append(chunk)
                    yield chunk
                state["outcome"] = "ok"
            except httpx.TransportError as exc:
                state["outcome"] = "timeout" if isinstance(exc, httpx.TimeoutException) else "upstream_error"
                yield _sse_error(f"The upstream stream broke off: {type(exc).__name__}.")

        async def done() -> None:
            await upstream.aclose()
            text = b"".join(chunks)
            await self.finish(state["outcome"], upstream.status_code, text, last_usage(text.decode("utf-8", "replace")))

        inner = StreamingResponse(forward(), upstream.status_code, headers=response_headers(upstream) | self.headers)
        return FinallyResponse(inner, done)

    async def finish(self, outcome: str, status: int, body: bytes | None,
                     usage: dict[str, object] | None = None) -> None:
        """Journal the answer (exactly once) and release the session's lock."""
        if self._finished:
            return
        self._finished = True
        try:
            await self.writer.call(Journal.record_response, ResponseRecord(
                self.recorded.request_id, 0, outcome, status, body.decode("utf-8", "replace") if body else None,
                usage, self.ttfb_ms, self._elapsed(), _now()))
        finally:
            self.state.locks.release(self.recorded.session_id)

    def _elapsed(self) -> float:
        return round((time.perf_counter() - self.started) * 1000, 3)


def _usage_of(content: bytes) -> dict[str, object] | None:
    try:
        usage = orjson.loads(content).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def _outcome_of(exc: BaseException) -> str:
    if isinstance(exc, CtxError):
        return {502: "unreachable", 504: "timeout"}.get(exc.status, "error")
    return "client_disconnected" if isinstance(exc, anyio.get_cancelled_exc_class()) else "error"


def _sse_error(message: str) -> bytes:
    return b"data: " + envelope(message, "upstream_error", None, "upstream_stream_error") + b"\n\n"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
