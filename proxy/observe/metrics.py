"""Prometheus metrics (``GET /metrics``) and the scorecard's aggregate means.

The counters are plain numbers the app owns (one ``Metrics`` per app, so the tests' many apps in one process never
share them); ``prometheus_client`` renders them in its standard exposition when ``/metrics`` is first scraped.
It is not imported before (about 20 ms of a start, issue #13), and a request adds to a dict, not to a
prometheus child behind a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ctxproxy.proxy.upstream.answers import usage_figure

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["Metrics", "aggregate"]

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""From a millisecond (the proxy's own time on a small request) to minutes (a long answer from a local model)."""


@dataclass
class _Counter:
    """One counter family: its value per label values, and when each was first counted (``_created``)."""

    name: str
    help: str
    labels: tuple[str, ...] = ()
    values: dict[tuple[str, ...], float] = field(default_factory=dict)
    created: dict[tuple[str, ...], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.labels:  # an unlabelled counter is there, at 0, from the start (as prometheus_client's)
            self._child(())

    def inc(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        if amount < 0:  # as prometheus_client's Counter: a counter that went down would read as a restart
            raise ValueError(f"{self.name} can only go up, not by {amount}")
        self._child(key)
        self.values[key] += amount

    def _child(self, key: tuple[str, ...]) -> None:
        if key not in self.values:
            self.values[key], self.created[key] = 0.0, time.time()


@dataclass
class _Histogram:
    """One unlabelled histogram: cumulative counts per upper bound (``le``), their sum, when it was created."""

    name: str
    help: str
    buckets: tuple[float, ...] = _SECONDS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    created: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last is +Inf

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        self.counts[index] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        bounds = [*(repr(float(b)) for b in self.buckets), "+Inf"]
        running, out = 0, []
        for bound, count in zip(bounds, self.counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out


class Metrics:
    def __init__(self) -> None:
        self.requests = _Counter("ctxproxy_requests", "Chat requests answered, by outcome", ("outcome",))
        self.tokens = _Counter("ctxproxy_tokens", "Tokens the upstream reported, by kind", ("kind",))
        self.decisions = _Counter("ctxproxy_decisions", "Cuts and pins decided, by kind", ("kind",))
        self.context_ops = _Counter("ctxproxy_context_ops", "Context tool calls executed, by op and result",
                                    ("op", "ok"))
        self.tokens_freed = _Counter("ctxproxy_tokens_freed", "Tokens taken out of what goes upstream, by who (auto: "
                                     "the proxy's cuts; model: the context tools) and kind (spill, elide, fold…)",
                                     ("by", "kind"))
        self.upstream_seconds = _Histogram("ctxproxy_upstream_seconds", "Seconds from sending a request upstream "
                                           "to its answer's headers, per round trip")
        self.added_seconds = _Histogram("ctxproxy_added_seconds", "Seconds the proxy itself added to a request: "
                                        "its time before the first byte went upstream (reading, journaling, "
                                        "projecting)")
        self._lock = threading.Lock()
        """Counts come from the event loop; a scrape reads them there too, but a test may read from a thread."""

    def answered(self, outcome: str, usage: dict[str, object] | None) -> None:
        with self._lock:
            self.requests.inc((outcome,))
            for kind in ("prompt_tokens", "completion_tokens"):
                value = usage_figure(usage, kind)  # an upstream's -5 counts as unknown: counters only go up
                if value is not None:
                    self.tokens.inc((kind.removesuffix("_tokens"),), value)

    def decided(self, kinds: Sequence[str], freed: Mapping[str, int]) -> None:
        with self._lock:
            for kind in kinds:
                self.decisions.inc((kind,))
            for kind, tokens in freed.items():
                self.tokens_freed.inc(("auto", kind), tokens)

    def context_op(self, op: str, ok: bool, tokens_freed: int) -> None:
        with self._lock:
            self.context_ops.inc((op, str(ok).lower()))
            self.tokens_freed.inc(("model", op), max(0, tokens_freed))

    def timed(self, added_ms: float | None, upstream_ms: Sequence[float]) -> None:
        """One request's times: what the proxy added before it went upstream, and each round trip's wait."""
        with self._lock:
            if added_ms is not None:
                self.added_seconds.observe(added_ms / 1000)
            for ms in upstream_ms:
                self.upstream_seconds.observe(ms / 1000)

    def answered_count(self) -> float:
        """Chat requests answered so far, whatever their outcome."""
        with self._lock:
            return sum(self.requests.values.values())

    def exposition(self) -> bytes:
        """The Prometheus text format (``prometheus_client.generate_latest``) of every counter."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry)

    def families(self) -> Iterator[Metric]:
        from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily

        with self._lock:
            counters = [(c, dict(c.values), dict(c.created))
                        for c in (self.requests, self.tokens, self.decisions, self.context_ops, self.tokens_freed)]
            histograms = [(h, h.cumulative(), h.total) for h in (self.upstream_seconds, self.added_seconds)]
        for counter, values, created in counters:
            family = CounterMetricFamily(counter.name, counter.help, labels=counter.labels)
            for key, value in values.items():
                family.add_metric(list(key), value, created=created[key])
            yield family
        for histogram, buckets, total in histograms:
            timed = HistogramMetricFamily(histogram.name, histogram.help)
            timed.add_metric([], buckets, total, timestamp=None)
            yield timed


class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self.metrics.families()


def aggregate(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Means over the rows that carry each figure (a row without usage figures does not count as zero)."""
    out: dict[str, float | None] = {}
    for key in ("input_tokens", "total_tokens", "tokens_per_tool_call", "tokens_per_round"):
        values = [r[key] for r in rows if r.get(key)]
        out[f"avg_{key}"] = round(sum(values) / len(values), 1) if values else None
    return out
