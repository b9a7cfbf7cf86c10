"""Prometheus metrics (``GET /metrics``) and the scorecard's aggregate means.

Counters live in a registry of the app's own (not the process-global one), so two apps in one process — the
tests run many — never share or double-register them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest

from proxy.answers import usage_figure

__all__ = ["Metrics", "aggregate"]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("ctxproxy_requests", "Chat requests answered, by outcome", ["outcome"],
                                registry=self.registry)
        self.tokens = Counter("ctxproxy_tokens", "Tokens the upstream reported, by kind", ["kind"],
                              registry=self.registry)
        self.decisions = Counter("ctxproxy_decisions", "Cuts and pins decided, by kind", ["kind"],
                                 registry=self.registry)
        self.context_ops = Counter("ctxproxy_context_ops", "Context tool calls executed, by op and result",
                                   ["op", "ok"], registry=self.registry)
        self.tokens_freed = Counter("ctxproxy_tokens_freed", "Tokens freed by the model's context tools",
                                    registry=self.registry)

    def answered(self, outcome: str, usage: dict[str, object] | None) -> None:
        self.requests.labels(outcome).inc()
        for kind in ("prompt_tokens", "completion_tokens"):
            value = usage_figure(usage, kind)  # an upstream's -5 would make prometheus raise: it counts as unknown
            if value is not None:
                self.tokens.labels(kind.removesuffix("_tokens")).inc(value)

    def decided(self, kinds: Sequence[str]) -> None:
        for kind in kinds:
            self.decisions.labels(kind).inc()

    def context_op(self, op: str, ok: bool, tokens_freed: int) -> None:
        self.context_ops.labels(op, str(ok).lower()).inc()
        self.tokens_freed.inc(tokens_freed)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def aggregate(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Means over the rows that carry each figure (a row without usage figures does not count as zero)."""
    out: dict[str, float | None] = {}
    for key in ("input_tokens", "total_tokens", "tokens_per_tool_call", "tokens_per_round"):
        values = [r[key] for r in rows if r.get(key)]
        out[f"avg_{key}"] = round(sum(values) / len(values), 1) if values else None
    return out
