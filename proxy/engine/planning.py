"""From a journaled request to the bytes that go upstream: window, budget, projection, invariants, journal.

This is where the pure core meets I/O. ``plan_forward`` resolves the model's settings and window, projects the
messages with the session's decisions and calibration and checks the invariants. What the projection decided (the
new decisions, the cut bodies, the projected list: one transaction) is journaled while the request is upstream,
before its answer goes back; then the session's working context moves on (``_journaled``). A request that cannot
fit even after every cut raises ``ContextTooLarge``, which says what takes the room (``proxy.engine.refusals``).
Everything between the awaits is one synchronous step (``_shape``), so that for a large request it runs on a
worker thread as a whole (``proxy.engine.heavy``) while the event loop serves the other clients.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import orjson

from ctxproxy.config import Settings
from ctxproxy.proxy.core import (
    Decision,
    Projection,
    Rules,
    State,
    canonical_json,
    violations,
    violations_since,
)
from ctxproxy.proxy.core.fenced import presets_for, route_of
from ctxproxy.proxy.core.pieces import Pieces
from ctxproxy.proxy.core.project import project
from ctxproxy.proxy.core.tokens import MessageCounter
from ctxproxy.proxy.engine.context import ParentState, SessionContext
from ctxproxy.proxy.engine.decided import decision_rows
from ctxproxy.proxy.engine.exchange import Tallying, now
from ctxproxy.proxy.engine.hashing import common_start
from ctxproxy.proxy.engine.heavy import is_large
from ctxproxy.proxy.engine.mirror_file import MirrorWrite, keep_unsent, mirror_due
from ctxproxy.proxy.engine.outfiles import outfiles_dir, write_outfiles
from ctxproxy.proxy.engine.policy import (
    assemble,
    confirmation_notice,
    guidance,
    listed_tools,
    offer_due,
    reminder_due,
    reminder_notice,
    restorable,
)
from ctxproxy.proxy.engine.refusals import describe_overflow
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.proxy.engine.tally import Taken, Tally, counting, taken
from ctxproxy.proxy.errors import ContextTooLarge
from ctxproxy.proxy.tools.offer import person_asked, turn_in
from ctxproxy.proxy.wire import ChatBody
from ctxproxy.store import ForwardRecord, IncomingRequest, JournalWriter, OverflowBody, RecordedRequest

__all__ = ["Ask", "Plan", "plan_forward"]

log = logging.getLogger("ctxproxy")
INCOGNITO_STORAGE = "memory-only (incognito)"


@dataclass(frozen=True)
class Plan:
    body: bytes
    estimate: int
    k: float
    projection: Projection
    rules: Rules
    offered: bool
    """The context tools are in this request's tool list."""
    tally: Tallying
    """Tokens the agent sent, tokens going upstream, what the new cuts freed (``proxy.engine.tally``), counted when
    called, once the answer has left (``_tallied``)."""
    cuts: dict[str, int]
    """This forward's new decisions, by kind."""
    deferred: ForwardRecord | None
    """The forward row, when it is to be journaled with its answer."""
    journal: Callable[[], Awaitable[None]] | None
    """What is left to do once the request is upstream, done before the answer goes back (``_journaled``); None
    when it was done already (a forward journaled with its answer, no mirror to write)."""


