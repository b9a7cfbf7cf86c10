"""From a journaled request to the bytes that go upstream: window, budget, projection, invariants, journal.

This is where the pure core meets I/O. ``plan_forward`` resolves the model's settings and window, projects the
messages with the session's decisions and calibration, checks the invariants, journals the new decisions, the cut
bodies and the projected list (one transaction, before anything is forwarded), then updates the session's
working context. A request that cannot fit even after every cut raises ``ContextTooLarge``, which says what
takes the room.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import Any, cast

import orjson

from proxy.context import SessionContext
from proxy.errors import ContextTooLarge
from proxy.rewrite import Projection, Report, Rules, budget_for, canonical_json, project, violations
from proxy.state import AppState
from proxy.wire import ChatBody
from store import ForwardRecord, IncomingRequest, Journal, JournalWriter, OverflowBody, RecordedRequest

__all__ = ["Plan", "plan_forward"]

log = logging.getLogger("ctxproxy")
INCOGNITO_STORAGE = "memory-only (incognito)"


@dataclass(frozen=True)
class Plan:
    body: bytes
    estimate: int
    k: float
    projection: Projection


async def plan_forward(app: AppState, writer: JournalWriter, ctx: SessionContext, recorded: RecordedRequest,
                       body: ChatBody, raw: bytes, incoming: IncomingRequest, attempt: int,
                       incognito: bool) -> Plan:
    model = body.get("model")
    settings = app.settings.for_model(model)
    window = settings.ctx_window or (await app.windows.window_for(model)).tokens
    k = ctx.calibration(model).k
    rules = Rules(budget_for(settings, window), k, INCOGNITO_STORAGE if incognito else "disk",
                  app.counter.count_tools(body.get("tools")))
    messages = cast(list[dict[str, Any]], body["messages"])
    previous, ctx.state = ctx.state, None  # consumed by project(); only a journaled projection gives it back
    p = project(messages, incoming.hashes, ctx.decisions, rules, app.counter, previous)
    if p.report.over_budget:
        raise ContextTooLarge(describe_overflow(p.report, messages, p.state.ids))
    broken = _broken(messages, p)
    if broken:
        p = replace(p, messages=list(messages), hashes=list(incoming.hashes), new=(), writes=(),
                    changed=False)
    list_id = await writer.call(Journal.record_forward, _forward_record(recorded, incoming, ctx, p, attempt, k))
    ctx.decisions += p.new
    ctx.state = None if broken else p.state
    ctx.sent_list = (list_id, p.hashes)
    out = raw if not p.changed else orjson.dumps({**body, "messages": p.messages})
    return Plan(out, p.report.estimate, k, p)


def _broken(messages: list[Any], p: Projection) -> bool:
    """Check the invariants; a violation is our bug: log it and forward the agent's request as it came."""
    steady = p.report.reused > 0 and not (p.report.elided or p.report.folded)
    pinned = {i for i, mid in enumerate(p.state.ids) if mid in p.state.pins} if p.state.pins else set()
    problems = violations(messages, p.messages, pinned, start=p.report.reused if steady else 0, pairs=not steady)
    if problems:
        log.error("projection broke its invariants, forwarding the request unchanged: %s", "; ".join(problems))
    return bool(problems)


def _forward_record(recorded: RecordedRequest, incoming: IncomingRequest, ctx: SessionContext, p: Projection,
                    attempt: int, k: float) -> ForwardRecord:
    record = ForwardRecord(recorded.request_id, attempt, recorded.session_id, _now(), incoming.params_hash,
                           verbatim=not p.changed, estimate=p.report.estimate, k=k,
                           decisions=[asdict(d) for d in p.new],
                           overflow=[OverflowBody(w.overflow_id, w.body, w.tool, w.call_id) for w in p.writes])
    if not p.changed:
        return record
    base_id, base = ctx.sent_list or (recorded.list_id, list(incoming.hashes))
    same = next((i for i, (a, b) in enumerate(zip(base, p.hashes, strict=False)) if a != b),
                min(len(base), len(p.hashes)))
    return replace(record, length=len(p.hashes), base_list_id=base_id, base_len=same, added_hashes=p.hashes[same:],
                   added_bodies=[canonical_json(m) for m in p.messages[same:]])


def describe_overflow(report: Report, messages: list[Any], ids: list[str]) -> str:
    """Why a request cannot fit: the numbers, and the biggest items still in it."""
    where = {mid: i for i, mid in enumerate(ids)}
    items = []
    for mid, tokens in report.largest:
        if mid == "tools":
            items.append(f"the tool definitions ({tokens} tokens)")
            continue
        i = where.get(mid, -1)
        role = messages[i].get("role", "?") if i >= 0 else "?"
        items.append(f"message {i} ({role}, {mid}: {tokens} tokens)")
    return (f"This conversation does not fit the context budget even after ctxproxy cut everything it may: about "
            f"{report.scaled} tokens against a budget of {report.budget} (window {report.window}). What takes the "
            f"room: {'; '.join(items)}. System messages, the person's messages, pinned items and the newest result "
            "are never cut. Raise ctx_window or context_budget, lower context_reserve, or start a new session.")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
