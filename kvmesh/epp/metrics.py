"""The EPP's Prometheus metrics, on a registry of its own (several EPPs can share a process).

Names start ``kvmesh_epp_``; ``deploy/grafana/kvmesh.json`` queries them and a test checks
that every series the dashboard asks for is one this module (or the router, the connector's
or vLLM's exporters) defines.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Decisions take tens of microseconds to a few milliseconds (tokenizing a 32k-token prompt).
_DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class EppMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.decisions = Counter(
            "kvmesh_epp_decisions", "endpoints picked as primary", ("policy", "endpoint"), registry=r
        )
        self.decision_latency = Histogram(
            "kvmesh_epp_decision_seconds",
            "request body complete to routing reply (parse, tokenize, index, score)",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.refusals = Counter(
            "kvmesh_epp_refusals", "immediate responses sent instead of routing", ("status",), registry=r
        )
        self.served = Counter(
            "kvmesh_epp_served",
            "responses, by the endpoint that served them",
            ("endpoint", "status"),
            registry=r,
        )
        self.served_elsewhere = Counter(
            "kvmesh_epp_served_elsewhere",
            "responses served by another endpoint than the primary (the gateway fell back)",
            registry=r,
        )
        self.prompt_tokens = Counter("kvmesh_epp_prompt_tokens", "prompt tokens routed", registry=r)
        self.hit_tokens = Counter(
            "kvmesh_epp_prefix_hit_tokens",
            "prompt tokens the primary was believed to hold, by medium",
            ("medium",),
            registry=r,
        )
        self.in_flight = Gauge("kvmesh_epp_in_flight", "requests in flight", ("endpoint",), registry=r)
        self.healthy = Gauge(
            "kvmesh_epp_endpoint_healthy", "1 if the endpoint is eligible", ("endpoint",), registry=r
        )
        self.streams = Gauge("kvmesh_epp_streams", "open ext_proc streams", registry=r)
        self.stream_errors = Counter(
            "kvmesh_epp_stream_errors", "ext_proc streams that ended in a protocol error", registry=r
        )
        self.discovery_events = Counter(
            "kvmesh_epp_discovery_events", "endpoints added/removed by discovery", ("action",), registry=r
        )
