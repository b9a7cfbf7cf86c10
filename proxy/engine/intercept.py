"""Executing the model's context-tool calls inside the proxy (DESIGN.md §2 step 6).

``ContextRunner.execute`` turns each call into an intent (``proxy.tools.intents``), applies it to the session
(``proxy.tools.apply``, pure) or, for ``read_overflow``, reads the stored body; journals the decisions and the cut
bodies before anything else is sent; queues a confirmation line for the model's next request; publishes one
``context_op`` event per call; and returns the tool messages to splice after the call.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from ctxproxy.proxy.core.folds import hide_decision, rounds
from ctxproxy.proxy.core.project import project
from ctxproxy.proxy.core.state import Rules
from ctxproxy.proxy.engine.context import SessionContext
from ctxproxy.proxy.engine.heavy import is_large
from ctxproxy.proxy.engine.outfiles import write_outfiles
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.proxy.tools.apply import Outcome, View, apply_intent, render_overflow
from ctxproxy.proxy.tools.intents import Ctx, Intent, ReadOverflow, ToolError, parse_call
from ctxproxy.proxy.tools.mirror import maintenance_rounds, mirror_path, revise
from ctxproxy.proxy.tools.offer import turn_in
from ctxproxy.proxy.tools.schemas import TOOL_NAMES
from ctxproxy.store import Journal, JournalWriter, MemoryJournal, OverflowBody

__all__ = ["ContextRunner"]

_Done = tuple[str, dict[str, Any]]
"""A context call's result text (spliced after the call) and its ``context_op`` event (journaled, published)."""


