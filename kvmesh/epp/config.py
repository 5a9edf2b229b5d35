"""EPP settings: the ports and protocol knobs of ``kvmesh epp``, plus the routing core's config.

The routing half is a :class:`kvmesh.routing.config.RoutingConfig` (the routing keys of
``kvmesh router``: policy, weights, medium weights, tokenizer, speculative entries, ...), so
the two front ends route alike. Its ``replicas`` are the static endpoints; Kubernetes
discovery adds and removes endpoints at run time instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


class KubeConfig(BaseModel):
    """Where the InferencePool lives; the pods it selects become the endpoints."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pool: str = Field(description="InferencePool name (inference.networking.k8s.io/v1)")
    namespace: str = Field(default="default", description="namespace of the pool and its pods")
    api_server: str | None = Field(
        default=None, description="API server URL (default: in-cluster, from KUBERNETES_SERVICE_HOST)"
    )
    token_path: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_path: str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    resync_s: float = Field(default=300.0, gt=0, description="re-list after this long without events")


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

    @classmethod
    def from_yaml(cls, path: str | Path) -> EppConfig:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read epp config {path}: {exc}") from exc
        return cls.from_dict(data)
