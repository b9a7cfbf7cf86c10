"""What the proxy remembers about a session between its requests, and how it gets it back after a restart.

Per session: its decisions (the journal's, in order), the state the last projection left (so the next request
costs only its new messages), the calibration ratio per model, and the list that last went upstream (the base of
the next forward's delta in the journal). All of it can be rebuilt from the journal: on a miss (a restart, an
evicted session) the decisions and calibration samples are read back, and the first projection recomputes from
the decisions, which gives the same bytes. What the decisions do not imply (the turn the context tools are offered
in, the reminder given, confirmations not yet told, the live mirror) is journaled whenever a request changes it
(``SessionContext.journal_state``, ``store.session_state``) and read back with them. Several processes may share
the store (replicas, ``ctxproxy prune``): a request claims its session under the session's lock
(``store.claims``), and what this process remembers of it is used only if the request before was this process's
own with that memory; otherwise the session is read back. The decisions a fork inherits from its ancestor are
shared until a prune (``JournalWriter.generation``): nothing else ever changes them.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ctxproxy.proxy.core import Decision, State
from ctxproxy.proxy.core.forked import prefix_state
from ctxproxy.proxy.core.project import absorbed_state
from ctxproxy.proxy.core.tokens import Calibration
from ctxproxy.proxy.engine.heavy import heavy_journaling
from ctxproxy.proxy.engine.tally import Counting
from ctxproxy.proxy.tools.mirror import Entries, rendered, same_mirror, written_entries
from ctxproxy.store import (
    CalibrationInForce,
    ForwardRecord,
    Journal,
    JournalWriter,
    MirrorShown,
    RecordedRequest,
    SessionState,
    StateChange,
    calibration_in_force,
    claim,
    latest_calibration,
    record_forward_and_state,
    record_session_state,
    session_state,
    unclaim,
)

__all__ = ["ParentState", "Saved", "SessionContext", "SessionContexts", "read_new_session"]

SHARED_DECISIONS = 64
"""Ancestors' decision sets kept for their forks: the decisions themselves are shared with the sessions' contexts."""


@dataclass
class SessionContext:
    decisions: list[Decision]
    state: State | None = None
    ingest: tuple[Any, ...] | None = None
    """What ``state``'s ingestion of the messages depended on besides the decisions (the text-protocol presets, the
    paste threshold): a fork starts from the state only under the same (``SessionContexts.fork_start``)."""
    calibrations: dict[str | None, Calibration] = field(default_factory=dict)
    sent_list: tuple[int, list[str]] | None = None
    """Id and message hashes of the last list forwarded: the base of the next forward's delta."""
    offered_turn: str | None = None
    """Identity of the message that opened the turn in which the context tools were offered."""
    reminded_turn: str | None = None
    mirror: Path | None = None
    """Where LIVE_CONTEXT.json is written while the model manages its context through it."""
    mirror_revision: int = 0
    mirror_written: bool = False
    """The mirror was written and not committed or refused since: a file that differs from ``mirror_document`` is
    the model's draft (not overwritten until committed), judged against what it was given (``written_entries``)."""
    mirror_document: bytearray | None = None
    """The mirror's file (UTF-8) as last written, grown in place; after a restart, rendered from the journal."""
    mirror_shown: MirrorShown | None = field(default=None, compare=False)  # what it shows, as journaled
    mirror_exact: bool = field(default=True, compare=False)
    """False while ``mirror_document`` is rendered from the journal (keys sorted): a file is compared as JSON."""
    mirror_key: tuple[Any, ...] | None = field(default=None, compare=False)
    """What the mirror's file shows (session, revision, identities, hashes): unchanged, it is not rewritten."""
    mirror_entries: Entries = field(default_factory=dict, compare=False)
    """The mirror's entries as written, by hash (``proxy.tools.mirror.Entries``): a new version renders the new."""
    mirror_primed: int = field(default=0, compare=False)
    """How far (a message index) the entries of a mirror not on yet were rendered ahead (``mirror_file``)."""
    mirror_stat: tuple[int, int, int, int] | None = field(default=None, compare=False)
    """The file's inode, size and times just after the proxy wrote it: while they hold, no draft is pending."""
    confirmations: list[str] = field(default_factory=list)
    """What the model's context tools did, told to it as one system line in its next request."""
    journaled: SessionState = field(default_factory=SessionState, compare=False)
    """The working state as last journaled (or read back): a request that leaves it as it was writes nothing."""
    claimed: int | None = field(default=None, compare=False)
    """The request of this process that last held the session's lock with this context (``store.claims``)."""
    tallied: Counting | None = field(default=None, compare=False, repr=False)
    """The session's last tally (``proxy.engine.tally.counting``): the next one walks only what changed since."""
    absorbs: tuple[str, int] | None = field(default=None, compare=False)
    """(ancestor, n): its decisions are that ancestor's first n, none its own (``SessionContexts.absorbed``)."""

    def calibration(self, model: str | None) -> Calibration:
        return self.calibrations.get(model, Calibration())

    def working_state(self) -> SessionState:
        """What of this context the decisions do not imply, as the journal keeps it."""
        shown = self.mirror_shown if self.mirror_written else None
        earlier = (self.mirror_document.decode() if self.mirror_written and shown is None and self.mirror_document
                   is not None else None)  # a text read back
        return SessionState(self.offered_turn, self.reminded_turn, tuple(self.confirmations),
                            None if self.mirror is None else str(self.mirror), earlier, shown)

    async def journal_state(self, writer: JournalWriter, session_id: str, request_id: int) -> None:
        """Journal the working state if ``request_id`` changed it (the offer, the reminder, the confirmations, the
        mirror), so a restart or an eviction resumes the session as it is now."""
        change = self.state_change(session_id, request_id)
        if change is not None:
            await writer.call(record_session_state, *change, heavy=heavy_journaling(change))
            self.journaled_as(change)

    async def journal_forward(self, writer: JournalWriter, record: ForwardRecord, session_id: str,
                              request_id: int) -> int:
        """Journal a forward with the working state its request left, in one call and one transaction
        (``store.record_forward_and_state``); the id of the list that went upstream."""
        change = self.state_change(session_id, request_id)
        list_id = await writer.call(record_forward_and_state, record, change,
                                    heavy=heavy_journaling(change, record.new_bytes()))
        self.journaled_as(change)
        return list_id

    def state_change(self, session_id: str, request_id: int) -> StateChange | None:
        """The working state ``request_id`` left, to journal, or None when it changed nothing; once journaled,
        ``journaled_as``. A forward journals it with its own row (``store.record_forward_and_state``)."""
        state = self.working_state()
        if state == self.journaled:
            return None
        return StateChange(session_id, request_id, state, datetime.now(UTC).isoformat(timespec="milliseconds"))

    def journaled_as(self, change: StateChange | None) -> None:
        """The journal has the working state of ``change`` (``state_change``'s), if any."""
        if change is not None:
            self.journaled = change.state

    def written_entries(self) -> dict[str, str]:
        """The mirror's entries as last written (identity → text), what a draft is judged against: read back from
        its text when a commit asks, not kept from each write (~0.7 ms a request of a long session; issue #13)."""
        if not self.mirror_written or self.mirror_document is None:
            return {}
        return written_entries(self.mirror_document)

    def resume(self, state: SessionState, session_id: str) -> None:
        """Take back the working state the journal kept; the mirror's text rendered from what it shows."""
        self.offered_turn, self.reminded_turn = state.offered_turn, state.reminded_turn
        self.confirmations = list(state.confirmations)
        self.mirror = None if state.mirror is None else Path(state.mirror)
        shown = state.mirror_shown
        if shown is not None:
            self.mirror_document = rendered(session_id, shown.revision, shown.ids, shown.hashes, shown.bodies)
        else:
            self.mirror_document = None if state.mirror_text is None else bytearray(state.mirror_text.encode())
        self.mirror_written, self.mirror_exact = self.mirror_document is not None, shown is None
        self.mirror_shown = None if shown is None else replace(shown, bodies={})  # rendered: not kept
        self.journaled = replace(state, mirror_shown=self.mirror_shown)