class ContextRunner:
    def __init__(self, app: AppState, writer: JournalWriter, ctx: SessionContext, session_id: str,
                 request_id: int, messages: list[dict[str, Any]], hashes: list[str]) -> None:
        self.app, self.writer, self.ctx = app, writer, ctx
        self.session_id, self.request_id = session_id, request_id
        self.messages, self.hashes = messages, hashes
        self.large = is_large(0, len(messages))
        self.round = 0
        """The agent's round in its turn (``Turn.round``), which every ``context_op`` event carries: the proxy's
        own re-asks within one client request are not rounds of the agent."""
        self.all_events: list[dict[str, Any]] = []
        """Every event of this client request."""

    async def execute(self, calls: list[dict[str, Any]], rules: Rules,
                      model: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Run the calls in order; each sees the effect of the ones before it. Returns the tool messages to splice
        and the calls' ``context_op`` events (a stream also carries them as SSE comments)."""
        state = self.ctx.state if self.ctx.state is not None else self._view(rules, 0, "").state
        self.round = turn_in(self.messages, state).round
        results, events = [], []
        for call in calls:
            function = call.get("function") or {}
            text, event = await self._one(str(function.get("name")), function.get("arguments"), rules, model)
            row = {k: v for k, v in event.items() if k not in ("type", "session")} | {"session_id": self.session_id}
            await self.writer.call(Journal.record_context_op, row | {
                "request_id": self.request_id, "arguments": str(function.get("arguments") or ""), "result": text,
                "created_at": _now()})
            self.app.metrics.context_op(event["op"], event["ok"], event["tokens_freed"])
            results.append({"role": "tool", "tool_call_id": call.get("id"), "content": text})
            events.append(event)
        await self.ctx.journal_state(self.writer, self.session_id, self.request_id)
        return results, events

    async def _one(self, name: str, arguments: Any, rules: Rules, model: str | None) -> _Done:
        settings = self.app.settings.for_model(model)
        if not settings.tools_enabled:
            return self._event(name, False, f"{name}: the context tools are switched off here.")
        try:
            intent = parse_call(name, arguments)
        except ToolError as exc:
            return self._event(name if name in TOOL_NAMES else "invalid", False, f"{name}: {exc}")
        if isinstance(intent, ReadOverflow):
            return await self._read_overflow(intent)
        if isinstance(intent, Ctx) and intent.action == "commit":
            return await self._commit(rules)
        outcome = await self.app.offload.run(self.large, self._apply, intent, rules, settings.max_pins,
                                             settings.approval_pattern)
        if outcome.decisions:
            await self._journal(outcome, rules)
        if outcome.ok and outcome.op != "status":  # the next request hears what changed, not what was looked at
            self.ctx.confirmations.append(outcome.text)
        return self._event(outcome.op, outcome.ok, outcome.text, outcome)

    def _apply(self, intent: Intent, rules: Rules, max_pins: int, approval_pattern: str) -> Outcome:
        """The intent applied to the session's view: its cost follows the conversation (the view may be projected
        afresh), so a large one's runs on the worker (``proxy.engine.heavy``), under the session's lock."""
        return apply_intent(intent, self._view(rules, max_pins, approval_pattern))

    def _view(self, rules: Rules, max_pins: int, approval_pattern: str) -> View:
        state = self.ctx.state
        if state is None or state.absorbed != len(self.ctx.decisions):  # decisions changed since: see them applied
            state = project(self.messages, self.hashes, self.ctx.decisions, rules, self.app.counter,
                            seen=len(self.messages)).state  # every result here has arrived before
            self.ctx.state = None  # the next projection recomputes from the decisions, which now include these
        model_pins = sum(1 for source in state.pins.values() if source == "model")
        incognito = isinstance(self.writer.journal, MemoryJournal)  # never mirrored: no path to name
        mirror = "" if incognito else str(self.ctx.mirror or mirror_path(self.app.settings, self.session_id))
        return View(self.messages, state, rules, self.app.counter, max_pins, approval_pattern, model_pins,
                    mirror, self.ctx.mirror_revision)

    async def _journal(self, outcome: Outcome, rules: Rules) -> None:
        overflow = [OverflowBody(w.overflow_id, w.body, w.tool, w.call_id, w.span, w.size, w.part)
                    for w in outcome.writes]
        await self.writer.call(Journal.add_decisions, self.session_id, [asdict(d) for d in outcome.decisions],
                               _now(), self.request_id, overflow)
        await write_outfiles(rules.overflow_dir, [(w.overflow_id, w.body) for w in outcome.writes])
        self.ctx.decisions += outcome.decisions

    async def _commit(self, rules: Rules) -> _Done:
        """ctx commit: the model's edited LIVE_CONTEXT.json, validated and applied as a journaled revision."""
        path = self.ctx.mirror
        if path is None or not path.exists():
            return self._event("commit", False, "ctx commit: there is no LIVE_CONTEXT.json to commit; it is written "
                               "when the automatic cuts can no longer keep your context under its target.")
        try:
            draft = path.read_bytes()
            text = draft.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return self._event("commit", False, f"ctx commit: LIVE_CONTEXT.json could not be read as UTF-8 text "
                                                f"({exc}). Nothing applied.")
        if self.ctx.mirror_document is not None and draft == self.ctx.mirror_document:
            return self._unedited()
        state = self._view(rules, 0, "").state
        judged = self.ctx.written_entries()
        tools = {state.ids[i]: name for i, (name, _) in state.result_calls.items()}
        revision = revise(text, state.ids, state.hashes, self.messages, state.out, rules, judged, tools)
        self.ctx.mirror_written = False  # committed or refused: the next request writes the mirror afresh
        if revision.ok and revision.decisions:
            spans = maintenance_rounds(self.messages, rounds(self.messages, 0), path.name)
            hides = tuple(hide_decision(state, start, end) for start, end in spans)
            outcome = Outcome("commit", revision.text, True, tuple(d.target for d in revision.decisions),
                              0, revision.decisions + hides, revision.writes)
            await self._journal(outcome, rules)
            self.ctx.mirror_revision += 1
            self.ctx.confirmations.append(f"Mirror revision {self.ctx.mirror_revision} applied: {revision.text}")
            return self._event("commit", True, revision.text, outcome)
        return self._event("commit", revision.ok, revision.text)

    def _unedited(self) -> _Done:
        """A commit of the file as the proxy wrote it. The model may have edited it in the same answer, which the
        agent runs after the proxy's calls: the file stays a draft to come (not rewritten over an edit), and the
        model is told on its next request, as a mixed answer's tool results never reach it."""
        said = ("ctx commit found LIVE_CONTEXT.json as the proxy wrote it: nothing applied. Commit once your edits "
                "have been made, in an answer after them.")
        self.ctx.confirmations.append(said)
        return self._event("commit", True, said)

    async def _read_overflow(self, intent: ReadOverflow) -> _Done:
        row = await self.writer.call(Journal.overflow_body, intent.id, self.session_id)
        if row is None:
            gone = (" This session is incognito: what it cut was kept in memory only and is gone once incognito "
                    "sessions outgrow incognito_max_bytes or sit idle incognito_max_age; it cannot be restored."
                    if isinstance(self.writer.journal, MemoryJournal) else "")
            return self._event("read_overflow", False, f"read_overflow: no cut content with id {intent.id} in "
                               f"this session; ids come from [overflow id=...] stubs.{gone}")
        text = render_overflow(row["body"], intent.offset, intent.limit, intent.grep)
        return self._event("read_overflow", True, text, overflow_ids=(intent.id,))

    def _event(self, op: str, ok: bool, text: str, outcome: Outcome | None = None,
               overflow_ids: tuple[str, ...] = ()) -> _Done:
        """The call's result text and its ``context_op`` event, published and kept for this request."""
        event = {"type": "context_op", "session": self.session_id, "round": self.round,
                 "op": op.removeprefix("context_"), "ok": ok, "handles": list(outcome.handles if outcome else ()),
                 "tokens_freed": outcome.tokens_freed if outcome else 0,
                 "overflow_ids": list(outcome.overflow_ids if outcome else overflow_ids)}
        self.app.events.publish(event)
        self.all_events.append(event)
        return text, event


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
