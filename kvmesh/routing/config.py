"""Routing settings: what every front end of the routing core reads (``kvmesh router``'s
config and ``kvmesh epp``'s ``routing:`` block), one pydantic model with errors that name
the key.

The defaults balance prefix hits against queueing. llm-d measured what happens otherwise:
a router that scores prefix alone piles every request of a popular prefix onto one replica.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvmesh.errors import ConfigError

POLICIES = ("kvmesh", "cost", "prefix", "least-loaded", "round-robin", "random")
Policy = Literal["kvmesh", "cost", "prefix", "least-loaded", "round-robin", "random"]
ROLES = ("prefill", "decode", "both")
Role = Literal["prefill", "decode", "both"]
KNOWN_MEDIA = ("GPU", "CPU", "DISK", "REMOTE")
OTHER_MEDIUM = "OTHER"  # the weight of a medium the config does not name

_C = TypeVar("_C", bound="RoutingConfig")


class ReplicaConfig(BaseModel):
    """One vLLM replica: its HTTP base URL and, optionally, its KV-event endpoints."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(description="base URL of the replica's OpenAI server, e.g. http://10.0.0.5:8000")
    name: str | None = Field(default=None, description="name in metrics and the index (default: the URL)")
    events: str | None = Field(
        default=None, description="ZMQ endpoint of its KV events, e.g. tcp://10.0.0.5:5557"
    )
    replay: str | None = Field(
        default=None, description="ZMQ endpoint of its KV-event replay (gap repair, index rebuild on start)"
    )
    admin: str | None = Field(
        default=None, description="its kvmesh admin API, e.g. http://10.0.0.5:8200 (index rebuild on start)"
    )
    role: Role = Field(
        default="both",
        description="with pd enabled: prefill (a kv_producer), decode (a kv_consumer) or both (kv_both)",
    )

    @field_validator("admin")
    @classmethod
    def _admin_ok(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"replica admin must look like http://host:port, got {v!r}")
        return v.rstrip("/")

    @field_validator("url")
    @classmethod
    def _url_ok(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"replica url must look like http://host:port, got {v!r}")
        return v.rstrip("/")

    @property
    def key(self) -> str:
        return self.name or self.url

    @classmethod
    def parse(cls, spec: str) -> ReplicaConfig:
        """Parse the CLI form ``URL[,events=EP][,replay=EP][,admin=URL][,name=NAME][,role=ROLE]``."""
        url, *opts = spec.split(",")
        fields: dict[str, str] = {"url": url.strip()}
        for opt in opts:
            key, sep, value = opt.partition("=")
            key = key.strip()
            if not sep or key not in ("events", "replay", "admin", "name", "role") or key in fields:
                raise ConfigError(
                    f"bad replica option {opt!r} in {spec!r}; "
                    "use URL[,events=EP][,replay=EP][,admin=URL][,name=NAME][,role=prefill|decode|both]"
                )
            fields[key] = value.strip()
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            raise ConfigError(explain(exc, f"replica {spec!r}")) from exc