async def plan_forward(app: AppState, writer: JournalWriter, ctx: SessionContext, ask: Ask) -> Plan:
    """Project the request and journal the forward. The projection of a large request runs on the worker
    (``proxy.engine.heavy``)."""
    recorded, incoming = ask.recorded, ask.incoming
    model = ask.body.get("model")
    settings = app.settings.for_model(model)
    window = settings.ctx_window or (await app.windows.window_for(model)).tokens
    window = min(window, app.contexts.window_limits.get(model, window))
    start: State | ParentState | None = ctx.state or app.contexts.fork_start(
        writer, ctx, recorded, cast(list[dict[str, Any]], ask.body["messages"]), incoming.hashes
    ) or app.contexts.absorbed(writer, ctx)
    ctx.state = None  # consumed by project(); only a journaled projection gives it back
    large = is_large(incoming.body_bytes, len(incoming.hashes))
    shaped = await app.offload.run(large, _shape, app, settings, ctx, ask, window, start)
    p = shaped.projection
    # Nothing of it is new: the request's own row and the stored decisions already say what goes upstream (its
    # messages as they came; a tool list differs only by what the rules list). The forward row is journaled with
    # its answer, off the request's path: a replay after a crash sends the same bytes without it.
    deferred = shaped.record() if shaped.as_came and not p.new and not p.writes else None
    tallied = functools.partial(_tallied, app, ctx, shaped.taken, cast(list[dict[str, Any]], ask.body["messages"]),
                                incoming.hashes, shaped.estimate, shaped.budgeted)
    journal = functools.partial(_journaled, app, writer, ctx, ask, shaped, large, deferred is not None)
    done_here = deferred is not None and shaped.mirror is None  # at most the working state: not worth a task
    if done_here:
        await journal()
    return Plan(shaped.body, shaped.estimate, shaped.rules.k, p, shaped.rules, shaped.offered, tallied,
                shaped.taken.cuts, deferred, None if done_here else journal)


async def _journaled(app: AppState, writer: JournalWriter, ctx: SessionContext, ask: Ask, shaped: _Shaped,
                     large: bool, deferred: bool) -> None:
    """The forward journaled (its decisions, cut bodies and list; the working state its request left), the cut
    bodies' files written, the session's working context moved on, then the mirror's file: what the forwarder
    runs while the request is upstream and waits for before any byte of the answer goes back (``Plan.journal``).

    The request itself was journaled before (``Journal.record_request``); what is journaled here is what the
    projection decided, which the agent sees only through the answer. A crash before it is done loses an answer
    the client never had, as a crash before the forward would: the retry is projected again from the journal.
    Journaled before the forward went, a fold pass at 128k waited ~1.5 ms for it that the upstream's own time
    now hides (issue #13). A journal that refuses (a full disk) fails the request, as before; the upstream's
    answer is dropped and the mirror left for the next request."""
    recorded, p = ask.recorded, shaped.projection
    if deferred:
        list_id = recorded.list_id
        await ctx.journal_state(writer, recorded.session_id, recorded.request_id)
    else:
        record = await app.offload.run(large, shaped.record)
        list_id = await ctx.journal_forward(writer, record, recorded.session_id, recorded.request_id)
        await write_outfiles(shaped.rules.overflow_dir, _outfile_bodies(shaped.rules, p, ask.incoming.bodies))
    ctx.decisions += p.new
    app.metrics.decided([d.kind for d in p.new], {})  # what they freed: once the tally is counted
    ctx.state, ctx.ingest = p.state, _ingest_key(shaped.rules)
    ctx.sent_list = (list_id, shaped.hashes)
    if shaped.mirror is not None:
        await app.offload.run(large, shaped.mirror)
        if not ctx.mirror_written:  # not written after all: journaled as shown, a restart took the proxy's own
            await ctx.journal_state(writer, recorded.session_id, recorded.request_id)  # older file for a draft


def _tallied(app: AppState, ctx: SessionContext, t: Taken, messages: list[dict[str, Any]], hashes: Sequence[str],
             sent: int, budgeted: int) -> Tally:
    """The forward's tally, called by the request's log line (``Exchange``), once the answer has left: at once, the
    originals the counter never tokenised estimated (``proxy.engine.tally``). The metrics count what the new cuts
    freed."""
    count = ctx.tallied = counting(t, messages, hashes, app.counter, sent, budgeted, ctx.tallied).known(app.counter)
    known = count.finish(app.counter)
    app.metrics.decided((), known.freed)
    return known


def _outfile_bodies(rules: Rules, p: Projection, bodies: Sequence[bytes]) -> list[tuple[str, str]]:
    """The cut bodies to write as ``<id>.out`` (none unless ``overflow_dir`` is set); a fold's is assembled from the
    request's canonical message bodies, the bytes the journal rebuilds it from."""
    if not rules.overflow_dir:
        return []
    return [(w.overflow_id, w.body if w.span is None or w.part == "content" else
             (b"[" + b",".join(bodies[w.span[0]:w.span[1]]) + b"]").decode()) for w in p.writes]


