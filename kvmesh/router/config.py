"""Router settings: one pydantic model, loadable from YAML, with errors that name the key.

The defaults balance prefix hits against queueing. llm-d measured what happens otherwise:
a router that scores prefix alone piles every request of a popular prefix onto one replica.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvmesh.admin.schema import TOKEN_ENV
from kvmesh.errors import ConfigError

URLS_ENV = "KVMESH_ADMIN_URLS"  # engine admin endpoints the controller knows up front
POLICIES = ("kvmesh", "prefix", "least-loaded", "round-robin", "random")
Policy = Literal["kvmesh", "prefix", "least-loaded", "round-robin", "random"]
ROLES = ("prefill", "decode", "both")
Role = Literal["prefill", "decode", "both"]


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
            raise ConfigError(_explain(exc, f"replica {spec!r}")) from exc


class Weights(BaseModel):
    """Weight of each scorer in the ``kvmesh`` policy (a weight of 0 turns a scorer off)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix: float = Field(default=2.0, ge=0)
    queue: float = Field(default=1.0, ge=0)
    kv_util: float = Field(default=0.5, ge=0)
    session: float = Field(default=0.5, ge=0)
    prefill: float = Field(default=8.0, ge=0)


class MediumWeights(BaseModel):
    """How much a prefix block is worth by where it lives (GPU: free; REMOTE: a network load)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    GPU: float = Field(default=1.0, ge=0, le=1)
    CPU: float = Field(default=0.8, ge=0, le=1)
    DISK: float = Field(default=0.5, ge=0, le=1)
    REMOTE: float = Field(default=0.3, ge=0, le=1)


def parse_admin(spec: str) -> tuple[str, str]:
    """``URL[,name=NAME]`` → ``(name, url)``; the name defaults to the URL's host:port."""
    url, *opts = [p.strip() for p in spec.split(",")]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"admin endpoint must look like http://host:port[,name=NAME], got {spec!r}")
    name = parts.netloc
    for opt in opts:
        key, sep, value = opt.partition("=")
        if key.strip() != "name" or not sep or not value.strip():
            raise ConfigError(f"bad admin option {opt!r} in {spec!r}; use URL[,name=NAME]")
        name = value.strip()
    return name, url.rstrip("/")


class ControllerConfig(BaseModel):
    """The cache controller the router serves under ``/kvmesh/v1/`` (``controller:`` in YAML,
    ``--admin`` / ``--admin-token`` on the command line)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    admins: tuple[str, ...] = Field(
        default=(), description="engine admin endpoints known up front: URL[,name=NAME]"
    )
    token: str | None = Field(default=None, repr=False, description=f"bearer token (or {TOKEN_ENV})")
    call_timeout_s: float = Field(default=10.0, gt=0, description="per-engine call timeout")
    heartbeat_misses: float = Field(default=3.0, gt=0, description="missed heartbeats before 'down'")
    rebuild: bool = Field(
        default=True, description="on start, fill the index from what each engine's kvmesh tiers hold"
    )
    rebuild_max_chunks: int = Field(
        default=65_536, ge=0, description="most held chunks asked of one engine when rebuilding"
    )

    @field_validator("admins")
    @classmethod
    def _admins_ok(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for spec in v:
            try:
                parse_admin(spec)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return v

    def with_env(self, environ: Mapping[str, str] | None = None) -> ControllerConfig:
        """This config overlaid with ``KVMESH_ADMIN_URLS`` (whitespace-separated, added) and
        ``KVMESH_ADMIN_TOKEN`` (used when no token is configured)."""
        env = os.environ if environ is None else environ
        data = self.model_dump()
        extra = tuple(s for s in env.get(URLS_ENV, "").split() if s not in self.admins)
        if extra:
            data["admins"] = (*self.admins, *extra)
        if not self.token and env.get(TOKEN_ENV):
            data["token"] = env[TOKEN_ENV]
        try:
            return ControllerConfig.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(_explain(exc, f"controller config (with ${URLS_ENV})")) from exc


class PDConfig(BaseModel):
    """Prefill/decode disaggregation (``pd:`` in YAML, ``--pd`` on the command line).

    A request whose prompt tokens not cached on its decode replica exceed
    ``pd_threshold_tokens`` (llm-d's non-cached-tokens rule, its name) is prefilled on a
    prefill replica first; the decode replica then loads that KV instead of computing it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=False, description="route by role: prefill|decode|both replicas")
    # 512, measured (kvmesh bench pd's threshold probe): the PD hop costs a fixed ~10 ms of
    # TTFT (a second HTTP call, the producer's one-token step, the handshake, the pull); below
    # 512 tokens a local prefill is cheaper than that, from 512 on it is not. Follow-up turns
    # with a cached prefix stay local.
    pd_threshold_tokens: int = Field(
        default=512, ge=0, description="uncached prompt tokens above which a request is prefilled remotely"
    )
    prefill_timeout_s: float = Field(
        default=30.0, gt=0, description="longest a prefill may take before the decode replica computes it"
    )


