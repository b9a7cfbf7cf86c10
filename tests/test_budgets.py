"""The budget the core obeys comes from plain values: ``Limits`` resolved against a window; the settings are read
outside the core (``proxy.engine.budgets``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ctxproxy.config import load_settings
from ctxproxy.proxy.core import Limits
from ctxproxy.proxy.core.budget import MIN_CUT_CHARS
from ctxproxy.proxy.engine.budgets import budget_for, limits_of

ROOT = Path(__file__).resolve().parents[1]


def test_the_core_resolves_automatic_limits_against_the_window() -> None:
    limits = Limits(reserve=8192, budget=0, target=0, spill_chars=0, keep_results=5, fold_history=True,
                    keep_tool_rounds=3, paste_chars=0)
    small, large = limits.for_window(4096), limits.for_window(1_000_000)
    assert (small.reserve, small.budget, small.target, small.spill_chars) == (1024, 3072, 2150, MIN_CUT_CHARS)
    assert (large.budget, large.target, large.spill_chars) == (200_000, 140_000, 20_000)
    assert small.paste_chars > 2**60  # 0: nothing is ever a paste


def test_the_settings_give_the_same_budget_through_plain_values() -> None:
    settings = load_settings(env={"CTXPROXY_CONTEXT_BUDGET": "50000", "CTXPROXY_SPILL_CHARS": "9000"})
    assert budget_for(settings, 131072) == limits_of(settings).for_window(131072)
    assert (budget_for(settings, 131072).budget, budget_for(settings, 131072).spill_chars) == (50000, 9000)


def test_importing_the_core_loads_no_settings_store_or_http_layer() -> None:
    probe = ("import sys, ctxproxy.proxy.core, ctxproxy.proxy.core.tokens, ctxproxy.proxy.core.fenced; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'httpx') "
             "or m.startswith(('ctxproxy.config', 'ctxproxy.store')) "
             "or (m.startswith('ctxproxy.proxy.') and not m.startswith('ctxproxy.proxy.core'))))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
