"""``POST /v1/messages/count_tokens``, answered from the projection: what the model will see, not what was sent.

An agent that compacts its own history (Claude Code does, near what it believes is its window) asks how large
its request is. The answer is the proxy's projection of that request under the model's budget, with the
session's decisions applied (the results its model dropped, the cuts made so far) and the model's calibrated
ratio, in the upstream's tokens: so the agent's own compaction sees what the model will see, and does not
compact a history the proxy already keeps inside the window. Nothing is journaled or forwarded.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from proxy.budgets import budget_for
from proxy.callers import requested_session
from proxy.edge import read_body
from proxy.errors import CtxError
from proxy.fronts.anthropic.front import SESSION_HEADER, AnthropicFront
from proxy.hashing import MessageHasher
from proxy.rewrite import project
from proxy.rewrite.decisions import Decision
from proxy.rewrite.state import Rules
from proxy.rewrite.tokens import Calibration
from proxy.state import AppState
from store import Journal

__all__ = ["count_tokens", "projected_tokens"]


async def count_tokens(request: Request) -> Response:
    state: AppState = request.app.state.ctx
    front = AnthropicFront()
    try:
        raw = await read_body(request, state.settings.max_body_bytes, state.settings.client_body_timeout)
        decoded = await front.decode(raw, request)
        session = requested_session(request, state.settings) or request.headers.get(SESSION_HEADER)
        return JSONResponse({"input_tokens": await projected_tokens(state, decoded.body, session)})
    except CtxError as exc:
        return front.error(exc)


async def projected_tokens(state: AppState, body: dict[str, Any], session: str | None) -> int:
    """The request's projected size in the upstream's tokens (its estimate × the model's calibrated ratio)."""
    model = body.get("model")
    settings = state.settings.for_model(model)
    window = settings.ctx_window or (await state.windows.window_for(model)).tokens
    window = min(window, state.contexts.window_limits.get(model, window))
    messages = body["messages"]
    hashes = MessageHasher().hash("count", messages).hashes  # its own hasher: the sessions' caches stay as they are
    rows = await state.journal.call(Journal.decisions, session) if session else []
    k = state.contexts.models.get(model, Calibration()).k
    rules = Rules(budget_for(settings, window), k, "count", state.counter.count_tools(body.get("tools")))
    return project(messages, hashes, [Decision(**row) for row in rows], rules, state.counter).report.scaled
