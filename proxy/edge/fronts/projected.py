"""The size of a decoded request as the model will see it: the projection's estimate, without forwarding anything.

For fronts whose protocol asks it (Anthropic's ``count_tokens``) or needs it where the upstream said nothing (a
chat server that sends no usage in its streams, like llama-cpp-python, while an Anthropic client reads its
context from ``usage``): the request is projected under the model's budget with the session's decisions applied
(what its model dropped, the cuts made so far) and scaled by the model's calibrated ratio, in upstream tokens.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from ctxproxy.config import Settings
from ctxproxy.proxy.core.decisions import Decision
from ctxproxy.proxy.core.project import project
from ctxproxy.proxy.core.state import Rules
from ctxproxy.proxy.core.tokens import Calibration
from ctxproxy.proxy.edge.callers import credential_tag, requested_session
from ctxproxy.proxy.engine.budgets import budget_for
from ctxproxy.proxy.engine.hashing import MessageHasher
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.store import Journal

__all__ = ["projected_tokens", "session_of"]


def session_of(request: Request, settings: Settings, named: str | None) -> str | None:
    """The session a front's request belongs to: the one its ``session_header`` names, else the protocol's own
    key (``named``), namespaced as the chat edge does under ``session_scope = "credential"``."""
    chosen = requested_session(request, settings)
    if chosen is not None or named is None:
        return chosen
    return f"{named}@{credential_tag(request.headers.raw)}" if settings.session_scope == "credential" else named


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
