"""Prometheus metrics (``GET /metrics``) and the scorecard's aggregate means.

Counters live in a registry of the app's own (not the process-global one), so two apps in one process — the
tests run many — never share or double-register them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from proxy.answers import usage_figure

__all__ = ["Metrics", "aggregate"]

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""From a millisecond (the proxy's own time on a small request) to minutes (a long answer from a local model)."""


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
        self.tokens_freed = Counter("ctxproxy_tokens_freed", "Tokens taken out of what goes upstream, by who (auto: "
                                    "the proxy's cuts; model: the context tools) and kind (spill, elide, fold…)",
                                    ["by", "kind"], registry=self.registry)
        self.upstream_seconds = Histogram("ctxproxy_upstream_seconds", "Seconds from sending a request upstream to "
                                          "its answer's headers, per round trip", registry=self.registry,
                                          buckets=_SECONDS)
        self.added_seconds = Histogram("ctxproxy_added_seconds", "Seconds the proxy itself added to a request: "
                                       "its time before the first byte went upstream (reading, journaling, "
                                       "projecting)", registry=self.registry, buckets=_SECONDS)

    def answered(self, outcome: str, usage: dict[str, object] | None) -> None:
        self.requests.labels(outcome).inc()
        for kind in ("prompt_tokens", "completion_tokens"):
            value = usage_figure(usage, kind)  # an upstream's -5 would make prometheus raise: it counts as unknown
            if value is not None:
                self.tokens.labels(kind.removesuffix("_tokens")).inc(value)

    def decided(self, kinds: Sequence[str], freed: Mapping[str, int]) -> None:
        for kind in kinds:
            self.decisions.labels(kind).inc()
        for kind, tokens in freed.items():
            self.tokens_freed.labels("auto", kind).inc(tokens)

    def context_op(self, op: str, ok: bool, tokens_freed: int) -> None:
        self.context_ops.labels(op, str(ok).lower()).inc()
        self.tokens_freed.labels("model", op).inc(max(0, tokens_freed))

    def timed(self, added_ms: float | None, upstream_ms: Sequence[float]) -> None:
        """One request's times: what the proxy added before it went upstream, and each round trip's wait."""
        if added_ms is not None:
            self.added_seconds.observe(added_ms / 1000)
        for ms in upstream_ms:
            self.upstream_seconds.observe(ms / 1000)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def aggregate(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Means over the rows that carry each figure (a row without usage figures does not count as zero)."""
    out: dict[str, float | None] = {}
    for key in ("input_tokens", "total_tokens", "tokens_per_tool_call", "tokens_per_round"):
        values = [r[key] for r in rows if r.get(key)]
        out[f"avg_{key}"] = round(sum(values) / len(values), 1) if values else None
    return out
