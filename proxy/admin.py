"""The operator surface under ``/ctx/``: sessions, a session's summary and its journal.

On loopback it is open, like the proxy itself. Bound anywhere else the server refuses to start without an admin
token (``config.settings``), and every ``/ctx/*`` request must carry ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse

from proxy.errors import NotFound, Unauthorized
from proxy.state import AppState
from store import Journal

__all__ = ["router"]

router = APIRouter()  # mounted at /ctx by proxy.app


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.ctx
    token = state.settings.admin_token
    if token is not None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise Unauthorized("/ctx/* needs `Authorization: Bearer <CTXPROXY_ADMIN_TOKEN>`.")
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
