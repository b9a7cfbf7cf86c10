"""``ctxproxy replay``: run a recorded conversation through the rewrite core, request by request, offline.

A conversation (the shared trajectory format: ``{"messages", "tools"?}``) is turned into the requests its agent
sent: one each time the agent asked the model, i.e. the history before each assistant message, and the whole
history when it does not end with one. Each request is projected as the proxy would (same decisions carried from
request to request, same state, the real token counter) and reported: tokens in and out, decisions, invariants,
and how much of it an upstream prefix cache could reuse from the previous request.

Prefix reuse, as the project's benchmarks define it: the characters of a request's leading messages (and its
tools) that are byte-identical to the previous upstream request's, over all characters sent.

Two more promises are counted per request: the newest round's own text (its assistant message and the user
messages after it) never folded or hidden to make room (``newest_lost``, characters), and every cut restorable
(``unrestorable``: cuts whose removed bytes were never handed to the overflow store under their sha256).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from config import Settings
from proxy.budgets import budget_for
from proxy.rewrite import Decision, Rules, State, message_hash, project, violations
from proxy.rewrite.fenced import presets_for, route_of
from proxy.rewrite.state import sha256_text
from proxy.rewrite.tokens import MessageCounter

__all__ = ["ReplayStep", "Summary", "agent_requests", "replay", "summarize"]


@dataclass(frozen=True)
class ReplayStep:
    request: int
    messages: int
    tokens_in: int
    tokens_out: int
    chars_sent: int
    chars_reused: int
    prefix_kept: bool
    """The previous request's upstream messages are a byte-identical prefix of this one's."""
    refused: bool
    """Over budget even after every cut: the proxy answers context_length_exceeded instead of forwarding."""
    decisions: dict[str, int] = field(default_factory=dict)
    violations: tuple[str, ...] = ()
    newest_lost: int = 0
    """Characters of the newest round's assistant and user text folded or hidden in this request."""
    unrestorable: int = 0
    """Cuts of this request whose removed bytes are not in the overflow store under their id."""


@dataclass(frozen=True)
class Summary:
    requests: int
    refused: int
    violations: int
    chars_sent: int
    chars_reused: int
    max_tokens_out: int
    newest_lost: int = 0
    unrestorable: int = 0

    @property
    def reuse(self) -> float:
        return self.chars_reused / self.chars_sent if self.chars_sent else 1.0

    @property
    def uncached(self) -> int:
        return self.chars_sent - self.chars_reused


def agent_requests(messages: Sequence[dict[str, Any]]) -> list[int]:
    """Where the agent asked the model: before each assistant message after the first, and at the end."""
    ends = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > 0]
    if messages and messages[-1].get("role") != "assistant":
        ends.append(len(messages))
    return ends


def replay(conversation: dict[str, Any], settings: Settings, window: int,
           counter: MessageCounter | None = None) -> Iterator[ReplayStep]:
    counter = counter or MessageCounter()
    messages, tools = conversation["messages"], conversation.get("tools")
    model_settings = settings.for_model(conversation.get("model"))
    presets = presets_for(model_settings.fenced_presets)
    fenced = presets if route_of(messages, tools, model_settings.route, presets) == "fenced" else ()
    rules = Rules(budget_for(model_settings, window), tools_tokens=counter.count_tools(tools), fenced=fenced)
    hashes = [message_hash(m) for m in messages]
    decisions: list[Decision] = []
    state: State | None = None
    previous: list[bytes] = []
    tools_chars = len(orjson.dumps(tools)) if tools else 0
    seen = 0
    stored: set[str] = set()
    for n, end in enumerate(agent_requests(messages)):
        p = project(messages[:end], hashes[:end], decisions, rules, counter, state, seen)
        written = stored | {w.overflow_id for w in p.writes if sha256_text(w.body) == w.overflow_id}
        sent = [orjson.dumps(m) for m in p.messages]
        reused = _reused(previous, sent) + (tools_chars if n else 0)
        problems = tuple(violations(messages[:end], p.messages,
                                    fenced={i: r.segments for i, r in p.state.fenced.items()}))
        tokens_in = sum(counter.count(m, h) for m, h in zip(messages[:end], hashes[:end], strict=True))
        yield ReplayStep(n, end, tokens_in + rules.tools_tokens, p.report.estimate, sum(map(len, sent)) + tools_chars,
                         reused, sent[: len(previous)] == previous, p.report.over_budget,
                         dict(collections.Counter(d.kind for d in p.new)), problems,
                         _newest_lost(messages[:end], p.state), _unrestorable(p.new, written))
        if p.report.over_budget:  # the proxy refuses it: nothing of it is journaled, the next one recomputes
            state = None
        else:
            decisions += p.new
            state, previous, stored = p.state, sent, written
        seen = end


def _unrestorable(new: Sequence[Decision], written: set[str]) -> int:
    return sum(d.kind in ("spill", "elide", "fold") and d.overflow_id not in written for d in new)


def _newest_lost(messages: Sequence[dict[str, Any]], state: State) -> int:
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=len(messages))
    gone = set(range(*state.folded)) if state.folded else set()
    gone.update(state.hidden)
    return sum(len(str(messages[i].get("content") or "")) for i in range(last, len(messages))
               if i in gone and messages[i].get("role") in ("user", "assistant"))


def _reused(previous: list[bytes], sent: list[bytes]) -> int:
    total = 0
    for a, b in zip(previous, sent, strict=False):
        if a != b:
            break
        total += len(a)
    return total


def summarize(steps: Sequence[ReplayStep]) -> Summary:
    forwarded = [s for s in steps if not s.refused]
    return Summary(len(steps), len(steps) - len(forwarded), sum(len(s.violations) for s in steps),
                   sum(s.chars_sent for s in forwarded), sum(s.chars_reused for s in forwarded),
                   max((s.tokens_out for s in forwarded), default=0), sum(s.newest_lost for s in forwarded),
                   sum(s.unrestorable for s in forwarded))