@dataclass(frozen=True)
class Ask:
    """One attempt of one request, as the forwarder asks ``plan_forward`` to plan it. ``splice``: this request's
    context-tool exchanges so far, sent after the projection in the proxy's own follow-up rounds; ``offer=False``:
    the last round, without the context tools; ``compact``: what the agent's own compaction prompt asked."""

    body: ChatBody
    raw: bytes | Pieces
    """The body as it came (``proxy.core.pieces``): joined only if it goes upstream unchanged."""
    incoming: IncomingRequest
    recorded: RecordedRequest
    attempt: int
    incognito: bool
    splice: list[dict[str, Any]]
    offer: bool
    compact: str | None


@dataclass(frozen=True)
class _Shaped:
    """What goes upstream, and the forward row that says so (not journaled yet)."""

    projection: Projection
    rules: Rules
    offered: bool
    estimate: int
    hashes: list[str]
    record: Callable[[], ForwardRecord]
    """The forward row, built when it is journaled: once the request is upstream (``_journaled``)."""
    as_came: bool
    """The messages go upstream as they came (the tool list aside): ``verbatim`` or ``own_list``."""
    body: bytes
    taken: Taken
    """What the tally reads of the projection, copied: it is counted once the answer has left."""
    budgeted: int
    mirror: MirrorWrite | None


def _shape(app: AppState, settings: Settings, ctx: SessionContext, ask: Ask, window: int,
           start: State | ParentState | None) -> _Shaped:
    """The outgoing request: rules, projection, notices, tools, bytes. No await: its cost grows with the request,
    so a large one's runs on the worker, under the session's lock (it updates the session's working context).
    ``start``: the session's state, or a fork's parent's cut to their shared messages (used only under the same
    ingestion rules), or None (projected from the decisions)."""
    body, messages = ask.body, cast(list[dict[str, Any]], ask.body["messages"])
    rules = _rules(app, settings, ctx, ask, window)
    previous = start.state if isinstance(start, ParentState) and start.ingest == _ingest_key(rules) else (
        start if isinstance(start, State) else None)
    may_offer = _schemas_may_go(settings, body, bool(rules.fenced))
    p = _checked_projection(messages, ask.incoming.hashes, ctx.decisions, rules, app.counter, previous,
                            ask.recorded.seen)
    reach = _tools_reach(settings, body, rules)  # the mirror, too, is edited only through ``ctx commit``
    mirror, write = (None, None) if ask.incognito or ask.splice or not reach else mirror_due(
        ctx, settings, ask.recorded.session_id, p)
    offered = ask.offer and reach and _full_set_fits(app, rules.budget.budget) and (
        _offered(ctx, settings, body, messages, p, rules) or ask.compact is not None or ctx.mirror is not None)
    notices = [] if ask.splice else _notices(ctx, settings, p, rules, offered)  # follow-ups carry tool results
    cut_before = settings.tools_enabled and restorable(ctx.decisions, p.new)
    after = guidance(bool(rules.fenced), offered, cut_before, ask.compact if offered else None, mirror) + notices \
        + ask.splice  # no tools, no call to use them
    listed = listed_tools(offered, cut_before, may_offer)
    payload = assemble(dict(body), p.messages, p.hashes, p.changed, after, listed, bool(rules.fenced),
                       settings.null_content == "empty")
    sent, hashes, changed = payload.sent, payload.hashes, payload.changed
    keep_unsent(ctx, p, hashes)
    budgeted = _context_tools_cost(app, settings, body, bool(rules.fenced), rules.budget.budget)
    estimate = p.report.estimate - (budgeted - (app.read_tool_tokens() if listed else 0)
                                    if may_offer and not offered else 0)
    own_list = changed and hashes == list(ask.incoming.hashes)  # the messages as they came: only the tools differ
    record = functools.partial(_forward_record, ask.recorded, ask.incoming, ctx, p, ask.attempt, rules.k, sent,
                               hashes, changed, own_list, None if ask.splice else estimate)  # a splice's: not in it
    out = _upstream_bytes(app, ask, payload.body, not changed, own_list)
    return _Shaped(p, rules, offered, estimate, hashes, record, not changed or own_list, out, taken(p), budgeted,
                   write)


