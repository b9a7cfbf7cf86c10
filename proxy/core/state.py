"""The working state of a projection and the rules it obeys, shared by ``project`` and ``cuts``."""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from ctxproxy.proxy.core.budget import Budget
from ctxproxy.proxy.core.decisions import Decision
from ctxproxy.proxy.core.fenced import Preset
from ctxproxy.proxy.core.invariants import Pairs
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
    """What a fold of messages ``[start, end)`` needs to know of them, so far: its body's sha256 and byte length
    (``[`` then their canonical JSON joined by ``,``; the closing ``]`` is added when a digest is taken), the sha256
    of their identity hashes (the decision's ``message_hash``), what its stub says (how many messages of each role,
    calls of each tool), and whether their calls and results pair up among themselves (``proxy.core.invariants``'s
    walk). A fold that extends the last one hashes, tallies and walks only the messages it adds: doing it over the
    whole span on every fold made the fold requests the slowest of a long session (issue #13). Never mutated
    (``extend`` works on copies), so a copied ``State`` may share it."""

    start: int
    end: int
    digest: Any
    """A ``hashlib.sha256`` object (the body's; ``identities`` the hashes')."""
    size: int
    identities: Any
    roles: Mapping[str, int] = field(default_factory=dict)
    tools: Mapping[str, int] = field(default_factory=dict)
    pairs: Pairs = field(default_factory=Pairs)

    @staticmethod
    def empty(start: int) -> FoldSum:
        return FoldSum(start, start, hashlib.sha256(b"["), 1, hashlib.sha256())

    def extend(self, messages: Iterable[tuple[dict[str, Any], bytes, str]]) -> FoldSum:
        """This sum with ``messages`` (the next ones, in order, each with its canonical JSON and identity hash)
        appended."""
        digest, identities, size, end = self.digest.copy(), self.identities.copy(), self.size, self.end
        roles, tools, added = dict(self.roles), dict(self.tools), []
        for message, body, identity in messages:
            if end > self.start:
                digest.update(b",")
                size += 1
            digest.update(body)
            identities.update(identity.encode())
            size, end = size + len(body), end + 1
            role = str(message.get("role"))
            roles[role] = roles.get(role, 0) + 1
            for call in message.get("tool_calls") or ():
                name = call.get("function", {}).get("name", "?")
                tools[name] = tools.get(name, 0) + 1
            added.append(message)
        return FoldSum(self.start, end, digest, size, identities, roles, tools, self.pairs.extended(added))

    def closed(self) -> tuple[str, int]:
        """(sha256 hex, byte length) of the whole body, ``]`` included."""
        digest = self.digest.copy()
        digest.update(b"]")
        return digest.hexdigest(), self.size + 1

    def message_hash(self) -> str:
        """The sha256 of the span's identity hashes, joined: ``sha256_text("".join(hashes[start:end]))``."""
        return str(self.identities.hexdigest())


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
    fold_ahead: tuple[FoldSum, ...] = field(default=(), compare=False)
    """``fold_sum`` carried on over the rounds after it, a round or two a request, one sum at each round's end
    (``proxy.core.folds.prime_fold``): the next fold takes the one at its end and hashes only the rest."""
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
    change), for the next pass to walk on from there (``proxy.core.folds._fold_spans``)."""
    primed: int = 0
    """How far (a position in ``tool_indices``) the markers of the next elisions were counted ahead
    (``proxy.core.cuts.prime``): only the counter's cache holds them."""
    marked_ahead: list[tuple[int, dict[str, Any], str]] = field(default_factory=list)
    """The markers this projection counted ahead: (incoming index, the message as the marker will cut it, its hash),
    for the mirror to render their entries ahead too (``proxy.engine.mirror_file``)."""
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
