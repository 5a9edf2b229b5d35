"""The metrics reference: every Prometheus series kvmesh's own exporters produce, read from
their registries (a metric added to any of them shows up by itself).

:func:`exporters` is the one list of those registries; the dashboard test
(``tests/unit/epp/test_deploy.py``) checks the Grafana queries against it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmesh.docsgen.markdown import GENERATED_NOTE, code, table


@dataclass(frozen=True)
class Exporter:
    title: str
    where: str
    registry: Any  # prometheus_client.CollectorRegistry
    collectors: tuple[Any, ...] = ()  # the metric objects, for their label names


def exporters() -> list[Exporter]:
    """kvmesh's Prometheus exporters, each on a fresh registry of its own."""
    from prometheus_client import CollectorRegistry

    from kvmesh.core.loadcost import LoadCosts
    from kvmesh.epp.metrics import EppMetrics
    from kvmesh.metrics import TierMetrics, prometheus_collector
    from kvmesh.router.metrics import RouterMetrics
    from kvmesh.routing.cost import CostModel
    from kvmesh.routing.costmetrics import CostMetrics
    from kvmesh.routing.scorers import ReplicaState

    router, epp = RouterMetrics(), EppMetrics()
    tiers = CollectorRegistry()
    sample = TierMetrics("cpu")
    sample.observe("get", 0.001)  # a histogram family appears once an op was timed
    costs = LoadCosts(bytes_per_token=1, tokens_per_s=1.0)
    costs.observe_load("remote", 1, 0.001)  # so the per-tier cost families have a sample
    figures = {**costs.figures(), "use": {"cpu": {"bytes_used": 0.0, "capacity_bytes": 1.0}}}
    tiers.register(prometheus_collector({"cpu": sample}, costs=lambda: figures))
    cost = CollectorRegistry()
    CostMetrics(CostModel(), cost, lambda: [ReplicaState("r", kv_usage=0.5)])
    return [
        Exporter(
            "kvmesh router",
            "`GET /metrics` on the router's port",
            router.registry,
            tuple(vars(router).values()),
        ),
        Exporter(
            "kvmesh epp", "`GET /metrics` on `metrics_port` (9090)", epp.registry, tuple(vars(epp).values())
        ),
        Exporter(
            "kvmesh router, policy cost",
            "`GET /metrics` on the router's port, beside the router's own (docs: the cost model)",
            cost,
        ),
        Exporter(
            "Cache engine (per tier)",
            "`kvmesh.metrics.prometheus_collector(engine metrics)` on a registry of the caller's choosing",
            tiers,
        ),
    ]


def exported_names() -> set[str]:
    """Every sample name the exporters produce (a counter ``x`` also as ``x_total``, ...)."""
    names: set[str] = set()
    for exp in exporters():
        for fam in exp.registry.collect():
            names.add(fam.name)
            for suffix in ("_total", "_bucket", "_sum", "_count", "_created"):
                names.add(fam.name + suffix)
    return names


_SERIES = {"counter": "_total", "histogram": "_bucket, _sum, _count", "summary": "_sum, _count"}


def _labels(exp: Exporter) -> dict[str, tuple[str, ...]]:
    """Label names per metric name. A labelled prometheus_client metric with no child yet has
    no samples to read them from, so they come from its ``_labelnames`` (no public getter)."""
    out: dict[str, tuple[str, ...]] = {}
    for c in exp.collectors:
        name, labels = getattr(c, "_name", None), getattr(c, "_labelnames", None)
        if isinstance(name, str) and labels is not None:
            out[name] = tuple(labels)
    for fam in exp.registry.collect():
        for s in fam.samples:
            out.setdefault(fam.name, tuple(k for k in s.labels if k not in ("le", "quantile")))
    return out


def metrics_page() -> str:
    out = [
        "# Metrics\n",
        GENERATED_NOTE + "\n",
        "Every Prometheus metric kvmesh exports, from the exporters' registries. Counters are "
        "exposed with `_total` (and `_created`), histograms with `_bucket`, `_sum` and `_count`. "
        "vLLM's own `vllm:*` metrics come from vLLM; the Grafana dashboard "
        "(`deploy/grafana/kvmesh-dashboard.json`) uses both.\n",
    ]
    for exp in exporters():
        labels = _labels(exp)
        rows = []
        for fam in exp.registry.collect():
            suffix = _SERIES.get(fam.type, "")
            name = code(fam.name + ("_total" if fam.type == "counter" else ""))
            if fam.type == "histogram":
                name += " (" + suffix + ")"
            rows.append(
                [name, fam.type, ", ".join(code(x) for x in labels.get(fam.name, ())), fam.documentation]
            )
        out.append(f"## {exp.title}\n\nServed by {exp.where}.\n")
        out.append(table(["metric", "type", "labels", "meaning"], rows))
    return "\n".join(out)