def _refresh_mirror(stale: SessionContext, fresh: SessionContext) -> None:
    """Another process wrote the mirror since this one did (replicas each on a disk of its own): the file here
    still holds what this process wrote then, which would pass for the model's draft. It is rewritten from what the
    journal says the mirror shows; a file that shows that already is kept, and one that is neither (the model's
    draft) is left as it is."""
    path, text = fresh.mirror, fresh.mirror_document
    if path is None or text is None or not fresh.mirror_written or stale.mirror_document is None:
        return
    try:
        here = path.read_bytes() if path.exists() else None
    except OSError:
        return
    if here is not None and not fresh.mirror_exact and same_mirror(here, text):
        fresh.mirror_document = bytearray(here)  # the same mirror, as the file holds it
    elif here is None or (here != text and here == stale.mirror_document):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text)
    else:
        return  # the model's draft
    fresh.mirror_exact = True


@dataclass(frozen=True)
class ParentState:
    """A fork's first state: its parent's cut to the messages they share, and what its ingestion depended on."""

    state: State
    ingest: tuple[Any, ...]


@dataclass
class _Shared:
    """An ancestor's decisions read so far (those up to decision ``upto``), in order, with their ids."""

    upto: int = 0
    ids: list[int] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)


class SessionContexts:
    """A bounded LRU of session contexts; a session's lock is held whenever its context is used."""

    def __init__(self, capacity: int = 256) -> None:
        self._items: OrderedDict[tuple[int, str], SessionContext] = OrderedDict()
        self._capacity = capacity
        self._shared: OrderedDict[tuple[int, int, str], _Shared] = OrderedDict()
        """Ancestors' decisions up to a fork (``_inherited``), least recently used first."""
        self._absorbed: OrderedDict[tuple[int, int, str, int], State] = OrderedDict()
        """The state of an ancestor's first n decisions before any message (``absorbed``), by (writer, its
        generation, ancestor, n)."""
        self.models: dict[str | None, Calibration] = {}
        """The latest calibration per model, across sessions: a new session starts from it."""
        self.window_limits: dict[str | None, int] = {}
        """Windows the upstream proved smaller than configured or detected (it refused a prompt as too long)."""

    async def get(self, writer: JournalWriter, session_id: str, model: str | None,
                  request_id: int | None = None, saved: Saved | None = None, opened: bool = False) -> SessionContext:
        """The session's context, for ``request_id`` holding the session's lock. What this process remembers is
        used only while no other process handled the session since (``store.claims``): otherwise it is read back,
        as after a restart. Without ``request_id`` (nothing claims the session) what is remembered is used.
        ``saved``: the session as read back with its request (``read_new_session``). ``opened``: the request opened
        the session, so nothing remembered under its id is its own (an earlier session of the same id, pruned)."""
        key = (id(writer), session_id)
        context = self._items.pop(key, None)
        if context is None or opened:
            context = await self._load(writer, session_id, model, request_id, saved)  # claimed in the same call
        elif request_id is not None:
            previous = await writer.call(claim, session_id, request_id)
            if context.claimed != previous:
                stale, context = context, await self._load(writer, session_id, model)
                _refresh_mirror(stale, context)
        context.claimed = request_id if request_id is not None else context.claimed
        self._items[key] = context
        if len(self._items) > self._capacity:
            self._items.popitem(last=False)
        return context

    def fork_start(self, writer: JournalWriter, ctx: SessionContext, recorded: RecordedRequest,
                   messages: Sequence[dict[str, Any]], hashes: Sequence[str]) -> ParentState | None:
        """For the request that opened a fork: its parent's state cut to the messages they share
        (``proxy.core.forked``), when the parent's context is here, its state is in step with its decisions and
        the fork inherited all of them; else None (the fork is projected from the decisions). The fork's forward
        list is based on the parent's last. Synchronous, on the loop: a state is only extended by the request that
        took it out of its context, so none is changing now."""
        if not recorded.forked or recorded.parent_id is None or ctx.state is not None:
            return None
        parent = self._items.get((id(writer), recorded.parent_id))
        if parent is None:
            return None
        # The fork's first forward list: a delta against what its parent last sent, which it repeats up to the
        # fork, rather than against its own request (all of its cut messages added again, stubs serialised).
        ctx.sent_list = ctx.sent_list or parent.sent_list
        if parent.state is None or parent.ingest is None:
            return None
        if len(parent.decisions) != len(ctx.decisions) or parent.decisions[-1:] != ctx.decisions[-1:]:
            return None
        state = prefix_state(parent.state, recorded.seen, messages, hashes, len(ctx.decisions))
        return None if state is None else ParentState(state, parent.ingest)

    def drop(self, writer: JournalWriter, session_id: str) -> None:
        """Forget a session's working state (and the decisions its forks share); the next request reloads it."""
        self._items.pop((id(writer), session_id), None)
        self._shared.pop((id(writer), writer.generation, session_id), None)

    async def changed(self, writer: JournalWriter, session_id: str) -> None:
        """The session changed outside a request (an operator's pin or cut): every process reads it back."""
        self.drop(writer, session_id)
        await writer.call(unclaim, session_id)

    async def _inherited(self, writer: JournalWriter, ancestor: str, upto: int) -> list[Decision]:
        """An ancestor's decisions up to a fork, each read once and shared by every session forked from it (a new
        run after a long session would otherwise reload its thousand decisions): a later fork reads only those
        made since. They never change (the journal only appends); a prune or a forgotten session retires them."""
        key = (id(writer), writer.generation, ancestor)
        shared = self._shared.pop(key, None) or _Shared()
        if upto > shared.upto:
            for decision_id, row in await writer.call(Journal.decisions_upto, ancestor, upto, shared.upto):
                shared.ids.append(decision_id)
                shared.decisions.append(Decision(**row))
            shared.upto = upto
        self._shared[key] = shared
        if len(self._shared) > SHARED_DECISIONS:
            self._shared.popitem(last=False)
        n = bisect_right(shared.ids, upto)
        return shared.decisions if n == len(shared.decisions) else shared.decisions[:n]  # read, never changed

    @staticmethod
    async def _claimed_elsewhere(writer: JournalWriter, session_id: str, request_id: int) -> bool:
        """Claims a session this request opened; whether another request claimed it first (it holds it now)."""
        return await writer.call(claim, session_id, request_id) is not None

    async def _load(self, writer: JournalWriter, session_id: str, model: str | None,
                    request_id: int | None = None, saved: Saved | None = None) -> SessionContext:
        if saved is not None and request_id is not None and not saved.claimed and await self._claimed_elsewhere(
                writer, session_id, request_id):
            saved, request_id = None, None  # the new session was handled elsewhere since it was read: read again
        if saved is None:
            saved = await writer.call(_read_back, session_id, model, request_id)  # one hop to the journal, not six
        decisions: list[Decision] = []
        sources = []
        for ancestor, upto in saved.ancestors:
            if upto:  # 0: the ancestor had no decision of its own when its child forked (runs forking runs)
                decisions += await self._inherited(writer, ancestor, upto)
                sources.append((ancestor, len(decisions)))
        decisions += [Decision(**row) for row in saved.decisions]
        context = SessionContext(decisions, calibrations={model: self._calibration(saved, model)},
                                 mirror_revision=saved.revisions)
        context.absorbs = sources[0] if len(sources) == 1 and len(decisions) == sources[0][1] else None
        context.resume(saved.state, session_id)
        return context

    def absorbed(self, writer: JournalWriter, ctx: SessionContext) -> State | None:
        """For a session whose decisions are all one ancestor's first n and that has no state yet (a new run's
        first request): their state before any message, absorbed once for every such session and copied
        (``proxy.core.project.absorbed_state``); else None."""
        if ctx.absorbs is None or ctx.state is not None or len(ctx.decisions) != ctx.absorbs[1]:
            return None
        key = (id(writer), writer.generation, *ctx.absorbs)
        template = self._absorbed.pop(key, None) or absorbed_state(ctx.decisions)
        self._absorbed[key] = template
        if len(self._absorbed) > SHARED_DECISIONS:
            self._absorbed.popitem(last=False)
        return template.copy()

    def _calibration(self, saved: Saved, model: str | None) -> Calibration:
        """The session's calibration: the one its latest forward was sent under, and what its answer taught. A
        session with no forward yet starts from the latest calibration of the model, across sessions; one whose
        forwards were journaled without their sample count, from its latest answers."""
        force = saved.force
        if force is not None:
            calibration = Calibration(force.k, force.samples)
            return calibration.observe(*force.learnt) if force.learnt else calibration
        latest = saved.latest
        calibration = self.models.get(model, Calibration()) if latest is None else Calibration(latest.k, latest.samples)
        if latest is not None and latest.learnt:
            calibration = calibration.observe(*latest.learnt)
        for estimate, actual in saved.samples:
            calibration = calibration.observe(estimate, actual)
        return calibration


