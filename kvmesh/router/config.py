"""``kvmesh router``'s settings: the routing core's (:class:`kvmesh.routing.config.RoutingConfig`)
plus the proxy's own (listen address, body limits, timeouts), the cache controller's and
prefill/decode disaggregation's; one pydantic model, loadable from YAML.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvmesh.admin.schema import TOKEN_ENV
from kvmesh.errors import ConfigError
from kvmesh.routing.config import RoutingConfig, explain

URLS_ENV = "KVMESH_ADMIN_URLS"  # engine admin endpoints the controller knows up front


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
    body_timeout_s: float = Field(
        default=10.0, gt=0, description="a request body not received within this is a 408"
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
            raise ConfigError(explain(exc, f"controller config (with ${URLS_ENV})")) from exc


class PDConfig(BaseModel):
    """Prefill/decode disaggregation (``pd:`` in YAML, ``--pd`` on the command line).

    A request whose prompt tokens not cached on its decode replica exceed
    ``pd_threshold_tokens`` (llm-d's non-cached-tokens rule, its name) is prefilled on a
    prefill replica first; the decode replica then loads that KV instead of computing it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=False, description="route by role: prefill|decode|both replicas")
    # 2,048, from kvmesh bench pd's threshold probe (docs/bench/pd.json, idle pair): a local
    # prefill's TTFT was below the PD path's at every length measured, 17% at 128 tokens, 27%
    # at 512, 6% at 1,024, and level (1%) only at 2,048, the longest. So a prompt goes to a
    # prefill replica only past that length. What PD buys below it (the decodes a long local
    # prefill stalls) the probe does not measure: lower it where ITL matters more than TTFT.
    # Follow-up turns with a cached prefix stay local.
    pd_threshold_tokens: int = Field(
        default=2048, ge=0, description="uncached prompt tokens above which a request is prefilled remotely"
    )
    prefill_timeout_s: float = Field(
        default=30.0, gt=0, description="longest a prefill may take before the decode replica computes it"
    )


class RouterConfig(RoutingConfig):
    """Everything ``kvmesh router`` needs; see ``kvmesh router --help`` for the CLI names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535, description="0 picks a free port")
    max_body_bytes: int = Field(default=16 << 20, gt=0)
    body_timeout_s: float = Field(
        default=10.0, gt=0, description="a request body not received within this is a 408 (never a hang)"
    )
    write_timeout_s: float = Field(
        default=30.0, gt=0, description="a client that takes no streamed bytes for this long is dropped"
    )
    shutdown_timeout_s: float = Field(
        default=30.0, gt=0, description="on SIGTERM, how long answers in flight may take to finish"
    )
    read_timeout_s: float = Field(default=600.0, gt=0, description="longest silence mid-answer")
    max_answer_bytes: int = Field(
        default=256 << 20,
        gt=0,
        description="a replica's whole answer, or one chunk of a stream; larger is a 502",
    )
    max_attempts: int = Field(default=3, ge=1, description="replicas tried when the connection fails")
    controller: ControllerConfig = Field(
        default_factory=ControllerConfig, description="the cache controller under /kvmesh/v1/"
    )
    pd: PDConfig = Field(default_factory=PDConfig, description="prefill/decode disaggregation")

    @model_validator(mode="after")
    def _pd_roles(self) -> RouterConfig:
        if self.pd.enabled and self.replicas:
            roles = {r.role for r in self.replicas}
            if not roles & {"decode", "both"}:
                raise ValueError("pd is enabled but no replica has role=decode or role=both")
        return self
