"""The numbers a projection obeys, derived once per request from the configured limits and the model's window.

DESIGN.md §3. The physical window and the economic budget are different limits: elision starts above the budget
and cuts down to the target (hysteresis: one deep cut, then nothing changes for many requests, so the upstream's
prefix cache survives). The reserve keeps room for the next answer; on a small window it shrinks to a quarter of
the window, or a 4k model would have no budget at all.

The core takes plain values: ``Limits`` is what the operator configured (0 where it is automatic), and
``Limits.for_window`` resolves it against a window. Reading them from the settings is the caller's business
(``proxy.engine.budgets.budget_for``), so the core imports no configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MIN_CUT_CHARS", "Budget", "Limits", "len_max"]

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


@dataclass(frozen=True)
class Limits:
    """The budget as configured, before the window is known; 0 means automatic where a field says so."""

    reserve: int
    """Tokens kept for the next answer (at most a quarter of the window)."""
    budget: int
    """0: 100k on a window up to 300k, else 200k (never above the window less the reserve)."""
    target: int
    """0: 70 % of the budget."""
    spill_chars: int
    """0: about a tenth of the budget, in characters."""
    keep_results: int
    fold_history: bool
    keep_tool_rounds: int
    paste_chars: int
    """0: no message is ever taken for a paste."""

    def for_window(self, window: int) -> Budget:
        """The budget on a window of ``window`` tokens."""
        reserve = min(self.reserve, window // 4)
        auto = 100_000 if window <= 300_000 else 200_000
        budget = min(self.budget or auto, window - reserve)
        target = min(self.target or budget * 7 // 10, budget)
        # "about a tenth of the budget in characters": one result can never take more than that on ingest.
        spill = self.spill_chars or max(MIN_CUT_CHARS, budget // 10)
        return Budget(window, budget, target, reserve, self.keep_results, spill, self.fold_history,
                      self.keep_tool_rounds, self.paste_chars or len_max())


def len_max() -> int:
    """``paste_chars = 0``: no message is ever taken for a paste."""
    return 2**62
