"""``POST /v1/messages/count_tokens``, answered from the projection: what the model will see, not what was sent.

An agent that compacts its own history (Claude Code does, near what it believes is its window) asks how large
its request is. The answer is the proxy's projection of that request under the model's budget, with the
session's decisions applied (the results its model dropped, the cuts made so far) and the model's calibrated
ratio, in the upstream's tokens: so the agent's own compaction sees what the model will see, and does not
compact a history the proxy already keeps inside the window. Nothing is journaled or forwarded.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ctxproxy.proxy.edge.body import read_body
from ctxproxy.proxy.edge.fronts.anthropic.front import AnthropicFront, claude_code_session
from ctxproxy.proxy.edge.fronts.projected import projected_tokens, session_of
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.proxy.errors import CtxError

__all__ = ["count_tokens"]


async def count_tokens(request: Request) -> Response:
    state: AppState = request.app.state.ctx
    front = AnthropicFront()
    try:
        raw = await read_body(request, state.settings.max_body_bytes, state.settings.client_body_timeout)
        decoded = await front.decode(raw, request)
        session = session_of(request, state.settings, claude_code_session(request, decoded.body))
        return JSONResponse({"input_tokens": await projected_tokens(state, decoded.body, session)})
    except CtxError as exc:
        return front.error(exc)
