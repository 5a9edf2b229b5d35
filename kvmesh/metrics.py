"""Per-tier counters, gauges and latency histograms.

Plain thread-safe counters that ``CacheEngine.stats()`` returns as a dict, exported to
Prometheus through a collector on a registry of the caller's choosing (no global state, so
several engines can live in one process).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator
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

    def inc(self, name: str, value: int = 1) -> None:
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
            out["latency"] = {
                op: {"count": h.n, "sum_s": h.total, "mean_s": h.total / h.n if h.n else 0.0}
                for op, h in self.latency.items()
            }
            return out


def prometheus_collector(metrics: dict[str, TierMetrics], prefix: str = "kvmesh") -> Any:
    """A ``prometheus_client`` collector exporting ``metrics`` (imported lazily)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    class _Collector:
        def collect(self) -> Iterator[Any]:
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
