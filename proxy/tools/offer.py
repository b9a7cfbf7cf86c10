"""When the context tools are offered, and how an answer that calls them is split from the agent's own calls.

Offer rule (DESIGN.md §5): tools enabled, and usage ≥ ``offer_pct`` of the budget, or the turn's round ≥
``offer_round``, or the person asked (a configured phrase or a tool's name in their latest message). Once offered
they stay offered for the rest of the turn, appended after the agent's own tools, byte-identical each time.
A turn starts at the person's latest message; its rounds are the agent's tool rounds since then: assistant
messages with tool calls on the native route, results messages on the fenced one (a text-protocol agent has no
``tool_calls``, and it is the case the round rule was written for). The round the model answers now is one more.

Phrases and tool names match whole words only: "ctx" does not fire on "ctxproxy", and the bare name ``ctx`` (a
common variable name) counts only followed by one of its actions ("ctx clear").
"""

from __future__ import annotations

import functools
import re
from bisect import bisect_left
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from ctxproxy.proxy.core.project import PASTE
from ctxproxy.proxy.core.state import State
from ctxproxy.proxy.tools.schemas import CONTEXT_TOOLS, TOOL_NAMES

__all__ = ["Split", "Turn", "person_asked", "split_calls", "turn_in", "turn_of", "with_context_tools"]

REMINDER = ("[ctxproxy] Your context is nearly full. You can free it yourself: context_status shows what takes "
            "the room; context_drop and context_note cut results you no longer need (restorable).")


@dataclass(frozen=True)
class Turn:
    start: int
    """Index of the person's latest message (0 when there is none)."""
    rounds: int
    """The agent's tool rounds since then (native tool-call rounds, or fenced results messages)."""

    @property
    def round(self) -> int:
        """The round the model is answering now: 1 for its first answer after the person's message."""
        return self.rounds + 1


def turn_of(messages: Sequence[dict[str, Any]], results: Collection[int] = ()) -> Turn:
    """``results``: indices of user messages that carry a text-protocol round's results (not the person's)."""
    start = next((i for i in range(len(messages) - 1, -1, -1)
                  if messages[i].get("role") == "user" and i not in results), 0)
    rounds = sum(1 for i, m in enumerate(messages[start:], start)
                 if (m.get("role") == "assistant" and m.get("tool_calls")) or i in results)
    return Turn(start, rounds)


def turn_in(messages: Sequence[dict[str, Any]], state: State) -> Turn:
    """The turn of a projected request: the fenced results messages its projection found are the agent's rounds
    (a person's paste is not). Read from the state's indices of user messages and of calls when it is the state
    of these messages (``turn_of`` walked a 600-round history on every request: 0.8 ms)."""
    results = {i for i, r in state.fenced.items() if r.command != PASTE and i < len(messages)}
    if len(state.hashes) != len(messages):
        return turn_of(messages, results)
    start = next((i for i in reversed(state.user_indices) if i not in results), 0)
    calls = len(state.call_indices) - bisect_left(state.call_indices, start)
    return Turn(start, calls + sum(1 for i in results if i >= start))


def person_asked(messages: Sequence[dict[str, Any]], turn: Turn, phrases: Sequence[str]) -> bool:
    message = messages[turn.start] if messages else {}
    content = message.get("content") if message.get("role") == "user" else None
    return bool(_asking(tuple(phrases)).search(_text_of(content)))


def _text_of(content: Any) -> str:
    """A message's text: the string, or its text parts one per line (an Anthropic client's blocks, a chat client
    sending parts); images and other parts say nothing a phrase could match."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return "\n".join(str(p.get("text", "")) for p in parts if isinstance(p, dict) and p.get("type") == "text")


_ACTIONS = r"\s+(?:status|clear|commit)\b"
"""``ctx`` alone is a variable name in half the code a person pastes: it counts only as ``ctx <action>``."""


@functools.lru_cache(maxsize=8)
def _asking(phrases: tuple[str, ...]) -> re.Pattern[str]:
    """One pattern for the phrases and the tool names, each a whole word (not inside an identifier, a path or a
    dotted name: ``ctxproxy``, ``ctx.state``, ``my_ctx`` do not count)."""
    names = [re.escape(n) + (_ACTIONS if n == "ctx" else "") for n in sorted(TOOL_NAMES)]
    words = [re.escape(p.strip()) for p in phrases if p.strip()] + names
    return re.compile(r"(?<![\w./-])(?:" + "|".join(words) + r")(?![\w/-]|\.\w)", re.I)


def with_context_tools(agent_tools: list[Any] | None,
                       ours: Sequence[dict[str, Any]] = CONTEXT_TOOLS) -> list[Any]:
    """The agent's tools, then ours (an agent tool of the same name wins: we do not shadow it)."""
    own = list(agent_tools or [])
    taken = {t.get("function", {}).get("name") for t in own if isinstance(t, dict)}
    return own + [t for t in ours if t["function"]["name"] not in taken]


@dataclass(frozen=True)
class Split:
    context: list[dict[str, Any]]
    agent: list[dict[str, Any]]


def split_calls(message: dict[str, Any], shadowed: frozenset[str] = frozenset()) -> Split:
    """An answer's tool calls: the ones addressed to the proxy's context tools, and the agent's own."""
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    ours = [c for c in calls if (c.get("function") or {}).get("name") in TOOL_NAMES - shadowed]
    return Split(ours, [c for c in calls if c not in ours])
