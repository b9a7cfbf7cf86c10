"""One client request's ledger: what it has cost so far, and the single place its answer is journaled.

Everything the turn's I/O learns about the request lives here: the attempt number (each answer row's), the time
to first byte, the estimate the calibration learns from, the internal rounds and their usage totals, and the
forward row that waits to be journaled with its answer. ``finish`` journals the answer exactly once and releases
the session's lock, whatever path the request took (an answer, an error, a client that went away).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

from starlette.requests import Request

from ctxproxy.proxy.engine.context import Saved, SessionContext
from ctxproxy.proxy.engine.heavy import OFFLOAD_BYTES
from ctxproxy.proxy.engine.shielded import journaled
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.proxy.engine.tally import Tally
from ctxproxy.proxy.errors import StorageError, StorageFull
from ctxproxy.proxy.observe.logs import log, request_line
from ctxproxy.proxy.upstream.answers import usage_figure
from ctxproxy.proxy.wire import ChatBody
from ctxproxy.store import ForwardRecord, IncomingRequest, Journal, JournalWriter, RecordedRequest, ResponseRecord

__all__ = ["SESSION_RESPONSE_HEADER", "Exchange", "iso_ms", "now", "target_of"]

SESSION_RESPONSE_HEADER = "X-Ctx-Session"


def as_header(text: str) -> str:
    """``text`` as a header value whose bytes on the wire are its UTF-8 (starlette encodes values as latin-1):
    the client gets back the bytes it sent."""
    return text.encode("utf-8").decode("latin-1")


class Exchange:
    """One request's state across its round trips upstream; its answer is journaled once, by ``finish``."""

    def __init__(self, state: AppState, writer: JournalWriter, recorded: RecordedRequest, request: Request,
                 body: ChatBody, incoming: IncomingRequest, incognito: bool, saved: Saved | None = None) -> None:
        self.state, self.writer, self.recorded, self.request = state, writer, recorded, request
        self.saved = saved
        """The new session as read back with the request row (``read_new_session``), until the context is loaded."""
        self.body, self.incoming, self.incognito = body, incoming, incognito
        self.model = body.get("model")
        self.started = time.perf_counter()
        self.ttfb_ms: float | None = None
        self.attempt = 0
        """The number of the next answer row (every round trip's answer is journaled with its own)."""
        self.estimate = 0
        """The latest forward's estimate, which the upstream's usage calibrates (0: nothing to learn from)."""
        self.internal_rounds = 0
        self.totals = {"prompt_tokens": 0, "completion_tokens": 0}
        self.context: SessionContext | None = None
        self.tallies: list[Tallying] = []  # each forward's, counted once the answer has left (``counted``)
        self.cuts: dict[str, int] = {}
        self.retries = 0
        """Forwards again after the upstream refused the prompt as too long."""
        self.sent_ms: float | None = None
        """When the first byte went upstream: the time the proxy added before the model saw the request."""
        self.upstream_ms: list[float] = []
        """Each round trip's wait for the upstream's headers."""
        self.deferred: ForwardRecord | None = None
        """The current attempt's forward row, when it is journaled with its answer."""
        self._ending: tuple[str, int, dict[str, object] | None, float] | None = None
        """The journaled answer's outcome, status, usage and time, for the metrics and the line (``_write_line``)."""
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

    def totals_comment(self) -> bytes:
        """For a stream, whose headers left before the internal rounds ran: their totals as an SSE comment."""
        if not self.internal_rounds:
            return b""
        return (f": ctxproxy internal_rounds={self.internal_rounds} total_prompt_tokens={self.totals['prompt_tokens']}"
                f" total_completion_tokens={self.totals['completion_tokens']}\n\n").encode()

    def add_usage(self, usage: dict[str, object] | None) -> None:
        for key in self.totals:
            self.totals[key] += usage_figure(usage, key) or 0

    def agent_tools(self) -> frozenset[str]:
        tools = self.body.get("tools") or []  # checked at the edge; tolerant anyway, a tool list is not ours
        functions = [t.get("function") for t in tools if isinstance(t, dict)]
        return frozenset(f["name"] for f in functions if isinstance(f, dict) and isinstance(f.get("name"), str))

    async def lock(self) -> None:
        await self.state.locks.acquire(self.recorded.session_id)
        self._locked = True

    async def load_context(self) -> SessionContext:
        saved, self.saved = self.saved, None
        self.context = await self.state.contexts.get(self.writer, self.recorded.session_id, self.model,
                                                     self.recorded.request_id, saved, self.recorded.created)
        return self.context

    async def record(self, outcome: str, status: int, body: str | None, usage: dict[str, object] | None) -> None:
        """Journal an answer row that does not end the request (an internal round, an overflow refusal)."""
        await self.writer.call(Journal.record_response, ResponseRecord(
            self.recorded.request_id, self.attempt, outcome, status, body, usage, self.ttfb_ms, self.elapsed(),
            now()), self._take_deferred(), heavy=body is not None and len(body) >= OFFLOAD_BYTES)
        self.attempt += 1

    async def finish(self, outcome: str, status: int, body: bytes | None,
                     usage: dict[str, object] | None = None, *, log_later: bool = False) -> None:
        """Journal the answer (exactly once), learn from its usage, and release the session's lock. ``log_later``:
        the metrics and the request's line wait for the next call (the response's cleanup, once the answer has
        left): formatting and writing the line was 5% of a small request's time before the client had its answer,
        the metrics' counts and the line's fields ~30 µs more."""
        if self._finished:
            self._write_line()
            return
        self._finished = True
        try:  # the row first: what is learnt from the answer after, so that nothing in it can cost the row
            await journaled(self.writer, Journal.record_response, ResponseRecord(
                self.recorded.request_id, self.attempt, outcome, status,
                body.decode("utf-8", "replace") if body else None, usage, self.ttfb_ms, self.elapsed(), now()),
                self._take_deferred(), heavy=body is not None and len(body) >= OFFLOAD_BYTES)
            self._calibrate(usage)  # before the lock goes: the session's next request projects with it
            self._ending = (outcome, status, usage, self.elapsed())
            if not log_later:
                self._write_line()
        finally:
            if self._locked:
                self.state.locks.release(self.recorded.session_id)

    async def answer(self, outcome: str, status: int, body: bytes | None,
                     usage: dict[str, object] | None = None) -> None:
        """``finish`` before the client has the end of the answer (a buffered body, a stream's ``[DONE]``).

        An agent sends its next request as soon as it has read an answer, and that request may land on another
        replica, which continues the session only from an answered head (``store.placement``): journaled after
        the client had it, the answer lost that race and the session forked. A storage failure here is logged,
        not raised: the writer keeps the answer to write once there is room (``store.writer``), and the client
        still gets the answer it waits for. The request's log line is written by the ``finish`` the response's
        cleanup calls (``FinallyResponse``), once the answer has left."""
        try:
            await self.finish(outcome, status, body, usage, log_later=True)
        except (StorageFull, StorageError) as exc:
            log.warning("the answer of request %s is kept in memory until the journal can take it: %s",
                        self.recorded.request_id, exc.message)

    def planned(self, cuts: dict[str, int], tally: Tallying) -> None:
        """A forward was planned: its tokens, and its new cuts added to the request's."""
        self.tallies.append(tally)
        self.cuts = {kind: self.cuts.get(kind, 0) + cuts.get(kind, 0) for kind in self.cuts | cuts}

    def _write_line(self) -> None:
        """The journaled answer counted in the metrics, and the request's line written (none if the answer could
        not be journaled: the client got an error, or the answer waits in memory for the disk)."""
        ending, self._ending = self._ending, None
        fields = None
        if ending is not None:
            outcome, status, usage, total_ms = ending
            self.state.metrics.answered(outcome, usage)
            self.state.metrics.timed(self.sent_ms, self.upstream_ms)
            fields = _line_fields(self, outcome, status, total_ms)
        tallies, self.tallies = self.tallies, []
        tally = counted(tallies)  # for the metrics as well, line or not
        if fields is not None:
            fields |= {"tokens_in": tally.tokens_in, "tokens_out": tally.tokens_out} if tally else {}
            log.info(request_line(fields), extra={"ctx": fields})

    def _calibrate(self, usage: dict[str, object] | None) -> None:
        prompt = usage_figure(usage, "prompt_tokens")
        if self.context is None or not prompt or not self.estimate:
            return
        calibration = self.context.calibration(self.model).observe(self.estimate, prompt)
        self.context.calibrations[self.model] = self.state.contexts.models[self.model] = calibration

    def _take_deferred(self) -> ForwardRecord | None:
        """The current attempt's forward row if it waits for its answer (then it is written with it, once)."""
        deferred, self.deferred = self.deferred, None
        return deferred

    def elapsed(self) -> float:
        return round((time.perf_counter() - self.started) * 1000, 3)


