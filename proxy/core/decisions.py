"""Decisions: what the projection changes, keyed by message identity, journaled, and re-applied to every request.

A decision never names a position. It names a message (``target``: its identity, see ``identity.message_ids``)
and the exact message it was made for (``message_hash``): if the agent later sends a different message under the
same identity, the decision no longer applies. ``replacement`` is the exact text put in the message's place, so
a stub is byte-identical on every request, whatever code wrote it. ``overflow_id`` is the sha256 of the bytes
removed, stored in the overflow store before the projection is forwarded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CUTS", "Decision", "Kind", "OverflowWrite"]

Kind = Literal["spill", "elide", "drop", "note", "fold", "hide", "pin", "unpin", "restore"]
"""``restore``: the operator's, from the inspector: the cut of ``target`` no longer applies; the message goes whole
until the rules cut it afresh (over budget, the elision may take it again: a pin keeps it)."""
CUTS = frozenset({"spill", "elide", "drop", "note"})
"""Decisions that replace one message's content (re-applied by identity on every request)."""


@dataclass(frozen=True)
class Decision:
    kind: Kind
    target: str
    message_hash: str = ""
    replacement: str = ""
    """The exact text put in place of the content; for a model pin, its ``[model] `` excerpt."""
    overflow_id: str = ""
    until: str = ""
    """fold: identity of the last message folded."""
    count: int = 0
    """fold: how many messages the stub stands for."""
    source: str = "auto"
    """auto (the rules), operator (the /ctx API) or model (a context tool)."""


@dataclass(frozen=True)
class OverflowWrite:
    """A body the caller must store (content-addressed, under the session) before forwarding the projection.

    A body the journal holds already is named rather than stored again: ``span`` is the ``[start, end)`` of the
    request's own messages it is made of. ``part`` "messages": a fold, the canonical JSON array of those messages
    (``fold_body``), whose sha256 ``overflow_id`` is; ``body`` is empty and ``size`` is its byte length (a fold
    stored its whole span again, and each later fold the longer span: the journal grew with the square of the
    session). ``part`` "content": one tool result's whole content (spilled or elided), also in ``body``."""

    overflow_id: str
    body: str
    tool: str
    call_id: str
    span: tuple[int, int] | None = None
    size: int = 0
    part: Literal["messages", "content"] = "messages"
