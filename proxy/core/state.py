"""The working state of a projection and the rules it obeys, shared by ``project`` and ``cuts``."""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from ctxproxy.proxy.core.budget import Budget
from ctxproxy.proxy.core.decisions import Decision
from ctxproxy.proxy.core.fenced import Preset
from ctxproxy.proxy.core.segments import FencedResult

__all__ = ["READ_OVERFLOW", "Counter", "FoldSum", "Rules", "State", "sha256_text"]

READ_OVERFLOW = "read_overflow"
"""Results of the tool that restores cut content are never cut again."""


class Counter(Protocol):
    def count(self, message: dict[str, Any], key: str | None = None) -> int: ...


@dataclass(frozen=True)
class Rules:
    budget: Budget
    k: float = 1.0
    storage: str = "disk"
    tools_tokens: int = 0
    fenced: tuple[Preset, ...] = ()
    """The text-protocol presets in force (empty on the native route)."""
    overflow_dir: str = ""
    """Where cut bodies are also written as ``<id>.out`` for the agent's own tools ("" = not): stubs name the file."""

    def scaled(self, estimate: int) -> int:
        return math.ceil(round(estimate * self.k, 9))  # 50 × 1.1 is 55, not 55.000000000000007 → 56


@dataclass(frozen=True)
class FoldSum:
    """A fold body's sha256 and byte length so far: ``[`` then the canonical JSON of messages ``[start, end)``
    joined by ``,`` (the closing ``]`` is added when a digest is taken). A fold that extends the last one hashes only
    the messages it adds; re-serialising the whole span on every fold made the fold requests the slowest of a long
    session. Never mutated (``extend`` hashes on a copy), so a copied ``State`` may share it."""

    start: int
    end: int
    digest: Any
    """A ``hashlib.sha256`` object."""
    size: int

    @staticmethod
    def empty(start: int) -> FoldSum:
        return FoldSum(start, start, hashlib.sha256(b"["), 1)

    def extend(self, bodies: Iterable[bytes]) -> FoldSum:
        """This sum with ``bodies`` (the canonical JSON of the next messages, in order) appended."""
        digest, size, end = self.digest.copy(), self.size, self.end
        for body in bodies:
            if end > self.start:
                digest.update(b",")
                size += 1
            digest.update(body)
            size, end = size + len(body), end + 1
        return FoldSum(self.start, end, digest, size)

    def closed(self) -> tuple[str, int]:
        """(sha256 hex, byte length) of the whole body, ``]`` included."""
        digest = self.digest.copy()
        digest.update(b"]")
        return digest.hexdigest(), self.size + 1


@dataclass
class State:
    """What one projection leaves for the next request of its session; aligned with the incoming messages."""

    hashes: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    out: list[dict[str, Any] | None] = field(default_factory=list)
    out_hashes: list[str] = field(default_factory=list)
    """The identity hash of each outgoing message (the incoming one's where untouched), for the journal."""
    counts: list[int] = field(default_factory=list)
    total: int = 0
    seen: dict[str, int] = field(default_factory=dict)
    calls: dict[str, tuple[str, str]] = field(default_factory=dict)
    """The latest call per tool_call_id: (tool name, arguments)."""
    call_spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per tool_call_id, the first and the latest message that calls it: a fork's ``calls`` are its parent's whose
    latest call it shares (``proxy.core.forked``), not a walk of its history."""
    recalled: set[str] = field(default_factory=set)
    """The tool_call_ids called more than once (a client that reuses its ids)."""
    result_calls: dict[int, tuple[str, str]] = field(default_factory=dict)
    """The call each result answers (index → name, arguments), fixed when the result arrives: ids get reused."""
    tool_indices: list[int] = field(default_factory=list)
    call_indices: list[int] = field(default_factory=list)
    """Assistant messages with tool calls: their large arguments may be cut (``proxy.core.arguments``)."""
    user_indices: list[int] = field(default_factory=list)
    """User messages: where the turn starts is found among them, not by walking the history
    (``proxy.tools.offer.turn_in``)."""
    fenced: dict[int, FencedResult] = field(default_factory=dict)
    """Text-protocol results messages (index → round, segments, command): cut result by result."""
    rounds: int = 0
    """Assistant messages ingested so far: the round a results message answers."""
    decided: dict[str, Decision] = field(default_factory=dict)
    pins: dict[str, str] = field(default_factory=dict)
    """Pinned identities and who pinned them (operator or model)."""
    fold: Decision | None = None
    fold_sum: FoldSum | None = None
    """The running digest of the latest fold's body (None after a recomputation: the next fold hashes afresh)."""
    hides: tuple[Decision, ...] = ()
    """Rounds taken out of the projection altogether (the agent's own edits of the mirror, once applied)."""
    hidden: tuple[int, ...] = ()
    """Incoming indices the hides took out."""
    folded: tuple[int, int] | None = None
    """The span ``[start, end)`` of incoming messages the fold stub (at ``start``) stands for."""
    cut: int = 0
    """How many incoming messages go out changed or folded away (0: the request can go upstream verbatim)."""
    absorbed: int = 0
    """How many of the session's decisions this state reflects (the log only grows)."""
    spans: tuple[int, bool, list[tuple[int, int]], int] | None = None
    """The fold's rounds as the last pass found them: (start, paired, spans, how many of them no later message can
    change), for the next pass to walk on from there (``proxy.core.cuts._fold_spans``)."""
    primed: int = 0
    """How far (a position in ``tool_indices``) the markers of the next elisions were counted ahead
    (``proxy.core.cuts.prime``): only the counter's cache holds them."""
    touched: set[int] = field(default_factory=set)
    """Incoming indices whose outgoing message this projection replaced (cut, folded away, put back): with the new
    messages, all that changed since the last projection of the session, which was checked (``violations_since``)."""
    settled: int = 0
    """Every elision candidate below this index is settled (``proxy.core.cuts.elide``): taken out, cut already or
    never cuttable. A resumed state keeps it (its messages, decisions and pins are what they were); a state rebuilt
    from the decisions starts again from 0."""

    def called(self, i: int, call: dict[str, Any]) -> None:
        """Message ``i`` makes ``call``: the latest call of its id, and where its id is called."""
        function, call_id = call.get("function") or {}, call.get("id", "")
        self.calls[call_id] = (str(function.get("name", "?")), str(function.get("arguments") or ""))
        first = self.call_spans.get(call_id)
        self.call_spans[call_id] = (i, i) if first is None else (first[0], i)
        if first is not None:
            self.recalled.add(call_id)

    def copy(self) -> State:
        """A copy whose lists and dicts are its own (``project`` extends the state it is given in place)."""
        mutable = {f.name: copy.copy(getattr(self, f.name)) for f in fields(self)}
        return State(**mutable)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
