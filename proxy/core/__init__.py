"""The pure core: what the agent sent → what the model should see. No I/O, clock, SQL or global config.

``project`` (``project.py``) is the entry point; ``cuts`` holds elision and folding, ``stubs`` the exact texts put
in place of what was cut, ``invariants`` the checks of DESIGN.md §6, ``tokens`` counting and calibration.
"""

from ctxproxy.proxy.core.budget import Budget, Limits
from ctxproxy.proxy.core.decisions import Decision, OverflowWrite
from ctxproxy.proxy.core.folds import fold_body
from ctxproxy.proxy.core.identity import canonical_json, content_hash, fingerprint, message_hash, message_ids
from ctxproxy.proxy.core.invariants import broken_pairs, violations, violations_since
from ctxproxy.proxy.core.project import Projection, Report, project
from ctxproxy.proxy.core.state import Rules, State

__all__ = [
    "Budget", "Decision", "Limits", "OverflowWrite", "Projection", "Report", "Rules", "State", "broken_pairs",
    "canonical_json", "content_hash", "fingerprint", "fold_body", "message_hash", "message_ids", "project",
    "violations",
    "violations_since",
]
