"""When the context tools are offered, and how an answer that calls them is split from the agent's own calls.

Offer rule (DESIGN.md §5): tools enabled, and usage ≥ ``offer_pct`` of the window, or the turn's round ≥
``offer_round``, or the person asked (a configured phrase or a tool's name in their latest message). Once offered
they stay offered for the rest of the turn, appended after the agent's own tools, byte-identical each time.
A turn starts at the person's latest message; its rounds are the assistant tool-call rounds since then.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.tools.schemas import CONTEXT_TOOLS, TOOL_NAMES

__all__ = ["Split", "Turn", "person_asked", "split_calls", "turn_of", "with_context_tools"]

REMINDER = ("[ctxproxy] Your context is nearly full. You can free it yourself: context_status shows what takes "
            "the room; context_drop and context_note cut results you no longer need (restorable).")


@dataclass(frozen=True)
class Turn:
    start: int
    """Index of the person's latest message (0 when there is none)."""
    rounds: int
    """Assistant tool-call rounds since then."""


def turn_of(messages: Sequence[dict[str, Any]], results: Collection[int] = ()) -> Turn:
    """``results``: indices of user messages that carry a text-protocol round's results (not the person's)."""
    start = next((i for i in range(len(messages) - 1, -1, -1)
                  if messages[i].get("role") == "user" and i not in results), 0)
    rounds = sum(1 for m in messages[start:] if m.get("role") == "assistant" and m.get("tool_calls"))
    return Turn(start, rounds)


def person_asked(messages: Sequence[dict[str, Any]], turn: Turn, phrases: Sequence[str]) -> bool:
    message = messages[turn.start] if messages else {}
    content = message.get("content") if message.get("role") == "user" else None
    text = (content if isinstance(content, str) else "").lower()
    return any(p.lower() in text for p in phrases) or any(name in text for name in TOOL_NAMES)


def with_context_tools(agent_tools: list[Any] | None) -> list[Any]:
    """The agent's tools, then ours (an agent tool of the same name wins: we do not shadow it)."""
    own = list(agent_tools or [])
    taken = {t.get("function", {}).get("name") for t in own if isinstance(t, dict)}
    return own + [t for t in CONTEXT_TOOLS if t["function"]["name"] not in taken]


@dataclass(frozen=True)
class Split:
    context: list[dict[str, Any]]
    agent: list[dict[str, Any]]


def split_calls(message: dict[str, Any], shadowed: frozenset[str] = frozenset()) -> Split:
    """An answer's tool calls: the ones addressed to the proxy's context tools, and the agent's own."""
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    ours = [c for c in calls if (c.get("function") or {}).get("name") in TOOL_NAMES - shadowed]
    return Split(ours, [c for c in calls if c not in ours])
