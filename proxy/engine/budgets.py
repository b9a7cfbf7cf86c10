"""The settings' budget keys as the plain values the rewrite core takes (``proxy.core.budget.Limits``).

The core never sees ``Settings`` (it imports no configuration): whoever projects — the request path, ``ctxproxy
replay``, the benchmarks — turns the model's settings into ``Limits`` here and resolves them against the window.
"""

from __future__ import annotations

from ctxproxy.config import Settings
from ctxproxy.proxy.core.budget import Budget, Limits

__all__ = ["budget_for", "limits_of"]


def limits_of(settings: Settings) -> Limits:
    """``settings`` already resolved for the model (``Settings.for_model``)."""
    return Limits(settings.context_reserve, settings.context_budget, settings.context_target, settings.spill_chars,
                  settings.keep_results, settings.fold_history, settings.keep_tool_rounds, settings.paste_chars)


def budget_for(settings: Settings, window: int) -> Budget:
    """The budget of ``settings`` (resolved for the model) on a window of ``window`` tokens."""
    return limits_of(settings).for_window(window)
