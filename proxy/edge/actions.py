"""The operator's cuts from the inspector: drop a tool result, or restore one that was cut, for the next request.

Pins are ``proxy.edge.admin``'s (``/ctx/sessions/{id}/pins``). These two are decisions like the projection's own,
journaled with ``source = "operator"`` under the session's lock, after which the session's working context is
dropped so its next request is projected afresh from the decisions. A drop stores the result's body in the
overflow store first (``read_overflow`` and ``/ctx/.../overflow/{id}`` restore it byte for byte) and puts an
exact stub in its place; a restore makes a cut no longer apply: the message goes whole until the rules cut it
afresh (a request over budget may elide it again; a pin keeps it).
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse

from ctxproxy.proxy.core import Decision, message_hash, message_ids
from ctxproxy.proxy.core.budget import MIN_CUT_CHARS
from ctxproxy.proxy.core.decisions import CUTS
from ctxproxy.proxy.core.state import sha256_text
from ctxproxy.proxy.core.stubs import stub_line
from ctxproxy.proxy.edge.callers import require_admin
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.proxy.errors import BadRequest, NotFound
from ctxproxy.store import Journal, OverflowBody

__all__ = ["router"]

router = APIRouter()  # mounted at /ctx by proxy.app


class Target(BaseModel):
    handle: str
    """A message identity as the inspector shows it (``tool:call_7``), or a tool call id (``call_7``)."""


@router.post("/sessions/{session_id}/drop")
async def drop(request: Request, session_id: str, target: Target) -> JSONResponse:
    """Cut a tool result from the session's next requests: its body goes to the overflow store, a stub stays."""
    state = _state(request)
    messages, ids, hashes, (cuts, pins) = await _session_view(state, session_id)
    handle = _identity(target.handle)
    i = _index(ids, handle)
    if handle in pins:
        raise BadRequest(f"{handle} is pinned; unpin it first.", param="handle")
    message, content = messages[i], messages[i].get("content")
    if message.get("role") != "tool" or not isinstance(content, str):
        raise BadRequest(f"{handle} is not a tool result with text content; only those can be dropped.",
                         param="handle")
    if handle in cuts:
        raise BadRequest(f"{handle} is already cut ({cuts[handle]}); restore it first.", param="handle")
    if len(content) < MIN_CUT_CHARS:
        raise BadRequest(f"{handle} has {len(content)} characters; under {MIN_CUT_CHARS} its stub would not be "
                         "smaller.", param="handle")
    call_id = str(message.get("tool_call_id") or "")
    tool = _tool_of(messages, call_id)
    overflow_id = sha256_text(content)
    stub = (stub_line(overflow_id, tool, len(content.encode()), call_id, "disk") +
            f"\nDropped by the operator. The original is intact: read_overflow id={overflow_id}.")
    decision = Decision("drop", handle, hashes[i], stub, overflow_id, source="operator")
    await _journal(state, session_id, decision, [OverflowBody(overflow_id, content, tool, call_id)])
    return JSONResponse({"session_id": session_id, "dropped": handle, "overflow_id": overflow_id}, status_code=201)


@router.post("/sessions/{session_id}/restore")
async def restore(request: Request, session_id: str, target: Target) -> JSONResponse:
    """Undo the cut of one message (spilled, elided, dropped or noted) for the session's next request."""
    state = _state(request)
    _, ids, _, (cuts, pins) = await _session_view(state, session_id)
    handle = _identity(target.handle)
    _index(ids, handle)
    if handle not in cuts or handle in pins:
        raise BadRequest(f"{handle} is not cut (a fold is undone by no restore: pin what must stay whole).",
                         param="handle")
    await _journal(state, session_id, Decision("restore", handle, source="operator"), [])
    return JSONResponse({"session_id": session_id, "restored": handle, "was": cuts[handle]})


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.ctx
    require_admin(request, state.settings)
    return state


def _identity(handle: str) -> str:
    return handle if ":" in handle else f"tool:{handle}"


def _index(ids: list[str], handle: str) -> int:
    if handle not in ids:
        raise NotFound(f"No message {handle!r} in the session's latest request.")
    return ids.index(handle)


async def _session_view(state: AppState, session_id: str
                        ) -> tuple[list[dict[str, Any]], list[str], list[str], tuple[dict[str, str], set[str]]]:
    """The session's latest messages, their identities and hashes, what its decisions cut (identity → kind) and
    what is pinned (a pinned message goes whole, cut or not)."""
    if await state.journal.call(Journal.session, session_id) is None:
        raise NotFound(f"No session {session_id!r} in the journal. `GET /ctx/sessions` lists them.")
    messages: list[dict[str, Any]] = await state.journal.call(Journal.head_messages, session_id)
    hashes = [message_hash(m) for m in messages]
    cuts: dict[str, str] = {}
    pins: set[str] = set()
    for d in await state.journal.call(Journal.decisions, session_id):
        if d["kind"] in CUTS:
            cuts[d["target"]] = d["kind"]
        elif d["kind"] == "restore":
            cuts.pop(d["target"], None)
        elif d["kind"] in ("pin", "unpin"):
            (pins.add if d["kind"] == "pin" else pins.discard)(d["target"])
    return messages, message_ids(messages, hashes), hashes, (cuts, pins)


def _tool_of(messages: list[dict[str, Any]], call_id: str) -> str:
    for message in messages:
        for call in message.get("tool_calls") or []:
            if call.get("id") == call_id:
                return str((call.get("function") or {}).get("name") or "?")
    return "?"


async def _journal(state: AppState, session_id: str, decision: Decision, bodies: list[OverflowBody]) -> None:
    """Journal the decision (and the bodies it cut) under the session's lock; the next request recomputes."""
    now = datetime.now(UTC).isoformat(timespec="milliseconds")
    await state.locks.acquire(session_id)
    try:
        await state.journal.call(Journal.add_decisions, session_id, [asdict(decision)], now, None, bodies)
        await state.contexts.changed(state.journal, session_id)
    finally:
        state.locks.release(session_id)
