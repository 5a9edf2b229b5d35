"""kvmesh's measured costs on vLLM's own ``/metrics`` (the connector-stats path of vLLM v1).

The worker hands :meth:`kvmesh.core.engine.CacheEngine.cost_figures` to vLLM at most once a
second as a :class:`KVMeshStats`; vLLM carries it to its API server, which calls
:meth:`KVMeshPromMetrics.observe`. So a replica's tier load throughput and latency, its
prefill rate, its KV bytes per token and every tier's use appear beside ``vllm:*`` on the
page the router and Prometheus already scrape, as ``kvmesh:*`` gauges labelled like vLLM's
own (plus ``tier``). vLLM started with ``--disable-log-stats`` runs no stat loggers, so
nothing appears there: the router then reads the same figures from the engine's admin API
(``stats``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

INTERVAL_S = 1.0  # figures change slowly; vLLM asks every step
# (name, help, figures key) per tier, then engine-wide
TIER_GAUGES = (
    ("kvmesh:tier_load_bytes_per_second", "kvmesh tier observed load throughput", "load_bytes_per_s"),
    ("kvmesh:tier_load_latency_seconds", "kvmesh tier observed per-load latency", "load_latency_s"),
)
USE_GAUGES = (
    ("kvmesh:tier_bytes_used", "kvmesh tier bytes in use", "bytes_used"),
    ("kvmesh:tier_capacity_bytes", "kvmesh tier byte budget", "capacity_bytes"),
)
ENGINE_GAUGES = (
    (
        "kvmesh:prefill_tokens_per_second",
        "kvmesh engine prefill rate (learned or configured)",
        "prefill_tokens_per_s",
    ),
    ("kvmesh:kv_bytes_per_token", "kvmesh KV bytes per token (one shard)", "bytes_per_token"),
    ("kvmesh:skipped_load_tokens", "kvmesh tokens found but left to recompute", "skipped_load_tokens"),
)


@dataclass
class KVMeshStats(KVConnectorStats):
    """The latest figures (``data["figures"]``); aggregating keeps the newest."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.data.get("at", 0.0) >= self.data.get("at", 0.0):
            self.data = dict(other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        fig = self.data.get("figures") or {}
        out: dict[str, int | float] = {}
        for tier, t in (fig.get("tiers") or {}).items():
            out[f"{tier}_load_MBps"] = round(float(t.get("load_bytes_per_s", 0.0)) / 1e6, 1)
        rate = fig.get("prefill_tokens_per_s")
        if rate:
            out["prefill_tok_per_s"] = round(float(rate))
        return out

    def is_empty(self) -> bool:
        return not self.data


class StatsGate:
    """What the worker returns from ``get_kv_connector_stats``: figures once per interval."""

    def __init__(self, figures: Any, interval_s: float = INTERVAL_S) -> None:
        self._figures = figures
        self._interval = interval_s
        self._next = 0.0

    def take(self) -> KVMeshStats | None:
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self._interval
        return KVMeshStats(data={"at": now, "figures": self._figures()})


class KVMeshPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        tiered = [*labelnames, "tier"]
        self._tier: dict[str, Any] = {
            key: self._gauge_cls(name=name, documentation=doc, labelnames=tiered)
            for name, doc, key in (*TIER_GAUGES, *USE_GAUGES)
        }
        self._engine: dict[str, Any] = {
            key: self._gauge_cls(name=name, documentation=doc, labelnames=labelnames)
            for name, doc, key in ENGINE_GAUGES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        fig = transfer_stats_data.get("figures")
        labels = self.per_engine_labelvalues.get(engine_idx)
        if not isinstance(fig, dict) or labels is None:
            return
        for tier, t in (fig.get("tiers") or {}).items():
            for _, _, key in TIER_GAUGES:
                self._tier[key].labels(*labels, tier).set(float(t.get(key, 0.0)))
        for tier, u in (fig.get("use") or {}).items():
            for _, _, key in USE_GAUGES:
                if u.get(key) is not None:
                    self._tier[key].labels(*labels, tier).set(float(u[key]))
        for _, _, key in ENGINE_GAUGES:
            if fig.get(key) is not None:
                self._engine[key].labels(*labels).set(float(fig[key]))
