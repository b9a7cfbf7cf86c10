"""A projection's new decisions as the journal keeps them: each with the forwarded message it put its text in.

A spill's stub, an elision's marker or a fold's stub is the whole content of a message that goes upstream, and the
journal stores that message with the forward; a decision naming it (``replaced_by``: its hash) is not stored with
the text again (``store.cuts``, migration ``m013``). Only a match checked here is named: the forwarded message at
the decision's place whose content is the replacement, exactly; any other decision keeps its text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from ctxproxy.proxy.core.decisions import Decision
from ctxproxy.proxy.core.state import State

__all__ = ["decision_rows"]


def decision_rows(decisions: Sequence[Decision], state: State, sent: Sequence[dict[str, Any]],
                  hashes: Sequence[str]) -> list[dict[str, Any]]:
    """``decisions`` as journal rows (``Journal.insert_decisions``); ``sent`` and ``hashes``: what went upstream.
    Each message is looked up once for all of them: a fold pass makes dozens of decisions over a long history, and
    finding each one's place by scanning (and copying it with ``dataclasses.asdict``) was ~2 ms of it (issue #13)."""
    places = _places(decisions, state, hashes)
    rows = []
    for decision in decisions:
        row = {name: getattr(decision, name) for name in _FIELDS}
        holder = _holder(decision, places, sent, hashes)
        if holder is not None:
            row["replaced_by"] = holder
        rows.append(row)
    return rows


_FIELDS = tuple(f.name for f in fields(Decision))


def _places(decisions: Sequence[Decision], state: State, hashes: Sequence[str]) -> dict[str, int]:
    """Where in what went upstream the message of each decision with a replacement stands (its first place), by
    the decision's target; a message not sent is not there."""
    targets = {d.target for d in decisions if d.replacement}
    first: dict[str, int] = {}
    for i, mid in enumerate(state.ids):
        if mid in targets and mid not in first:
            first[mid] = i
    wanted = {state.out_hashes[i] for i in first.values() if i < len(state.out_hashes)}
    sent_at: dict[str, int] = {}
    for at, digest in enumerate(hashes):
        if digest in wanted and digest not in sent_at:
            sent_at[digest] = at
    return {mid: sent_at[state.out_hashes[i]] for mid, i in first.items()
            if i < len(state.out_hashes) and state.out_hashes[i] in sent_at}


def _holder(decision: Decision, places: dict[str, int], sent: Sequence[dict[str, Any]],
            hashes: Sequence[str]) -> str | None:
    """The hash of the forwarded message whose content is the decision's replacement, whole (None: none is)."""
    at = places.get(decision.target) if decision.replacement else None
    if at is None:
        return None
    content = sent[at].get("content")
    return hashes[at] if isinstance(content, str) and content == decision.replacement else None