def _line_fields(x: Exchange, outcome: str, status: int, total_ms: float) -> dict[str, object]:
    """The request's one line at info: who, where, what happened, the tokens, the cuts, the time."""
    return {"event": "request", "session": x.recorded.session_id, "request_id": x.recorded.request_id,
            "route": f"{x.request.method} {target_of(x.request)[0]}", "status": status, "outcome": outcome,
            "tokens_in": None, "tokens_out": None, "cuts": x.cuts,  # once the tally is known
            "retries": x.retries, "rounds": x.internal_rounds, "added_ms": x.sent_ms, "total_ms": total_ms}


Tallying = Callable[[], "Tally"]
"""A forward's tally, counted when called (``proxy.engine.planning._tallied``)."""


def counted(tallies: list[Tallying]) -> Tally | None:
    """Each forward's tally counted (each gives the metrics what its cuts freed); the latest one, whose tokens (in,
    out) the request's log line gives."""
    latest = None
    for count in tallies:
        latest = count()
    return latest


def target_of(request: Request) -> tuple[str, str]:
    """``request.url.path`` and ``request.url.query`` without building the URL (it parses the host header, then
    splits the URL it assembled: 1.3% of a small request, once per forward and once for the log line): the
    scope's path and query string, escaped and cut as Starlette's ``URL`` does."""
    path: str = request.scope["path"]
    path = path.replace("?", "%3F").replace("#", "%23").replace("\\", "%5C")
    query = request.scope.get("query_string", b"").decode().partition("#")[0]
    if "\t" in path + query or "\r" in path + query or "\n" in path + query:  # what ``urlsplit`` drops
        path, query = (x.replace("\t", "").replace("\r", "").replace("\n", "") for x in (path, query))
    return path, query


def now() -> str:
    """The time as the journal keeps it: ``datetime.now(UTC).isoformat(timespec="milliseconds")``, whose second is
    formatted once a second (it is asked for several times on every request: 2% of a small one's loop time)."""
    return iso_ms(time.time_ns())


class _Second:
    """The latest second ``iso_ms`` formatted, with its text: one tuple, replaced whole (read from several threads)."""

    latest: tuple[int, str] = (-1, "")


def iso_ms(ns: int) -> str:
    """``ns`` nanoseconds since the epoch as ISO 8601 in UTC, to the millisecond (truncated, as ``isoformat`` does)."""
    second, ms = divmod(ns // 1_000_000, 1000)
    latest = _Second.latest
    if latest[0] != second:
        latest = _Second.latest = (second, datetime.fromtimestamp(second, UTC).isoformat()[:19])
    return f"{latest[1]}.{ms:03d}+00:00"
