"""The operator surface under ``/ctx/``: sessions, their journal, cut bodies (overflow) and operator pins.

On loopback it is open, like the proxy itself. Bound anywhere else the server refuses to start without an admin
token (``config.settings``), and every ``/ctx/*`` request (the OpenAPI schema too) must carry
``Authorization: Bearer <token>`` (``proxy.edge.callers``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import orjson
from fastapi import APIRouter
from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ctxproxy.proxy.core import message_hash, message_ids
from ctxproxy.proxy.core.identity import content_text
from ctxproxy.proxy.edge.callers import require_admin
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.proxy.errors import BadRequest, NotFound
from ctxproxy.proxy.observe.metrics import aggregate
from ctxproxy.store import Journal

__all__ = ["router"]

router = APIRouter()  # mounted at /ctx by proxy.edge.app


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.ctx
    require_admin(request, state.settings)
    return state


@router.get("/sessions")
async def list_sessions(request: Request) -> JSONResponse:
    state = _state(request)
    rows: list[dict[str, Any]] = await state.journal.call(Journal.sessions)
    return JSONResponse({"sessions": rows})


async def _session(state: AppState, session_id: str) -> dict[str, Any]:
    row: dict[str, Any] | None = await state.journal.call(Journal.session, session_id)
    if row is None:
        raise NotFound(f"No session {session_id!r} in the journal. `GET /ctx/sessions` lists them.")
    return row


@router.get("/sessions/{session_id}")
async def show_session(request: Request, session_id: str) -> JSONResponse:
    return JSONResponse(await _session(_state(request), session_id))


@router.get("/sessions/{session_id}/journal")
async def session_journal(request: Request, session_id: str, after: int = 0, limit: int = 100) -> JSONResponse:
    state = _state(request)
    await _session(state, session_id)
    rows = await state.journal.call(Journal.session_journal, session_id, after, min(max(limit, 1), 1000))
    return JSONResponse({"session_id": session_id, "entries": rows})


@router.get("/requests/{request_id}")
async def show_request(request: Request, request_id: int) -> JSONResponse:
    state = _state(request)
    row = await state.journal.call(Journal.request, request_id)
    if row is None:
        raise NotFound(f"No request {request_id} in the journal.")
    return JSONResponse(row)


@router.get("/scorecard")
async def scorecard(request: Request) -> JSONResponse:
    """Per session: input/total tokens, tokens per round and per tool call, the model's context ops; and means."""
    rows = await _state(request).journal.call(Journal.scorecard)
    return JSONResponse({"rows": rows, "aggregate": aggregate(rows)})


@router.get("/events")
async def events(request: Request) -> StreamingResponse:
    """Server-sent events: one ``context_op`` per context tool call (catalogued in docs/api/sse_events.json)."""
    state = _state(request)

    async def stream() -> AsyncIterator[bytes]:
        yield b": ctxproxy context_op events\n\n"
        async for event in state.events.subscribe():
            yield b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


@router.get("/sessions/{session_id}/overflow/{overflow_id}")
async def session_overflow(request: Request, session_id: str, overflow_id: str) -> Response:
    """A cut body, byte for byte, if this session (or an ancestor it forked from) cut it."""
    return await _overflow(_state(request), overflow_id, session_id)


@router.get("/overflow/{overflow_id}")
async def any_overflow(request: Request, overflow_id: str) -> Response:
    return await _overflow(_state(request), overflow_id, None)


async def _overflow(state: AppState, overflow_id: str, session_id: str | None) -> Response:
    row = await state.journal.call(Journal.overflow_body, overflow_id, session_id)
    if row is None:
        scope = f" for session {session_id!r}" if session_id else ""
        raise NotFound(f"No overflow body {overflow_id!r}{scope}. Stubs name their id: [overflow id=...].")
    headers = {f"x-ctx-{k.replace('_', '-')}": str(row[k]) for k in ("session_id", "tool", "call_id", "bytes")}
    return Response(row["body"].encode(), media_type="text/plain; charset=utf-8", headers=headers)


class PinRequest(BaseModel):
    handle: str | None = None
    snippet: str | None = Field(default=None, min_length=12)


@router.get("/sessions/{session_id}/pins")
async def list_pins(request: Request, session_id: str) -> JSONResponse:
    state = _state(request)
    await _session(state, session_id)
    return JSONResponse({"session_id": session_id, "pins": sorted(await _pins(state, session_id))})


@router.post("/sessions/{session_id}/pins")
async def add_pin(request: Request, session_id: str, pin: PinRequest) -> JSONResponse:
    state = _state(request)
    return JSONResponse(await _change_pin(state, session_id, pin, "pin"), status_code=201)


@router.delete("/sessions/{session_id}/pins")
async def remove_pin(request: Request, session_id: str, pin: PinRequest) -> JSONResponse:
    return JSONResponse(await _change_pin(_state(request), session_id, pin, "unpin"))


async def _change_pin(state: AppState, session_id: str, pin: PinRequest, kind: str) -> dict[str, Any]:
    """Journal an operator pin/unpin by message identity or snippet; the next request of the session honours it."""
    await _session(state, session_id)
    target = await _resolve(state, session_id, pin, must_exist=kind == "pin")
    decision = {"kind": kind, "target": target, "message_hash": "", "replacement": "", "overflow_id": "",
                "until": "", "count": 0, "source": "operator"}
    await state.locks.acquire(session_id)
    try:
        await state.journal.call(Journal.add_decisions, session_id, [decision], _now())
        await state.contexts.changed(state.journal, session_id)
    finally:
        state.locks.release(session_id)
    return {"session_id": session_id, "pins": sorted(await _pins(state, session_id))}


async def _resolve(state: AppState, session_id: str, pin: PinRequest, must_exist: bool) -> str:
    """The identity a pin names: a handle (``call_7`` or ``tool:call_7``, an identity) or a snippet of 12+
    characters found in exactly one non-system message of the session's latest request."""
    if not pin.handle and not pin.snippet:
        raise BadRequest("Give `handle` (a tool_call_id such as call_7, or an identity) or `snippet` (12+ "
                         "characters).", param="handle")
    messages = await state.journal.call(Journal.head_messages, session_id)
    ids = message_ids(messages, [message_hash(m) for m in messages])
    if pin.handle:
        target = pin.handle if ":" in pin.handle else f"tool:{pin.handle}"
        if must_exist and target not in ids:
            raise NotFound(f"No message {target!r} in the session's latest request.")
        return target
    hits = [i for i, m in enumerate(messages)
            if m.get("role") not in ("system", "developer") and str(pin.snippet) in content_text(m.get("content"))]
    if len(hits) != 1:
        raise BadRequest(f"The snippet appears in {len(hits)} non-system messages of the session's latest request;"
                         " it must name exactly one.", param="snippet")
    return ids[hits[0]]


async def _pins(state: AppState, session_id: str) -> set[str]:
    pins: set[str] = set()
    for d in await state.journal.call(Journal.decisions, session_id):
        if d["kind"] == "pin":
            pins.add(d["target"])
        elif d["kind"] == "unpin":
            pins.discard(d["target"])
    return pins


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
