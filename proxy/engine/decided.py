"""A projection's new decisions as the journal keeps them: each with the forwarded message it put its text in.

A spill's stub, an elision's marker or a fold's stub is the whole content of a message that goes upstream, and the
journal stores that message with the forward; a decision naming it (``replaced_by``: its hash) is not stored with
the text again (``store.cuts``, migration ``m013``). Only a match checked here is named: the forwarded message at
the decision's place whose content is the replacement, exactly; any other decision keeps its text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ctxproxy.proxy.core.decisions import Decision
from ctxproxy.proxy.core.state import State

__all__ = ["decision_rows"]


def decision_rows(decisions: Sequence[Decision], state: State, sent: Sequence[dict[str, Any]],
                  hashes: Sequence[str]) -> list[dict[str, Any]]:
    """``decisions`` as journal rows (``Journal.insert_decisions``); ``sent`` and ``hashes``: what went upstream."""
    rows = []
    for decision in decisions:
        row = asdict(decision)
        holder = _holder(decision, state, sent, hashes)
        if holder is not None:
            row["replaced_by"] = holder
        rows.append(row)
    return rows


def _holder(decision: Decision, state: State, sent: Sequence[dict[str, Any]], hashes: Sequence[str]) -> str | None:
    """The hash of the forwarded message whose content is the decision's replacement, whole (None: none is)."""
    if not decision.replacement:
        return None
    try:
        at = hashes.index(state.out_hashes[state.ids.index(decision.target)])
    except (ValueError, IndexError):
        return None
    content = sent[at].get("content")
    return hashes[at] if isinstance(content, str) and content == decision.replacement else None
