"""What a projection did to one request, in tokens: what the agent sent, what goes upstream, and what each kind
of new cut freed. The metrics count it (``ctxproxy_tokens_freed_total{by=…}``) and the request's log line says it.

Counted with the session's own ``MessageCounter`` (ctxproxy's count, before the calibrated ratio), keyed by each
message's identity hash, so a message counted once is not counted again: only a cut message's original is counted
here, and the projection counted most of those already when they came in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ctxproxy.proxy.core import Decision, Projection
from ctxproxy.proxy.core.decisions import CUTS
from ctxproxy.proxy.core.tokens import MessageCounter

__all__ = ["Tally", "tally"]


@dataclass(frozen=True)
class Tally:
    tokens_in: int
    """The agent's messages and tools as it sent them (ctxproxy's count)."""
    tokens_out: int
    """What goes upstream (the projection's estimate)."""
    freed: dict[str, int] = field(default_factory=dict)
    """Tokens this request's new decisions took out, by kind (spill, elide, drop, note, fold)."""
    cuts: dict[str, int] = field(default_factory=dict)
    """This request's new decisions, by kind."""


def tally(p: Projection, messages: Sequence[dict[str, Any]], hashes: Sequence[str], counter: MessageCounter,
          sent: int, budgeted: int) -> Tally:
    """``sent``: the estimate of what goes upstream (the proxy's own tools or note only if listed); ``budgeted``:
    what the projection's estimate holds for them, listed or not (none of it is the agent's)."""
    state = p.state
    removed = [0] * len(state.counts)
    cut = [i for i, (out_hash, in_hash, out) in enumerate(zip(state.out_hashes, state.hashes, state.out, strict=True))
           if out_hash != in_hash or out is None]
    originals = counter.count_all([messages[i] for i in cut], [hashes[i] for i in cut])
    for i, original in zip(cut, originals, strict=True):
        removed[i] = original - state.counts[i]  # a fold's stub: less than 0
    cuts: dict[str, int] = {}
    for d in p.new:
        cuts[d.kind] = cuts.get(d.kind, 0) + 1
    return Tally(p.report.estimate - budgeted + sum(removed), sent, _freed(p.new, state.ids, removed), cuts)


def _freed(new: Sequence[Decision], ids: Sequence[str], removed: Sequence[int]) -> dict[str, int]:
    """What each new cut took out: the tokens its message lost; a fold, every message of its span (a result elided
    and folded by the same request counts once, for the fold), so that the kinds add up to what was freed."""
    if not new:
        return {}
    where = {mid: i for i, mid in enumerate(ids)}
    spans = {d.target: (where[d.target], where[d.target] + d.count) for d in new
             if d.kind == "fold" and d.target in where}
    claimed = {i for start, end in spans.values() for i in range(start, end)}
    freed: dict[str, int] = {}
    for d in new:
        i = where.get(d.target)
        if i is None or d.kind not in CUTS | {"fold"} or (d.kind != "fold" and i in claimed):
            continue
        start, end = spans.get(d.target, (i, i + 1)) if d.kind == "fold" else (i, i + 1)
        freed[d.kind] = freed.get(d.kind, 0) + sum(removed[start:end])
    return {kind: max(0, tokens) for kind, tokens in freed.items()}
