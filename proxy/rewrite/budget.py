"""The numbers a projection obeys, derived once per request from the settings and the model's window.

DESIGN.md §3. The physical window and the economic budget are different limits: elision starts above the budget
and cuts down to the target (hysteresis: one deep cut, then nothing changes for many requests, so the upstream's
prefix cache survives). The reserve keeps room for the next answer; on a small window it shrinks to a quarter of
the window, or a 4k model would have no budget at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from config import Settings

__all__ = ["MIN_CUT_CHARS", "Budget", "budget_for"]

MIN_CUT_CHARS = 600
"""Results shorter than this are never spilled or elided: their stub would not be smaller."""


@dataclass(frozen=True)
class Budget:
    window: int
    budget: int
    target: int
    reserve: int
    keep_results: int
    spill_chars: int
    fold_history: bool
    keep_tool_rounds: int = 3
    """Text-protocol agents: the newest rounds whose results auto-elision never touches."""
    paste_chars: int = 20_000
    """A person's pasted attachment above this goes to overflow like a tool result."""

    @property
    def preview_head(self) -> int:
        """Characters of a spilled result's head kept in its place."""
        return self.spill_chars // 4

    @property
    def preview_tail(self) -> int:
        return self.spill_chars // 6


def budget_for(settings: Settings, window: int) -> Budget:
    """``settings`` already resolved for the model (``Settings.for_model``); ``window`` in tokens."""
    reserve = min(settings.context_reserve, window // 4)
    auto = 100_000 if window <= 300_000 else 200_000
    budget = min(settings.context_budget or auto, window - reserve)
    target = min(settings.context_target or budget * 7 // 10, budget)
    # "about a tenth of the budget in characters": one result can never take more than that on ingest.
    spill = settings.spill_chars or max(MIN_CUT_CHARS, budget // 10)
    return Budget(window, budget, target, reserve, settings.keep_results, spill, settings.fold_history,
                  settings.keep_tool_rounds, settings.paste_chars or len_max())


def len_max() -> int:
    """``paste_chars = 0``: no message is ever taken for a paste."""
    return 2**62