class RouterConfig(BaseModel):
    """Everything ``kvmesh router`` needs; see ``kvmesh router --help`` for the CLI names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(default=None, description="model directory: the tokenizer is loaded from here")
    served_model_names: tuple[str, ...] = Field(
        default=(),
        description="model names clients may ask for (default: whatever the replicas' /v1/models list)",
    )
    replicas: tuple[ReplicaConfig, ...] = Field(default=(), description="the vLLM replicas")
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535, description="0 picks a free port")

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

    tokenizer: Literal["local", "remote"] = Field(
        default="local", description="local: tokenize here like the engine; remote: ask a replica's /tokenize"
    )
    tokenize_cache_mb: float = Field(default=64.0, ge=0, description="memory for cached tokenizations")
    block_size: int = Field(default=16, gt=0, description="speculative entries' block size before any event")
    speculative_ttl_s: float = Field(default=2.0, ge=0, description="0 disables speculative index entries")
    session_header: str = "x-session-id"
    session_capacity: int = Field(default=100_000, gt=0)

    max_body_bytes: int = Field(default=16 << 20, gt=0)
    body_timeout_s: float = Field(
        default=10.0, gt=0, description="a request body not received within this is a 408 (never a hang)"
    )
    shutdown_timeout_s: float = Field(
        default=30.0, gt=0, description="on SIGTERM, how long answers in flight may take to finish"
    )
    connect_timeout_s: float = Field(default=2.0, gt=0)
    read_timeout_s: float = Field(default=600.0, gt=0, description="longest silence mid-answer")
    health_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = Field(default=1.0, gt=0)
    metrics_interval_s: float = Field(default=0.25, gt=0)
    retry_after_s: int = Field(default=1, ge=0, description="Retry-After on 503 when no replica is healthy")
    max_attempts: int = Field(default=3, ge=1, description="replicas tried when the connection fails")
    seed: int = Field(default=0, description="seed of the random policy")
    controller: ControllerConfig = Field(
        default_factory=ControllerConfig, description="the cache controller under /kvmesh/v1/"
    )
    pd: PDConfig = Field(default_factory=PDConfig, description="prefill/decode disaggregation")

    @model_validator(mode="after")
    def _unique_replicas(self) -> RouterConfig:
        keys = [r.key for r in self.replicas]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"replicas must be unique; repeated: {', '.join(dup)}")
        if self.pd.enabled and self.replicas:
            roles = {r.role for r in self.replicas}
            if not roles & {"decode", "both"}:
                raise ValueError("pd is enabled but no replica has role=decode or role=both")
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RouterConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(f"router config must be a mapping, got {type(data).__name__}")
        data = dict(data)
        # YAML may list replicas in the CLI's string form.
        if isinstance(data.get("replicas"), list):
            data["replicas"] = [ReplicaConfig.parse(r) if isinstance(r, str) else r for r in data["replicas"]]
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(_explain(exc, "router config", sorted(cls.model_fields))) from exc

    @classmethod
    def from_yaml(cls, path: str | Path) -> RouterConfig:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read router config {path}: {exc}") from exc
        return cls.from_dict(data)

    def merged(self, **overrides: Any) -> RouterConfig:
        """A copy with the given fields replaced (None means: keep), validated again."""
        data = self.model_dump()
        data.update({k: v for k, v in overrides.items() if v is not None})
        return RouterConfig.from_dict(data)


def _explain(exc: ValidationError, what: str, valid: list[str] | None = None) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            top = valid is not None and len(err["loc"]) == 1
            lines.append(f"unknown key {loc!r}" + (f" (valid keys: {', '.join(valid or ())})" if top else ""))
        else:
            lines.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
    return f"invalid {what}: " + "; ".join(lines)
