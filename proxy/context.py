"""What the proxy remembers about a session between its requests, and how it gets it back after a restart.

Per session: its decisions (the journal's, in order), the state the last projection left (so the next request
costs only its new messages), the calibration ratio per model, and the list that last went upstream (the base of
the next forward's delta in the journal). All of it can be rebuilt from the journal: on a miss (a restart, an
evicted session) the decisions and calibration samples are read back, and the first projection recomputes from
the decisions, which gives the same bytes. When another process wrote the journal (``ctxproxy prune``), every
session is read back again (``JournalWriter.generation``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from proxy.rewrite import Decision, State
from proxy.rewrite.tokens import Calibration
from store import Journal, JournalWriter

__all__ = ["SessionContext", "SessionContexts"]


@dataclass
class SessionContext:
    decisions: list[Decision]
    state: State | None = None
    calibrations: dict[str | None, Calibration] = field(default_factory=dict)
    sent_list: tuple[int, list[str]] | None = None
    """Id and message hashes of the last list forwarded: the base of the next forward's delta."""
    offered_turn: str | None = None
    """Identity of the message that opened the turn in which the context tools were offered."""
    reminded_turn: str | None = None
    mirror: Path | None = None
    """Where LIVE_CONTEXT.json is written while the model manages its context through it."""
    mirror_revision: int = 0
    mirror_written: tuple[str, dict[str, str]] | None = None
    """The sha256 of the mirror as last written and its entries (identity → text): a file that differs is the
    model's draft (not overwritten until committed), judged against what it was given, entry by entry."""
    confirmations: list[str] = field(default_factory=list)
    """What the model's context tools did, told to it as one system line in its next request."""

    def calibration(self, model: str | None) -> Calibration:
        return self.calibrations.get(model, Calibration())


class SessionContexts:
    """A bounded LRU of session contexts; a session's lock is held whenever its context is used."""

    def __init__(self, capacity: int = 256) -> None:
        self._items: OrderedDict[tuple[int, int, str], SessionContext] = OrderedDict()
        self._capacity = capacity
        self.models: dict[str | None, Calibration] = {}
        """The latest calibration per model, across sessions: a new session starts from it."""
        self.window_limits: dict[str | None, int] = {}
        """Windows the upstream proved smaller than configured or detected (it refused a prompt as too long)."""

    async def get(self, writer: JournalWriter, session_id: str, model: str | None) -> SessionContext:
        key = (id(writer), writer.generation, session_id)  # a prune may have removed what an older one holds
        context = self._items.pop(key, None) or await self._load(writer, session_id, model)
        self._items[key] = context
        if len(self._items) > self._capacity:
            self._items.popitem(last=False)
        return context

    def drop(self, writer: JournalWriter, session_id: str) -> None:
        """Forget a session's working state; the next request reloads it from the journal."""
        self._items.pop((id(writer), writer.generation, session_id), None)

    async def _load(self, writer: JournalWriter, session_id: str, model: str | None) -> SessionContext:
        rows = await writer.call(Journal.decisions, session_id)
        samples = await writer.call(Journal.calibration_samples, session_id, model)
        calibration = self.models.get(model, Calibration())
        for estimate, actual in samples:
            calibration = calibration.observe(estimate, actual)
        revisions = await writer.call(Journal.mirror_revisions, session_id)
        return SessionContext([Decision(**row) for row in rows], calibrations={model: calibration},
                              mirror_revision=revisions)
