"""Per-tier counters, gauges and latency histograms.

Plain thread-safe counters that ``CacheEngine.stats()`` returns as a dict, exported to
Prometheus through a collector on a registry of the caller's choosing (no global state, so
several engines can live in one process).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

COUNTERS = (
    "hits",
    "misses",
    "bytes_in",  # bytes written into the tier
    "bytes_out",  # bytes read out of the tier
    "stores",
    "evictions",
    "corrupt",
    "unauthenticated",  # chunks refused by the fleet key (forged, altered, or unkeyed): misses
    "errors",
    "skipped_stores",  # stores dropped: full, everything pinned, queue full, tier down
    "deletes",
)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1


class TierMetrics:
    """Counters of one tier. Every method is thread-safe."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.gauges: dict[str, float] = {
            "up": 1.0,
            "write_queue_depth": 0.0,
            "bytes_used": 0.0,
            "objects": 0.0,
        }
        self.latency: dict[str, Histogram] = {}
        self.skip_reasons: dict[str, int] = {}

    def skip(self, reason: str, n: int = 1) -> None:
        """Count ``n`` stores dropped, and why (``skipped_stores`` is their total)."""
        with self._lock:
            self.counters["skipped_stores"] = self.counters.get("skipped_stores", 0) + n
            self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + n

    def inc(self, name: str, value: int = 1) -> None:
        if name == "skipped_stores":  # every skipped store says why (issue #25)
            raise ValueError("count a skipped store with skip(reason), not inc")
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + value

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self.gauges[name] = float(value)

    def observe(self, op: str, seconds: float) -> None:
        with self._lock:
            hist = self.latency.get(op)
            if hist is None:
                hist = self.latency[op] = Histogram()
            hist.observe(seconds)

    @contextmanager
    def timed(self, op: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.observe(op, time.perf_counter() - t0)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
            out.update(self.gauges)
            out["skipped_by_reason"] = dict(self.skip_reasons)
            out["latency"] = {
                op: {"count": h.n, "sum_s": h.total, "mean_s": h.total / h.n if h.n else 0.0}
                for op, h in self.latency.items()
            }
            return out


def prometheus_collector(
    metrics: dict[str, TierMetrics],
    prefix: str = "kvmesh",
    costs: Callable[[], dict[str, Any]] | None = None,
) -> Any:
    """A ``prometheus_client`` collector exporting ``metrics`` (imported lazily), and the
    engine's measured load costs when ``costs`` (``CacheEngine.cost_figures``) is given."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    class _Collector:
        def collect(self) -> Iterator[Any]:
            if costs is not None:
                yield from cost_families(costs(), prefix)
            snaps = {name: m for name, m in metrics.items()}
            for counter in COUNTERS:
                fam = CounterMetricFamily(f"{prefix}_{counter}", f"kvmesh tier {counter}", labels=["tier"])
                for name, m in snaps.items():
                    fam.add_metric([name], m.counters.get(counter, 0))
                yield fam
            for gauge in ("up", "write_queue_depth", "bytes_used", "objects"):
                gfam = GaugeMetricFamily(f"{prefix}_tier_{gauge}", f"kvmesh tier {gauge}", labels=["tier"])
                for name, m in snaps.items():
                    gfam.add_metric([name], m.gauges.get(gauge, 0.0))
                yield gfam
            sfam = CounterMetricFamily(
                f"{prefix}_skipped_stores_by_reason",
                "kvmesh stores dropped, by reason",
                labels=["tier", "reason"],
            )
            for name, m in snaps.items():
                with m._lock:
                    for reason, n in m.skip_reasons.items():
                        sfam.add_metric([name, reason], n)
            yield sfam
            hfam = HistogramMetricFamily(
                f"{prefix}_op_latency_seconds", "kvmesh tier operation latency", labels=["tier", "op"]
            )
            for name, m in snaps.items():
                with m._lock:
                    for op, h in m.latency.items():
                        cum, buckets = 0, []
                        for bound, count in zip(h.buckets, h.counts, strict=False):
                            cum += count
                            buckets.append((str(bound), cum))
                        buckets.append(("+Inf", h.n))
                        hfam.add_metric([name, op], buckets, h.total)
            yield hfam

    return _Collector()


# The measured load costs (kvmesh.core.loadcost) as Prometheus series: name, help, key.
COST_TIER_GAUGES = (
    (
        "tier_load_bytes_per_second",
        "observed load throughput of a tier (fitted per load)",
        "load_bytes_per_s",
    ),
    ("tier_load_latency_seconds", "observed per-load latency of a tier (fitted per load)", "load_latency_s"),
)


def cost_families(fig: dict[str, Any], prefix: str = "kvmesh") -> Iterator[Any]:
    """Metric families of one engine's :meth:`CacheEngine.cost_figures`."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for name, doc, key in COST_TIER_GAUGES:
        fam = GaugeMetricFamily(f"{prefix}_{name}", f"kvmesh {doc}", labels=["tier"])
        for tier, t in fig.get("tiers", {}).items():
            fam.add_metric([tier], float(t[key]))
        yield fam
    cap = GaugeMetricFamily(
        f"{prefix}_tier_capacity_bytes",
        "kvmesh tier byte budget (absent: unbounded or unknown)",
        labels=["tier"],
    )
    for tier, u in fig.get("use", {}).items():
        if u.get("capacity_bytes"):
            cap.add_metric([tier], float(u["capacity_bytes"]))
    yield cap
    rate = fig.get("prefill_tokens_per_s")
    g = GaugeMetricFamily(
        f"{prefix}_prefill_tokens_per_second", "kvmesh engine prefill rate (learned or configured)"
    )
    if rate:
        g.add_metric([], float(rate))
    yield g
    yield GaugeMetricFamily(
        f"{prefix}_kv_bytes_per_token",
        "kvmesh KV bytes per token (this shard)",
        value=float(fig["bytes_per_token"]),
    )
    yield CounterMetricFamily(
        f"{prefix}_skipped_load_tokens",
        "kvmesh tokens a lookup found but left to recompute (loading them was predicted slower)",
        value=float(fig.get("skipped_load_tokens", 0)),
    )