def _upstream_bytes(app: AppState, ask: Ask, body: dict[str, Any], verbatim: bool, own_list: bool) -> bytes:
    """The body as it came if nothing changed. If only fields beside the messages did (the context tools listed),
    the messages' bytes as they came, not serialised again (0.30 → 0.065 ms for 630 KB of messages)."""
    if verbatim:
        return bytes(ask.raw)
    as_came = app.hasher.prefixes.messages_as_came(ask.raw, ask.body) if own_list else None
    return orjson.dumps(body if as_came is None else {**body, "messages": orjson.Fragment(as_came)})


def _ingest_key(rules: Rules) -> tuple[Any, ...]:
    """What ingesting a message depends on besides the decisions: which user messages hold text-protocol results
    or a paste (``proxy.core.project._results_of``)."""
    return rules.fenced, rules.budget.paste_chars


def _rules(app: AppState, settings: Settings, ctx: SessionContext, ask: Ask, window: int) -> Rules:
    """The budget, calibration, storage, tools' cost and text-protocol presets this attempt is projected under.
    What the context tools cost is budgeted whenever they may be offered: the budget must hold the moment they
    are, and the cuts must not shift when they start to be."""
    body = ask.body
    presets = presets_for(settings.fenced_presets)
    messages = cast(list[dict[str, Any]], body["messages"])
    fenced = presets if route_of(messages, body.get("tools"), settings.route, presets) == "fenced" else ()
    budget = app.budget(body.get("model"), window)  # ``settings`` is the model's: the same budget, kept
    tools = app.counter.count_tools(body.get("tools")) + _context_tools_cost(app, settings, body, bool(fenced),
                                                                             budget.budget)
    k = ctx.calibration(body.get("model")).k
    return Rules(budget, k, INCOGNITO_STORAGE if ask.incognito else "disk", tools, fenced,
                 outfiles_dir(settings, ask.incognito))


def _schemas_may_go(settings: Settings, body: ChatBody, fenced: bool) -> bool:
    """Whether the context tools' schemas may join the tool list: on the native route only. A fenced route is told
    the block syntax in a note instead, and is never sent the schemas."""
    return settings.tools_enabled and not fenced and bool(body.get("tools") or settings.native_tools)


def _context_tools_cost(app: AppState, settings: Settings, body: ChatBody, fenced: bool, budget: int) -> int:
    """What the context tools may add to a request: their schemas on the native route (``read_overflow``'s alone
    where the full set would not fit, ``_full_set_fits``), the note with the block syntax on the fenced one (151
    tokens where the schemas are 735: at 4k, budgeting the schemas on a fenced route refused 66 requests of the
    recorded runs instead of 15)."""
    if _schemas_may_go(settings, body, fenced):
        return app.context_tools_tokens() if _full_set_fits(app, budget) else app.read_tool_tokens()
    return app.fenced_note_tokens() if fenced and settings.tools_enabled else 0


def _full_set_fits(app: AppState, budget: int) -> bool:
    """Whether the whole set of context tools may be offered: its schemas (735 tokens) take at most a fifth of the
    budget. Below that (a window of about 5k), budgeting them refused 226 of the 319 recorded native requests at
    4k where the core alone refused 126; ``read_overflow`` is still listed once a stub exists, so every cut stays
    restorable."""
    return app.context_tools_tokens() * 5 <= budget


def _tools_reach(settings: Settings, body: ChatBody, rules: Rules) -> bool:
    """Whether the context tools can reach this model at all: enabled, and a route that carries them (the request's
    own tool list, an upstream that handles function calling (``native_tools``), or the fenced note). A ``/compact``
    or a live mirror offers them only where the rule could: sent to an upstream without function calling, the
    schemas would be refused, and they were not budgeted (``_context_tools_cost``); a mirror would ask for a commit
    the model has no tool for."""
    return settings.tools_enabled and bool(body.get("tools") or settings.native_tools or rules.fenced)


