"""The router's Prometheus metrics, on a registry of its own.

A dedicated registry (not prometheus_client's global one) so that several routers can live
in one process — tests and the demo start more than one — and so that ``/metrics`` shows
the router's series only.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Routing overhead is sub-millisecond; upstream latency spans milliseconds to minutes.
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1)
_UPSTREAM_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.decisions = Counter(
            "kvmesh_router_decisions", "routing decisions", ("policy", "replica"), registry=r
        )
        self.prompt_tokens = Counter("kvmesh_router_prompt_tokens", "prompt tokens routed", registry=r)
        self.hit_tokens = Counter(
            "kvmesh_router_prefix_hit_tokens",
            "prompt tokens the chosen replica was believed to hold, by medium",
            ("medium",),
            registry=r,
        )
        self.requests = Counter(
            "kvmesh_router_requests",
            "requests answered, by endpoint and status",
            ("endpoint", "status"),
            registry=r,
        )
        self.errors = Counter(
            "kvmesh_router_errors", "requests the router refused or failed", ("kind",), registry=r
        )
        self.retries = Counter(
            "kvmesh_router_retries",
            "requests sent to another replica after a connect failure, or after an answer that broke off "
            "before anything of it reached the client",
            registry=r,
        )
        self.overhead = Histogram(
            "kvmesh_router_overhead_seconds",
            "router time from request received to request sent upstream (parse, tokenize, score)",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.upstream_latency = Histogram(
            "kvmesh_router_upstream_latency_seconds",
            "time from sending upstream to the upstream's response headers",
            ("replica",),
            buckets=_UPSTREAM_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("kvmesh_router_in_flight", "requests in flight", ("replica",), registry=r)
        # Prefill/decode disaggregation (kvmesh router --pd): which path each request took.
        self.pd_requests = Counter(
            "kvmesh_router_pd_requests",
            "requests routed with pd enabled, by path: pd (prefilled remotely), decode_only "
            "(uncached tokens under the threshold), fallback (the prefill failed: decoded alone)",
            ("path",),
            registry=r,
        )
        self.pd_fallbacks = Counter(
            "kvmesh_router_pd_fallbacks", "prefills that failed, by reason", ("reason",), registry=r
        )
        self.pd_prefill_latency = Histogram(
            "kvmesh_router_pd_prefill_seconds",
            "time of a successful prefill request (sent to its answer read)",
            buckets=_UPSTREAM_BUCKETS,
            registry=r,
        )
        self.healthy = Gauge(
            "kvmesh_router_replica_healthy", "1 if the replica takes traffic", ("replica",), registry=r
        )
