"""EPP settings: the ports and protocol knobs of ``kvmesh epp``, plus the routing core's config.

The routing half is a :class:`kvmesh.routing.config.RoutingConfig` (the routing keys of
``kvmesh router``: policy, weights, medium weights, tokenizer, speculative entries, ...), so
the two front ends route alike. Its ``replicas`` are the static endpoints; Kubernetes
discovery adds and removes endpoints at run time instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvmesh.errors import ConfigError
from kvmesh.routing.config import RoutingConfig, explain

# The endpoint-picker protocol's names (GIE docs/proposals/004-endpoint-picker-protocol).
DEST_HEADER = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
PICKED_HEADER = "x-kvmesh-endpoint"  # on the response: the primary the EPP picked
# Dynamic metadata the routing reply sets: the request's ticket, for the first-byte observer
# (a second ext_proc filter in observability mode: see kvmesh.epp.protocol).
TICKET_NAMESPACE = "kvmesh.ticket"


# InferencePool API groups and the version read of each: v1 (``spec.selector.matchLabels``,
# ``spec.targetPorts``) and the older x-k8s.io v1alpha2 (``spec.selector``, ``spec.targetPortNumber``).
POOL_GROUPS = {"inference.networking.k8s.io": "v1", "inference.networking.x-k8s.io": "v1alpha2"}
# Kubernetes label syntax (a key's optional DNS-subdomain prefix, a name, a value of at most 63):
# anything else would change the labelSelector query the selector becomes.
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
# An object's name (RFC 1123 subdomain) and a namespace (RFC 1123 label): they go into the API path.
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class KubeConfig(BaseModel):
    """Which pods are the endpoints: those an InferencePool selects, or (no pool) those a label
    selector names, on the given target ports (the reference EPP's standalone mode)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pool: str | None = Field(
        default=None, description="InferencePool name; unset: pods by `selector` on `target_ports`"
    )
    group: str = Field(
        default="inference.networking.k8s.io",
        description="the pool's API group: inference.networking.k8s.io (v1) or inference.networking.x-k8s.io "
        "(v1alpha2)",
    )
    selector: dict[str, str] | None = Field(
        default=None, description="without a pool: the pods' labels (matched exactly)"
    )
    target_ports: tuple[int, ...] = Field(default=(), description="without a pool: the pods' serving ports")
    namespace: str = Field(default="default", description="namespace of the pool and its pods")
    events_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="a pod without the kvmesh.io/kv-events annotations publishes its KV events on "
        "tcp://podIP:this (vLLM's --kv-events-config endpoint tcp://*:5557); unset: only annotated pods",
    )
    replay_port: int | None = Field(
        default=None, ge=1, le=65535, description="likewise its replay socket (vLLM's replay_endpoint)"
    )
    api_server: str | None = Field(
        default=None, description="API server URL (default: in-cluster, from KUBERNETES_SERVICE_HOST)"
    )
    token_path: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_path: str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    resync_s: float = Field(default=300.0, gt=0, description="re-list after this long without events")

    @model_validator(mode="after")
    def _one_source(self) -> KubeConfig:
        if self.group not in POOL_GROUPS:
            raise ValueError(f"group {self.group!r}: kvmesh reads InferencePools of {', '.join(POOL_GROUPS)}")
        if (self.pool is None) == (self.selector is None):
            raise ValueError("give either pool (an InferencePool) or selector with target_ports, not both")
        if self.selector is not None and (not self.selector or not self.target_ports):
            raise ValueError("selector needs at least one label and target_ports at least one port")
        if self.pool is not None and not _DNS_SUBDOMAIN.fullmatch(self.pool):
            raise ValueError(f"pool {self.pool!r} is not a Kubernetes object name")
        if not _DNS_LABEL.fullmatch(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} is not a Kubernetes namespace name")
        bad = [f"{k}={v}" for k, v in (self.selector or {}).items() if not _LABEL_KEY.fullmatch(k)
               or not _LABEL_VALUE.fullmatch(v)]  # fmt: skip
        if bad:
            raise ValueError(f"selector: not Kubernetes label key=value pairs: {', '.join(bad)}")
        if any(not 0 < port < 65536 for port in self.target_ports):
            raise ValueError(f"target_ports must be 1-65535, got {list(self.target_ports)}")
        return self


class EppConfig(BaseModel):
    """Everything ``kvmesh epp`` needs; see ``kvmesh epp --help`` for the CLI names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="routing, as kvmesh router")
    host: str = Field(
        default="127.0.0.1", description="address of all three listeners; in a pod, its own IP (POD_IP)"
    )
    grpc_port: int = Field(default=9002, ge=0, le=65535, description="ext_proc gRPC port (0: a free one)")
    health_port: int = Field(default=9003, ge=0, le=65535, description="gRPC health port (0: a free one)")
    metrics_port: int = Field(default=9090, ge=0, le=65535, description="Prometheus /metrics (0: free)")
    fallbacks: int = Field(
        default=0,
        ge=0,
        le=8,
        description="endpoints after the primary in the destination list (needs a gateway that retries "
        "down the list; an ORIGINAL_DST cluster takes exactly one address)",
    )
    max_body_bytes: int = Field(default=8 << 20, gt=0, description="larger request bodies get 413")
    shed_load: float = Field(
        default=0.0,
        ge=0,
        description="when every eligible endpoint's load is at least this, sheddable requests get 429 "
        "(0: never shed)",
    )
    priority_header: str = Field(
        default="x-gateway-inference-priority", description="a negative value makes a request sheddable"
    )
    kube: KubeConfig | None = None
    events_bind: str | None = Field(
        default=None,
        description="bind a KV-event sink here (tcp://*:5557) that the pods' publishers connect to, each "
        "naming itself in its topic kv@<pod IP>@<model> (llm-d's central layout; kvmesh.events.sink)",
    )
    events_topic: str = Field(default="kv@", description="the sink's topic filter (llm-d's topicFilter)")
    # -- exposure: TLS, caps and deadlines (docs/security.md) --------------------------------------
    secure_serving: bool = Field(
        default=True,
        description="serve ext_proc over TLS, as the Gateway API reference EPP does (health and metrics "
        "stay plain: kubelet probes and Prometheus)",
    )
    cert_path: str | None = Field(
        default=None,
        description="directory with tls.crt and tls.key (a kubernetes.io/tls Secret mounted); unset: a "
        "self-signed certificate made at start, which no gateway can verify",
    )
    max_streams: int = Field(
        default=1024, gt=0, description="concurrent ext_proc streams; more are refused (RESOURCE_EXHAUSTED)"
    )
    request_timeout_s: float = Field(
        default=30.0, gt=0, description="a stream must deliver its request headers and body within this"
    )
    stream_idle_timeout_s: float = Field(
        default=300.0, gt=0, description="a stream silent this long is closed (DEADLINE_EXCEEDED)"
    )
    fleet_key_file: str | None = Field(
        default=None, description="the fleet's shared secret (or KVMESH_FLEET_KEY_FILE); see docs/security.md"
    )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EppConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(f"epp config must be a mapping, got {type(data).__name__}")
        data = dict(data)
        if isinstance(data.get("routing"), Mapping):
            try:
                data["routing"] = RoutingConfig.from_dict(data["routing"])
            except ConfigError as exc:
                raise ConfigError(f"invalid epp config, key 'routing': {exc}") from exc
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(explain(exc, "epp config", sorted(cls.model_fields))) from exc