@dataclass(frozen=True)
class Saved:
    """What the journal keeps of a session, read back in one call on its thread: every new session (a fork, a
    new run) is loaded, and each hop to that thread costs a wake-up and a GIL hand-off, ~0.1 ms on a busy core."""

    ancestors: list[tuple[str, int]]
    """The sessions it was forked from, each with the last of its decisions it inherits (``Journal.decision_chain``)."""
    decisions: list[dict[str, Any]]
    """Its own decisions."""
    force: CalibrationInForce | None
    latest: CalibrationInForce | None
    """Without a forward of its own: the model's latest calibration, any session's (``latest_calibration``)."""
    samples: list[tuple[int, int]]
    revisions: int
    state: SessionState
    claimed: bool = False
    """The request that opened the session claimed it in the same call (``read_new_session``)."""


def read_new_session(model: str | None, named: bool) -> Callable[[Journal, RecordedRequest], Saved | None]:
    """For ``Journal.record_request_and_read``: a session the request opened, read back in the same call on the
    journal's thread as its request row (a new run or a fork, e.g. every request of the peers' benchmark, saves a
    hop). Only a new session: one the proxy already knows may be in memory, ahead of the journal.

    A session opened by its opening (not ``named``) was claimed in that call too, in the request's own transaction
    (``record_request_and_read(..., claim_opened=True)``), before its lock is taken, which saves the claim's own hop
    and transaction after it: no other request can join it until its first answer is journaled (placement
    continues no pending head), so nothing can claim it in between. A named session can be joined at once (the
    same name, in parallel); it is claimed under its lock, as any session."""
    def read(journal: Journal, recorded: RecordedRequest) -> Saved | None:
        if not recorded.created:
            return None
        return _read_opened(journal, recorded.session_id, model, claimed=not named)
    return read


def _read_opened(journal: Journal, session_id: str, model: str | None, claimed: bool) -> Saved:
    """``_read_back`` of a session its request has just opened: the ancestors it inherits decisions from and the
    model's latest calibration are all it can have. No forward, answer, decision, mirror revision or working state
    of its own exists yet: the five reads of those would find nothing (a third of a new run's read back), and its
    ancestry is the one its journal kept when it opened it (``AncestryMixin.remember_ancestry``)."""
    return Saved(journal.inherited(session_id), [], None, latest_calibration(journal, model), [], 0, SessionState(),
                 claimed)


def _read_back(journal: Journal, session_id: str, model: str | None, request_id: int | None) -> Saved:
    if request_id is not None:
        claim(journal, session_id, request_id)
    force = calibration_in_force(journal, session_id, model)
    latest = latest_calibration(journal, model) if force is None else None
    samples = journal.calibration_samples(session_id, model) if force is None else []
    ancestors, own = journal.decision_chain(session_id)
    return Saved(ancestors, own, force, latest, samples, journal.mirror_revisions(session_id),
                  session_state(journal, session_id))
