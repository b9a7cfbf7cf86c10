"""The operator API behind the inspector page (``/ctx/ui``): what the model saw, what was cut, and why.

``/ctx/requests/{id}`` returns what the client sent; the endpoints here return what went upstream (the forward
rows' lists), a session's cuts with their overflow ids, its rounds as chart series (tokens the agent sent against
tokens sent upstream, the budget lines, the prefix reused, markers for every cut and context-tool call), one
request's history beside its projection, and a cut body paged and searched by lines. Incognito sessions (held in
memory) are listed too, flagged, and shown with ``?incognito=true``. Same guard as the rest of ``/ctx``.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse

from ctxproxy.proxy.core import message_hash, message_ids
from ctxproxy.proxy.edge.callers import require_admin
from ctxproxy.proxy.engine.budgets import budget_for
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.proxy.errors import BadRequest, NotFound
from ctxproxy.store import Journal, JournalWriter

__all__ = ["router"]

router = APIRouter()  # mounted at /ctx by proxy.app, beside proxy.admin's
MARKS = ("spill", "elide", "fold", "drop", "note", "hide", "pin", "unpin")
"""Decision kinds the chart marks (a pin or unpin by the operator or the model included)."""


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.ctx
    require_admin(request, state.settings)
    return state


async def _journal_of(state: AppState, session_id: str, incognito: bool) -> tuple[JournalWriter, dict[str, Any]]:
    """The journal holding the session (the disk's, or with ``incognito`` the one in memory: their ids and request
    numbers are independent, an incognito run may bear its on-disk twin's id) and its summary row."""
    writer = _writer(state, incognito)
    row: dict[str, Any] | None = await writer.call(Journal.session, session_id)
    if row is None:
        where = "incognito sessions (in memory)" if incognito else "journal"
        raise NotFound(f"No session {session_id!r} in the {where}. `GET /ctx/overview` lists them all.")
    return writer, row | {"incognito": incognito}


def _writer(state: AppState, incognito: bool) -> JournalWriter:
    return state.incognito_journal if incognito else state.journal


async def _request_journal(state: AppState, request_id: int, incognito: bool) -> tuple[JournalWriter, dict[str, Any]]:
    writer = _writer(state, incognito)
    row: dict[str, Any] | None = await writer.call(Journal.request, request_id)
    if row is None:
        raise NotFound(f"No request {request_id} in the {'incognito journal' if incognito else 'journal'}. "
                       "`GET /ctx/sessions/{id}/rounds` lists a session's.")
    return writer, row


@router.get("/overview")
async def overview(request: Request) -> JSONResponse:
    """Every session (incognito ones flagged) with its forks and, for its latest request, the tokens the agent
    sent against the tokens that went upstream and the share of the upstream list reused from the request before."""
    state = _state(request)
    out: list[dict[str, Any]] = []
    for writer in (state.journal, state.incognito_journal):
        children = await writer.call(Journal.session_children)
        for row in await writer.call(Journal.sessions):
            latest = await _latest(state, writer, row["id"])
            out.append(row | latest | {"children": children.get(row["id"], []),
                                       "incognito": writer is state.incognito_journal})
    out.sort(key=lambda r: r["updated_at"], reverse=True)
    return JSONResponse({"sessions": out})


async def _latest(state: AppState, writer: JournalWriter, session_id: str) -> dict[str, Any]:
    rounds = await writer.call(Journal.session_rounds, session_id, 2)
    series = await _series(state, writer, rounds)
    if not series:
        return {"agent_tokens": None, "upstream_tokens": None, "reuse": None}
    last = series[-1]
    reuse = round(last["reused_messages"] / last["sent_messages"], 3) if last["sent_messages"] else None
    return {"agent_tokens": last["agent_tokens"], "upstream_tokens": last["upstream_tokens"], "reuse": reuse}


@router.get("/requests/{request_id}/upstream")
async def upstream_body(request: Request, request_id: int, attempt: int | None = None, incognito: bool = False
                        ) -> JSONResponse:
    """What the model saw: the body forwarded upstream for ``attempt`` (the last by default), with the estimate
    and calibration ratio it was sent under. A request answered by the proxy alone has none (404)."""
    state = _state(request)
    writer, _ = await _request_journal(state, request_id, incognito)
    row = await writer.call(Journal.forward, request_id, attempt)
    if row is None:
        which = f"attempt {attempt} of request {request_id}" if attempt is not None else f"request {request_id}"
        raise NotFound(f"Nothing went upstream for {which} (refused, or answered by the proxy itself).")
    row.pop("hashes")
    return JSONResponse(row)


@router.get("/sessions/{session_id}/cuts")
async def session_cuts(request: Request, session_id: str, incognito: bool = False) -> JSONResponse:
    """The session's decisions in order: what was cut (spill, elide, fold, drop, note, hide), pinned or unpinned,
    by whom (auto, operator, model), in which request, and the overflow id under which the cut body is kept."""
    state = _state(request)
    writer, _ = await _journal_of(state, session_id, incognito)
    return JSONResponse({"session_id": session_id, "cuts": await writer.call(Journal.session_cuts, session_id)})


@router.get("/sessions/{session_id}/rounds")
async def session_rounds(request: Request, session_id: str, incognito: bool = False) -> JSONResponse:
    """The session request by request, as the inspector's chart draws it, with its cuts, context-tool calls and
    the budget lines of its model's window."""
    state = _state(request)
    writer, session = await _journal_of(state, session_id, incognito)
    rows = await writer.call(Journal.session_rounds, session_id)
    cuts = await writer.call(Journal.session_cuts, session_id)
    ops = await writer.call(Journal.session_ops, session_id)
    series = await _series(state, writer, rows)
    _mark(series, cuts, ops)
    return JSONResponse({"session": session, "lines": await _lines(state, session.get("model")),
                         "rounds": series, "cuts": cuts, "ops": ops})


async def _lines(state: AppState, model: str | None) -> dict[str, Any]:
    """The budget, target and window in force for the model now (settings, or the window the upstream told)."""
    settings = state.settings.for_model(model)
    window = settings.ctx_window or (await state.windows.window_for(model)).tokens
    window = min(window, state.contexts.window_limits.get(model, window))
    budget = budget_for(settings, window)
    return {"window": budget.window, "budget": budget.budget, "target": budget.target}


async def _series(state: AppState, writer: JournalWriter, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per request: tokens of the client's messages and of the forwarded ones (counted alike, × the ratio in
    force), the estimate the projection budgeted (tool schemas included), the model's own count, and the prefix of
    the forwarded list shared with the previous forward."""
    unique = {h for r in rows for h in r["hashes"] + (r["sent_hashes"] or [])}
    counts = {h: c for h in unique if (c := state.counter.cached(h)) is not None}
    missing = [h for h in unique if h not in counts]  # read and counted once, then cached like the proxy's own
    bodies = await writer.call(Journal.blobs, missing)
    counts |= {h: state.counter.count(b, h) for h, b in zip(missing, bodies, strict=True)}
    out: list[dict[str, Any]] = []
    before: list[str] = []
    tokens = counts.__getitem__
    for row in rows:
        k = row["k"] or 1.0
        sent = row["sent_hashes"] or []
        reused = _common(before, sent)
        out.append({"request_id": row["request_id"], "received_at": row["received_at"], "k": row["k"],
                    "agent_tokens": round(sum(map(tokens, row["hashes"])) * k),
                    "upstream_tokens": round(sum(map(tokens, sent)) * k) if sent else None,
                    "estimate": round(row["estimate"] * k) if row["estimate"] is not None else None,
                    "prompt_tokens": row["prompt_tokens"], "completion_tokens": row["completion_tokens"],
                    "reused_tokens": round(sum(map(tokens, sent[:reused])) * k), "reused_messages": reused,
                    "messages": len(row["hashes"]), "sent_messages": len(sent), "verbatim": row["verbatim"],
                    "outcome": row["outcome"], "status": row["status"], "attempts": row["attempts"],
                    "total_ms": row["total_ms"], "marks": {}, "ops": []})
        before = sent or before
    return out


def _common(a: list[str], b: list[str]) -> int:
    """The length of the common prefix, found by bisection on slice equality (compared in C, not per item)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _mark(series: list[dict[str, Any]], cuts: list[dict[str, Any]], ops: list[dict[str, Any]]) -> None:
    """Each request's markers: the decisions its projection (or an operator before it) made, its context ops."""
    by_id = {r["request_id"]: r for r in series}
    kinds: dict[int, Counter[str]] = {}
    for cut in cuts:
        target = cut["request_id"] or _next_request(series, cut["created_at"])
        if target is not None and target in by_id and cut["kind"] in MARKS:
            kinds.setdefault(target, Counter())[cut["kind"]] += 1
    for op in ops:
        if op["request_id"] in by_id:
            by_id[op["request_id"]]["ops"].append(op["op"])
            if op["op"] == "commit" and op["ok"] and op["handles"]:
                kinds.setdefault(op["request_id"], Counter())["mirror"] += 1
    for request_id, counted in kinds.items():
        by_id[request_id]["marks"] = dict(counted)


def _next_request(series: list[dict[str, Any]], created_at: str) -> int | None:
    """An operator's decision has no request: it shows on the first request after it."""
    return next((r["request_id"] for r in series if r["received_at"] >= created_at), None)


@router.get("/requests/{request_id}/projection")
async def projection(request: Request, request_id: int, attempt: int | None = None, incognito: bool = False
                     ) -> JSONResponse:
    """One request's history as the client sent it (each message with its identity, the handle pins and the
    decisions name) beside the messages that went upstream, and the session's cuts and pins up to it."""
    state = _state(request)
    writer, row = await _request_journal(state, request_id, incognito)
    forward = await writer.call(Journal.forward, request_id, attempt)
    messages = row["messages"]
    ids = message_ids(messages, [message_hash(m) for m in messages])
    cuts = [c for c in await writer.call(Journal.session_cuts, row["session_id"])
            if c["request_id"] is None or c["request_id"] <= request_id]
    pins: set[str] = set()
    for cut in cuts:
        if cut["kind"] in ("pin", "unpin"):
            (pins.add if cut["kind"] == "pin" else pins.discard)(cut["target"])
    return JSONResponse({"request_id": request_id, "session_id": row["session_id"],
                         "raw": [{"id": i, "message": m} for i, m in zip(ids, messages, strict=True)],
                         "sent": forward["body"]["messages"] if forward else None,
                         "attempt": forward["attempt"] if forward else None,
                         "pins": sorted(pins), "cuts": [c for c in cuts if c["kind"] not in ("pin", "unpin")]})


@router.get("/sessions/{session_id}/overflow/{overflow_id}/lines")
async def overflow_lines(request: Request, session_id: str, overflow_id: str, offset: int = 0, limit: int = 200,
                         grep: str = "", incognito: bool = False) -> JSONResponse:
    """A cut body by lines: ``limit`` lines from line ``offset`` (0-based), or with ``grep`` only the lines that
    contain it (a regular expression, case-insensitive), each with its line number."""
    state = _state(request)
    writer, _ = await _journal_of(state, session_id, incognito)
    row = await writer.call(Journal.overflow_body, overflow_id, session_id)
    if row is None:
        raise NotFound(f"No overflow body {overflow_id!r} for session {session_id!r}. "
                       f"`GET /ctx/sessions/{session_id}/cuts` lists the session's.")
    lines = list(enumerate(row["body"].splitlines()))
    if grep:
        try:
            pattern = re.compile(grep, re.IGNORECASE)
        except re.error as exc:
            raise BadRequest(f"grep: {exc}. Give a regular expression (or plain text without ()[]*+?).",
                             param="grep") from None
        lines = [(n, text) for n, text in lines if pattern.search(text)]
    offset, limit = max(offset, 0), min(max(limit, 1), 2000)
    return JSONResponse({"id": overflow_id, "tool": row["tool"], "call_id": row["call_id"], "bytes": row["bytes"],
                         "total": len(lines), "offset": offset, "lines": lines[offset:offset + limit]})