class Weights(BaseModel):
    """Weight of each scorer in the ``kvmesh`` policy (a weight of 0 turns a scorer off)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix: float = Field(default=2.0, ge=0)
    queue: float = Field(default=1.0, ge=0)
    kv_util: float = Field(default=0.5, ge=0)
    session: float = Field(default=0.5, ge=0)
    prefill: float = Field(default=8.0, ge=0)


class MediumWeights(BaseModel):
    """How much a prefix block is worth by where it lives (GPU: free; REMOTE: a network load).

    Any other key names a medium the index keeps under its own name (a publisher's medium
    kvmesh has no alias for, e.g. ``STORAGE:REMOTE`` or ``STORAGE/fs`` from vLLM's tiering
    offload): its weight, in [0, 1]. ``OTHER`` is the weight of such a medium when it is not
    named here; a network load's by default, since nothing is known about it.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    GPU: float = Field(default=1.0, ge=0, le=1)
    CPU: float = Field(default=0.8, ge=0, le=1)
    DISK: float = Field(default=0.5, ge=0, le=1)
    REMOTE: float = Field(default=0.3, ge=0, le=1)
    OTHER: float = Field(default=0.3, ge=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _named_media(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        out: dict[str, Any] = {}
        for key, value in data.items():
            name = str(key).upper() if str(key).upper() in (*KNOWN_MEDIA, OTHER_MEDIUM) else str(key)
            if name not in (*KNOWN_MEDIA, OTHER_MEDIUM):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                    raise ValueError(f"medium_weights.{key}: must be a number in [0, 1], got {value!r}")
                value = float(value)
            out[name] = value
        return out

    def by_name(self) -> dict[str, float]:
        """Every weight by medium name (upper-case for the known media, as given otherwise)."""
        return {str(k): float(v) for k, v in self.model_dump().items()}


class CostModelConfig(BaseModel):
    """``policy: cost`` (``cost:`` in YAML): the TTFT cost model; every rate in it is measured
    (kvmesh.routing.cost, docs/cost-model.md). These are its few knobs, not rates."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tie_tolerance: float = Field(
        default=0.05, ge=0, le=1, description="predicted TTFTs within this fraction of the best are equal"
    )
    tie_tolerance_s: float = Field(default=0.002, ge=0, description="... or within this many seconds")
    forgetting: float = Field(
        default=0.995, gt=0.5, le=1, description="forgetting factor of each replica's fit (1: remember all)"
    )
    gauge_stale_s: float = Field(default=2.0, gt=0, description="load gauges older than this are ignored")
    max_gauge: float = Field(default=10_000.0, gt=0, description="a load gauge above this is cut to it")
    report_interval_s: float = Field(
        default=2.0, gt=0, description="how often each replica's admin API is asked for its measured costs"
    )


class RoutingConfig(BaseModel):
    """The routing core's settings (``kvmesh router`` adds its proxy's, ``kvmesh epp`` its
    gateway's around them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(default=None, description="model directory: the tokenizer is loaded from here")
    served_model_names: tuple[str, ...] = Field(
        default=(),
        description="model names clients may ask for (default: whatever the replicas' /v1/models list)",
    )
    replicas: tuple[ReplicaConfig, ...] = Field(default=(), description="the vLLM replicas")

    policy: Policy = "kvmesh"
    weights: Weights = Field(default_factory=Weights)
    medium_weights: MediumWeights = Field(default_factory=MediumWeights)
    # The load term must win when a queue is much longer, whatever the prefix says: a replica
    # whose load exceeds the lightest by both margins is only picked when nothing else is left.
    overload_abs: float = Field(default=8.0, ge=0, description="requests above the least-loaded replica")
    overload_rel: float = Field(default=1.5, ge=1, description="times the least-loaded replica's load")
    queue_smoothing: float = Field(default=4.0, gt=0, description="damps the queue score at low load")
    prefill_load_cost: float = Field(
        default=0.1, ge=0, le=1, description="prefill cost of a CPU/disk/shared-tier hit, vs recomputing"
    )
    prefill_smoothing_tokens: float = Field(
        default=256.0, gt=0, description="damps the prefill score when little work is queued"
    )
    cost: CostModelConfig = Field(default_factory=CostModelConfig, description="the cost policy's model")

    tokenizer: Literal["local", "remote"] = Field(
        default="local", description="local: tokenize here like the engine; remote: ask a replica's /tokenize"
    )
    tokenize_cache_mb: float = Field(default=64.0, ge=0, description="memory for cached tokenizations")
    tokenize_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="tokenizer: remote: a replica's /tokenize answers within this or the request is routed "
        "by load and session (default: kvmesh router connect_timeout_s + health_timeout_s; kvmesh epp "
        "0.15 s, inside Envoy's default ext_proc message_timeout of 200 ms)",
    )
    block_size: int = Field(default=16, gt=0, description="speculative entries' block size before any event")
    speculative_ttl_s: float = Field(default=2.0, ge=0, description="0 disables speculative index entries")
    session_header: str = "x-session-id"
    session_capacity: int = Field(default=100_000, gt=0)
    max_model_len: int | None = Field(
        default=None,
        gt=0,
        description="longest prompt in tokens; longer ones are a 400 before tokenizing (default: what "
        "the replicas' /v1/models report)",
    )
    replica_header: bool = Field(
        default=False,
        description="name the serving replica in an x-kvmesh-replica response header (off: it tells "
        "any client where other tenants' prefixes are cached)",
    )
    fleet_key_file: str | None = Field(
        default=None, description="the fleet's shared secret (or KVMESH_FLEET_KEY_FILE); see docs/security.md"
    )

    connect_timeout_s: float = Field(default=2.0, gt=0)
    health_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = Field(default=1.0, gt=0)
    health_failure_threshold: int = Field(
        default=3,
        ge=1,
        description="health checks in a row that time out before a replica is taken out (a busy "
        "replica can answer late); a refused connection or a non-200 answer takes it out at once",
    )
    metrics_interval_s: float = Field(default=0.25, gt=0)
    retry_after_s: int = Field(default=1, ge=0, description="Retry-After on 503 when no replica is healthy")
    seed: int = Field(default=0, description="seed of the random policy")

    @model_validator(mode="after")
    def _unique_replicas(self) -> RoutingConfig:
        keys = [r.key for r in self.replicas]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"replicas must be unique; repeated: {', '.join(dup)}")
        return self

    @classmethod
    def from_dict(cls: type[_C], data: Mapping[str, Any]) -> _C:
        what = "router config" if cls.__name__ == "RouterConfig" else "routing config"
        if not isinstance(data, Mapping):
            raise ConfigError(f"{what} must be a mapping, got {type(data).__name__}")
        data = dict(data)
        # YAML may list replicas in the CLI's string form.
        if isinstance(data.get("replicas"), list):
            data["replicas"] = [ReplicaConfig.parse(r) if isinstance(r, str) else r for r in data["replicas"]]
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(explain(exc, what, sorted(cls.model_fields))) from exc

    @classmethod
    def from_yaml(cls: type[_C], path: str | Path) -> _C:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        return cls.from_dict(data)

    def merged(self: _C, **overrides: Any) -> _C:
        """A copy with the given fields replaced (None means: keep), validated again."""
        data = self.model_dump()
        data.update({k: v for k, v in overrides.items() if v is not None})
        return type(self).from_dict(data)


def explain(exc: ValidationError, what: str, valid: list[str] | None = None) -> str:
    """A pydantic error as one line naming each bad key (and the valid ones, for a typo)."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            top = valid is not None and len(err["loc"]) == 1
            lines.append(f"unknown key {loc!r}" + (f" (valid keys: {', '.join(valid or ())})" if top else ""))
        else:
            lines.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
    return f"invalid {what}: " + "; ".join(lines)
