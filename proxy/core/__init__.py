"""The pure core: what the agent sent → what the model should see. No I/O, clock, SQL or global config.

``project.project`` is the entry point (imported from its module: the package's ``project`` is the module);
``cuts`` holds elision and folding, ``stubs`` the exact texts put in place of what was cut, ``invariants`` the
checks of DESIGN.md §6, ``tokens`` counting and calibration.

The names below are imported from their modules when first asked for (PEP 562), not with the package: importing
any module of a package runs its ``__init__`` first, and a server's start needs a few of the core's modules (the
body's arrival and pieces), not the projection, whose dataclasses and expressions took about 20 ms of every start
(issue #13: start to ready). The request engine, loaded on the warm-up thread, asks for them there.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ctxproxy.proxy.core.budget import Budget, Limits
    from ctxproxy.proxy.core.decisions import Decision, OverflowWrite
    from ctxproxy.proxy.core.folds import fold_body
    from ctxproxy.proxy.core.identity import canonical_json, content_hash, fingerprint, message_hash, message_ids
    from ctxproxy.proxy.core.invariants import broken_pairs, violations, violations_since
    from ctxproxy.proxy.core.project import Projection, Report
    from ctxproxy.proxy.core.state import Rules, State

_HOMES = {
    "budget": ("Budget", "Limits"),
    "decisions": ("Decision", "OverflowWrite"),
    "folds": ("fold_body",),
    "identity": ("canonical_json", "content_hash", "fingerprint", "message_hash", "message_ids"),
    "invariants": ("broken_pairs", "violations", "violations_since"),
    "project": ("Projection", "Report"),
    "state": ("Rules", "State"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "Budget", "Decision", "Limits", "OverflowWrite", "Projection", "Report", "Rules", "State", "broken_pairs",
    "canonical_json", "content_hash", "fingerprint", "fold_body", "message_hash", "message_ids",
    "violations", "violations_since",
]


def __getattr__(name: str) -> Any:
    """One of ``__all__``: its module is imported and the names it exports kept here (the next lookup is a plain
    attribute). Any other name raises ``AttributeError``: ``from ctxproxy.proxy.core import cuts`` then imports the
    module the usual way."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{home}")
    for exported in _HOMES[home]:
        globals()[exported] = getattr(module, exported)
    return globals()[name]
