"""What a refusal says when a request cannot fit: the numbers, and what takes the room.

A request that does not fit the budget after every cut (``proxy.engine.planning``), or that the upstream refused as
too long twice (``proxy.engine.forward``), gets an error the person can act on: the total and the budget in one
unit, the largest items, and the fixed part when that alone is over the budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ctxproxy.proxy.core import Projection, Rules

__all__ = ["describe_overflow", "what_takes_room"]


def describe_overflow(p: Projection, messages: list[Any], rules: Rules) -> str:
    """Why a request cannot fit: the numbers, and the biggest items still in it, all in the model's tokens (the
    calibrated ratio applied to the total and to every item alike, so that the items add up to the total); and the
    fixed part (system prompt, tool definitions) when that alone is over the budget, since no cut can help then."""
    report = p.report
    unit = "tokens" if rules.k == 1 else f"tokens as the model counts them (ctxproxy's count × {rules.k:.2f})"
    return (f"This conversation does not fit the context budget even after ctxproxy cut everything it may: about "
            f"{report.scaled} {unit} against a budget of {report.budget} (window {report.window}). What takes the "
            f"room: {what_takes_room(report.largest, messages, p.state.ids, rules.scaled)}."
            f"{fixed_part(p.state.counts, messages, rules)} System messages, the person's messages, pinned items and "
            "the newest result are never cut. Raise ctx_window or context_budget, lower context_reserve, or start a "
            "new session.")


def fixed_part(counts: Sequence[int], messages: list[Any], rules: Rules) -> str:
    """The sentence naming what no cut can touch, when that alone exceeds the budget ("" otherwise)."""
    system = sum(n for n, m in zip(counts, messages, strict=False) if m.get("role") in ("system", "developer"))
    fixed = rules.scaled(system + rules.tools_tokens)
    if fixed <= rules.budget.budget:
        return ""
    parts = [f"the system prompt ({rules.scaled(system)} tokens)" if system else "",
             f"the tool definitions ({rules.scaled(rules.tools_tokens)} tokens)" if rules.tools_tokens else ""]
    named = " and ".join(x for x in parts if x)
    return (f" The fixed part alone, {named}, is {fixed} tokens, over the budget of {rules.budget.budget}: no cut "
            "can make room; shorten it or give the model a larger window.")


def what_takes_room(largest: Sequence[tuple[str, int]], messages: list[Any], ids: list[str],
                    scaled: Callable[[int], int]) -> str:
    """The biggest items, each in the same unit as the total the refusal states (``scaled``: ctxproxy's count
    times the calibrated ratio)."""
    where = {mid: i for i, mid in enumerate(ids)}
    items = []
    for mid, tokens in largest:
        if mid == "tools":
            items.append(f"the tool definitions ({scaled(tokens)} tokens)")
            continue
        i = where.get(mid, -1)
        role = messages[i].get("role", "?") if i >= 0 else "?"
        items.append(f"message {i} ({role}, {mid}: {scaled(tokens)} tokens)")
    return "; ".join(items)