def _offered(ctx: SessionContext, settings: Settings, body: ChatBody, messages: list[dict[str, Any]],
             p: Projection, rules: Rules) -> bool:
    """The offer rule, where the tools reach the model (``_tools_reach``); an offer holds for the rest of the turn
    (``ctx.offered_turn``)."""
    turn = turn_in(messages, p.state)
    key = p.state.ids[turn.start] if p.state.ids else ""
    usage = p.report.scaled / rules.budget.budget  # after cuts the window is never reached: judge by the budget
    if offer_due(ctx.offered_turn == key, usage, settings.offer_pct,
                 person_asked(messages, turn, settings.offer_phrases), turn.round, settings.offer_round):
        ctx.offered_turn = key
        return True
    return False


def _notices(ctx: SessionContext, settings: Settings, p: Projection, rules: Rules,
             offered: bool) -> list[dict[str, Any]]:
    """System lines for the model: what its context tools did since its last request; the soft-ceiling reminder."""
    out = []
    if ctx.confirmations:
        out.append(confirmation_notice(ctx.confirmations))
        ctx.confirmations = []
    if reminder_due(offered, p.report.scaled, settings.soft_ceiling_pct, rules.budget.budget, ctx.reminded_turn,
                    ctx.offered_turn):
        ctx.reminded_turn = ctx.offered_turn
        out.append(reminder_notice())
    return out


def _checked_projection(messages: list[dict[str, Any]], hashes: Sequence[str], decisions: Sequence[Decision],
                        rules: Rules, counter: MessageCounter, previous: State | None, seen: int) -> Projection:
    """The projection, refused if it cannot fit, the request as it came if it broke an invariant. Pure and sized by
    the request: a large one's runs on the worker (``proxy.engine.heavy``), under the session's lock."""
    p = project(messages, hashes, decisions, rules, counter, previous, seen)
    if p.report.over_budget:
        raise ContextTooLarge(describe_overflow(p, messages, rules))
    if _broken(messages, p):
        p = replace(p, messages=list(messages), hashes=list(hashes), new=(), writes=(), changed=False)
        p.state.absorbed = -1  # never resumed: the next request recomputes from the decisions
    return p


def _broken(messages: list[Any], p: Projection) -> bool:
    """Check the invariants; a violation is our bug: log it and forward the agent's request as it came."""
    state = p.state
    pinned = {i for i, mid in enumerate(state.ids) if mid in state.pins} if state.pins else set()
    fenced = {i: r.segments for i, r in state.fenced.items()}
    if p.report.reused and not state.hidden:  # it extends the session's last projection, checked then
        run = state.fold_sum
        pairs = run.pairs if run is not None and (run.start, run.end) == state.folded else None
        problems = violations_since(messages, p.messages, p.report.reused, state.touched, state.folded,
                                    bool(p.report.folded), pinned, fenced, pairs)
    else:
        problems = violations(messages, p.messages, pinned, fenced=fenced, hidden=frozenset(state.hidden))
    if problems:
        log.error("projection broke its invariants, forwarding the request unchanged: %s", "; ".join(problems))
    return bool(problems)


def _forward_record(recorded: RecordedRequest, incoming: IncomingRequest, ctx: SessionContext, p: Projection,
                    attempt: int, k: float, sent: list[dict[str, Any]], hashes: list[str],
                    changed: bool, own_list: bool, estimate: int | None) -> ForwardRecord:
    record = ForwardRecord(recorded.request_id, attempt, recorded.session_id, now(), incoming.params_hash,
                           verbatim=not changed, estimate=estimate, k=k,
                           samples=ctx.calibration(incoming.model).samples, request_list_id=recorded.list_id,
                           decisions=decision_rows(p.new, p.state, sent, hashes),
                           overflow=[OverflowBody(w.overflow_id, w.body, w.tool, w.call_id, w.span, w.size, w.part)
                                     for w in p.writes])
    if not changed:
        return record
    if own_list:
        return replace(record, own_list=True)
    base_id, base = ctx.sent_list or (recorded.list_id, list(incoming.hashes))
    same = common_start(base, hashes)
    # the request's messages are journaled with it, the base's with the forward before: their bodies are stored
    stored = set(incoming.hashes).union(base)
    return replace(record, length=len(hashes), base_list_id=base_id, base_len=same, added_hashes=hashes[same:],
                   base_hashes=base,
                   added_bodies=[None if h in stored else canonical_json(m) for h, m in zip(hashes[same:],
                                                                                         sent[same:], strict=True)])
