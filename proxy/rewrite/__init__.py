"""The pure core: what the agent sent → what the model should see. No I/O, clock, SQL or global config.

``project`` (``project.py``) is the entry point; ``cuts`` holds elision and folding, ``stubs`` the exact texts put
in place of what was cut, ``invariants`` the checks of DESIGN.md §6, ``tokens`` counting and calibration.
"""

from proxy.rewrite.budget import Budget, Limits
from proxy.rewrite.cuts import fold_body
from proxy.rewrite.decisions import Decision, OverflowWrite
from proxy.rewrite.identity import canonical_json, content_hash, fingerprint, message_hash, message_ids
from proxy.rewrite.invariants import broken_pairs, violations
from proxy.rewrite.project import Projection, Report, project
from proxy.rewrite.state import Rules, State

__all__ = [
    "Budget", "Decision", "Limits", "OverflowWrite", "Projection", "Report", "Rules", "State", "broken_pairs",
    "canonical_json", "content_hash", "fingerprint", "fold_body", "message_hash", "message_ids", "project",
    "violations",
]
