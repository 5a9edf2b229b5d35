"""The cost model on Prometheus: its accuracy, and the signal for autoscalers.

Registered on the router's own registry when ``policy: cost``:

``kvmesh_router_ttft_prediction_error_ratio`` (histogram)
    ``|predicted - observed| / observed`` of every request whose first byte came back.
``kvmesh_router_predicted_ttft_seconds{replica}`` / ``kvmesh_router_fleet_predicted_ttft_seconds``
    The TTFT a typical new request (the recent mean prompt, nothing cached) would get on each
    replica if sent now, and the best of them: what the next request can expect. It grows
    with queued prefill work and running decodes, in seconds, at the fitted rates; an
    autoscaler adds replicas when even the best replica predicts more than its target.
``kvmesh_router_kv_usage_ratio{replica,tier}`` / ``kvmesh_router_fleet_kv_usage_ratio{tier}``
    KV use per tier: ``gpu`` (vLLM's gauge), ``cpu``, ``disk`` (what the replica's kvmesh
    tiers report), and ``all``: bytes used over capacity across the kvmesh tiers that have a
    capacity. GPU use alone reads ~95% for ever once offloading is on; ``all`` rises only
    when the working set outgrows the fleet's memory.
``kvmesh_router_fitted_prefill_tokens_per_second{replica}``
    Each replica's fitted prefill rate.

Gauges are computed when scraped (a custom collector): nothing is paid per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Histogram

from kvmesh.routing.cost import CostModel
from kvmesh.routing.fit import COMPUTE
from kvmesh.routing.scorers import ReplicaState
from kvmesh.routing.table import ReplicaTable

ERROR_BUCKETS = (0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 5.0)
TIERS = ("cpu", "disk")  # kvmesh tiers with a per-replica capacity (the shared tier has none)


def kv_usage(model: CostModel, states: Sequence[ReplicaState]) -> dict[str, dict[str, float]]:
    """Per replica, per tier, the fraction of KV capacity in use (see the module docstring)."""
    out: dict[str, dict[str, float]] = {}
    for s in states:
        row: dict[str, float] = {}
        if s.kv_usage is not None and np.isfinite(s.kv_usage):
            row["gpu"] = min(max(float(s.kv_usage), 0.0), 1.0)
        fit = model.fits.get(s.name)
        use = fit.report.use if fit is not None and fit.report is not None else {}
        used = cap = 0.0
        for tier in TIERS:
            u = use.get(tier)
            if u is None or not u[1]:
                continue
            row[tier] = min(u[0] / u[1], 1.0)
            used, cap = used + min(u[0], u[1]), cap + u[1]
        if cap > 0:
            row["all"] = used / cap
        out[s.name] = row
    return out


def fleet_usage(model: CostModel, states: Sequence[ReplicaState]) -> dict[str, float]:
    """Fleet-wide: GPU as the mean of the replicas', kvmesh tiers as bytes over bytes."""
    out: dict[str, float] = {}
    gpu = [float(s.kv_usage) for s in states if s.kv_usage is not None and np.isfinite(s.kv_usage)]
    if gpu:
        out["gpu"] = float(np.clip(np.mean(gpu), 0.0, 1.0))
    total_used = total_cap = 0.0
    for tier in TIERS:
        used = cap = 0.0
        for s in states:
            fit = model.fits.get(s.name)
            u = fit.report.use.get(tier) if fit is not None and fit.report is not None else None
            if u is not None and u[1]:
                used, cap = used + min(u[0], u[1]), cap + u[1]
        if cap > 0:
            out[tier] = used / cap
            total_used, total_cap = total_used + used, total_cap + cap
    if total_cap > 0:
        out["all"] = total_used / total_cap
    return out


class CostMetrics:
    """The histogram (observed per request) and the collector (computed per scrape)."""

    def __init__(
        self, model: CostModel, registry: CollectorRegistry, candidates: Callable[[], Sequence[ReplicaState]]
    ) -> None:
        self.model = model
        self.candidates = candidates
        self.error = Histogram(
            "kvmesh_router_ttft_prediction_error_ratio",
            "|predicted - observed| / observed time to first token, per request (policy cost)",
            buckets=ERROR_BUCKETS,
            registry=registry,
        )
        model.on_observation = self._observed
        registry.register(self)

    def _observed(self, name: str, predicted: float, observed: float) -> None:
        if observed > 0:
            self.error.observe(abs(predicted - observed) / observed)

    def describe(self) -> list[Any]:
        return []  # unchecked collector: its families depend on the replicas

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        states = list(self.candidates())
        per = GaugeMetricFamily(
            "kvmesh_router_predicted_ttft_seconds",
            "predicted TTFT of a typical uncached request sent to this replica now",
            labels=["replica"],
        )
        fleet = GaugeMetricFamily(
            "kvmesh_router_fleet_predicted_ttft_seconds",
            "the lowest predicted TTFT of a typical uncached request over the healthy replicas",
        )
        rate = GaugeMetricFamily(
            "kvmesh_router_fitted_prefill_tokens_per_second", "fitted prefill rate", labels=["replica"]
        )
        if states:
            ref = self.model.reference(ReplicaTable.of(states))
            for s, v in zip(states, ref.tolist(), strict=True):
                per.add_metric([s.name], v)
                fit = self.model.fits[s.name]
                rate.add_metric([s.name], 1e3 / float(fit.rls.theta[COMPUTE]))
            fleet.add_metric([], float(ref.min()))
        yield per
        yield fleet
        yield rate
        use = GaugeMetricFamily(
            "kvmesh_router_kv_usage_ratio",
            "KV use of a replica's tier (all: every kvmesh tier)",
            labels=["replica", "tier"],
        )
        for name, row in kv_usage(self.model, states).items():
            for tier, v in row.items():
                use.add_metric([name, tier], v)
        yield use
        fu = GaugeMetricFamily(
            "kvmesh_router_fleet_kv_usage_ratio",
            "KV use of the fleet by tier (all: every kvmesh tier)",
            labels=["tier"],
        )
        for tier, v in fleet_usage(self.model, states).items():
            fu.add_metric([tier], v)
        yield fu
