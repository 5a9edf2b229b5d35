"""One typed configuration tree, from a dict, a YAML file or ``KVMESH_*`` variables.

LMCache configurations load unchanged: LMCache's key names that are kvmesh's too
(``chunk_size``, ``local_cpu``, ``max_local_cpu_size`` in GB, ``local_disk``,
``max_local_disk_size``, ``remote_url``, ``remote_serde``) are taken as they are, and every
other key of LMCache's v1 and v0 configs, its aliases, ``lmcache.``-prefixed keys,
``extra_config``, ``LMCACHE_<KEY>`` variables and ``LMCACHE_CONFIG_FILE`` are read by
:mod:`kvmesh.config_lmcache` (mapped, ignored, or warned about by key; an error with
``strict: true``). In a configuration read as LMCache's a key nobody knows is warned about
(LMCache ignores it too); in kvmesh's own it is a :class:`~kvmesh.errors.ConfigError`, as are
a bad value and a ``remote_url`` scheme kvmesh does not serve, naming the key and the valid
values.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from kvmesh import config_lmcache as lmc
from kvmesh import config_lmcache_env as lmc_env
from kvmesh import config_lmcache_pd as lmc_pd
from kvmesh.core.policy import POLICIES
from kvmesh.core.serde import check_codec_name
from kvmesh.errors import ConfigError

log = logging.getLogger(__name__)
GB = 1024**3
ENV_PREFIX = "KVMESH_"
LMCACHE_ENV_PREFIX = "LMCACHE_"
# Schemes LMCache users write that kvmesh does not serve, and why (shown at config time).
_UNSERVED = {
    "lm": "LMCache's own lm:// server protocol",
    "infinistore": "InfiniStore needs RDMA",
}


class CacheConfig(BaseModel):
    """Settings of one :class:`~kvmesh.CacheEngine` (sizes in GB, as LMCache has them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # 128 = vLLM's KV block on CPU: measured in ``kvmesh bench ttft`` (docs/bench/ttft.md),
    # 256-token chunks leave up to 255 tokens to recompute and were ~2x slower at 2,000 tokens.
    chunk_size: int = Field(128, gt=0, description="tokens per chunk (the unit of storage and I/O)")
    local_cpu: bool = Field(True, description="keep hot chunks in the CPU DRAM pool")
    max_local_cpu_size: float = Field(
        2.0,
        ge=0,
        description="CPU pool size in GB (allocated up front; refused at start when larger than the "
        "memory the process may use, the machine's or its container's cgroup limit; 0 only with "
        "local_cpu: false)",
    )
    local_disk: str | None = Field(None, description="disk tier: file:///path or a path; None = off")
    max_local_disk_size: float = Field(20.0, ge=0, description="disk tier byte budget in GB (0 = unbounded)")
    remote_url: str | None = Field(
        None,
        description="shared tier: redis://, rediss://, unix://, valkey://, redis-cluster://h:p,h:p, "
        "s3://bucket/prefix, mooncakestore://master, fs:///path",
    )
    remote_serde: str = Field(
        "raw",
        description="codec in the remote tier: raw | zstd | safetensors | cachegen (lossy) "
        "(LMCache: naive = raw, safetensor = safetensors)",
    )
    disk_serde: str = Field("raw", description="codec in the disk tier: raw | zstd | safetensors | cachegen")
    strict: bool = Field(
        False, description="LMCache keys kvmesh has no equivalent for are errors, not warnings"
    )
    save_unfull_chunk: bool = Field(False, description="also cache the final partial chunk of a prompt")
    cache_salt: str | None = Field(None, description="tenant isolation: different salts never share")
    write_mode: Literal["through", "back"] = Field(
        "through",
        description="through: store writes to disk and remote at once; back: to disk only on CPU eviction",
    )
    eviction_policy: str = Field("lru", description=f"cpu eviction order: {' | '.join(POLICIES)}")
    disk_o_direct: bool = Field(False, description="write disk chunks with O_DIRECT (aligned buffers)")
    disk_read_process: bool = Field(
        False,
        description="read disk chunks in a child process of the tier's own (off the worker's GIL); "
        "a failed child falls back to reads in the process",
    )
    disk_io_trace: str | None = Field(None, description="path of a JSON-lines trace of every disk I/O")
    disk_subdir: str = Field(
        "auto",
        description="disk tier directory under local_disk: auto = rank<k>/slot<n> (first free), "
        "'' = local_disk itself, NAME = NAME/rank<k>",
    )
    disk_placement: Literal["none", "hints", "segments"] = Field(
        "none",
        description="disk layout by write lifetime: none (file per chunk) | hints (file per chunk + "
        "F_SET_RW_HINT) | segments (per-class log segments of disk_ru_size)",
    )
    disk_ru_size: int = Field(
        64 << 20, ge=1 << 20, description="bytes per segment = the drive's reclaim-unit size (segments)"
    )
    disk_placement_map: dict[str, str] | None = Field(
        None, description="lifetime class -> none|short|medium|long|extreme (see kvmesh.tiers.placement)"
    )
    remote_ttl_s: float | None = Field(None, gt=0, description="expire remote chunks after this many seconds")
    remote_part_size: int = Field(1 << 20, gt=0, le=512 << 20, description="bytes per Redis value part")
    remote_timeout_s: float = Field(
        5.0,
        gt=0,
        description="budget of one whole remote operation (a lookup, a load, a store), retries included",
    )
    max_pending_writes: int = Field(256, gt=0, description="bounded write-behind queue length, per tier")
    store_wait_s: float = Field(
        0.0, ge=0, description="how long store may wait for pool space or queue room before skipping"
    )
    promote_on_hit: bool = Field(True, description="copy lower-tier hits up into the cpu tier")
    # -- loads against recompute (see kvmesh.core.loadcost and docs/cost-model.md) --
    skip_slow_loads: bool = Field(
        True,
        description="a lookup reports chunks whose measured load time exceeds recomputing them as "
        "not loadable (vLLM computes them); a load beside the batch (async) is weighed against the "
        "recompute's stall of every running request",
    )
    prefill_tokens_per_s: float | None = Field(
        None,
        gt=0,
        description="this engine's prefill rate for skip_slow_loads; None = learned from vLLM's steps",
    )
    # -- trust (see kvmesh.core.fleetkey and docs/security.md) --
    fleet_key_file: str | None = Field(
        None,
        description="file of the fleet's shared secret (or KVMESH_FLEET_KEY_FILE): chunks below the cpu "
        "tier carry a keyed MAC and PD transfers are signed; None = any writer of a shared tier can plant KV",
    )
    encrypt_at_rest: bool = Field(
        False,
        description="with a fleet key: encrypt token ids and KV below the cpu tier (AES-256-GCM), so a "
        "reader of the disk or shared tier learns neither prompts nor KV",
    )
    # -- admin endpoint (see kvmesh.admin and docs/controller.md) --
    admin_enabled: bool | None = Field(
        None,
        description="serve the admin HTTP API: None = off for a bare CacheEngine, on in the vLLM connector",
    )
    admin_host: str = Field(
        "127.0.0.1", description="admin API address; off loopback, read-only calls need the token too"
    )
    admin_port: int = Field(
        0, ge=0, le=65535, description="admin API port (0 = a free port; tensor-parallel rank r adds r)"
    )
    admin_token: str | None = Field(
        None,
        repr=False,
        description="bearer token of the admin API (or KVMESH_ADMIN_TOKEN); None = mutating calls refused",
    )
    admin_name: str | None = Field(
        None, description="name this engine registers under with the controller (default: host:port)"
    )
    controller_url: str | None = Field(
        None,
        description="router base URL to register with and heartbeat to, e.g. http://router:8080 "
        "(LMCache's controller_url, a ZMQ address of its own controller, is not this)",
    )

    _readings: list[lmc.KeyReading] = PrivateAttr(default_factory=list)
    _pd_role: str | None = PrivateAttr(default=None)
    _lmcache: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _cpu_tier_has_room(self) -> CacheConfig:
        if self.local_cpu and self.max_local_cpu_size == 0:
            raise ValueError(
                "max_local_cpu_size: 0 leaves the CPU tier no room; for no CPU tier set local_cpu: "
                "false (LMCache's PD decoders and production-stack's chart write both)"
            )
        return self

    @field_validator("remote_serde", "disk_serde")
    @classmethod
    def _codec_known(cls, v: str) -> str:
        try:
            return check_codec_name(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("remote_url")
    @classmethod
    def _scheme_served(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from kvmesh.tiers.base import served_schemes

        scheme = urlsplit(v).scheme
        served = served_schemes()
        if scheme not in served:
            why = f" ({_UNSERVED[scheme]})" if scheme in _UNSERVED else ""
            raise ValueError(
                f"kvmesh does not serve URL scheme {scheme!r}{why}; served schemes: {', '.join(served)}"
            )
        if scheme == "fs":
            from kvmesh.tiers.fs import fs_root

            try:
                fs_root(v)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return v

    @field_validator("eviction_policy")
    @classmethod
    def _policy_known(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown eviction policy {v!r}; valid: {', '.join(sorted(POLICIES))}")
        return v

    # -- constructors --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "dict") -> CacheConfig:
        return cls.from_layers([(source, data)])

    @classmethod
    def from_layers(cls, layers: Iterable[tuple[str, Mapping[str, Any]]]) -> CacheConfig:
        """One config from ``(source, keys)`` layers (later ones win), kvmesh's or LMCache's
        keys. LMCache keys with no kvmesh equivalent are logged as warnings, or with
        ``strict: true`` raise :class:`ConfigError`."""
        tr = lmc.translate(layers, cls.model_fields)
        values, readings = tr.values, tr.readings
        unsupported = [r for r in readings if r.action in lmc.WARNED]
        if unsupported and values.get("strict") is True:
            raise ConfigError(
                "strict: true and these keys have no kvmesh equivalent: "
                + "; ".join(f"{r.key} [{r.source}]: {r.note}" for r in unsupported)
            )
        cfg = cls._validated(values)
        for r in unsupported:
            log.warning("kvmesh config: %s [%s] not applied: %s", r.key, r.source, r.note)
        cfg._readings = readings
        cfg._pd_role = tr.pd_role
        cfg._lmcache = tr.lmcache
        return cfg

    @classmethod
    def _validated(cls, values: Mapping[str, Any]) -> CacheConfig:
        try:
            return cls(**values)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "config"
            msg = str(err["msg"]).removeprefix("Value error, ")
            raise ConfigError(f"config key {where!r}: {msg} (got {err.get('input')!r})") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> CacheConfig:
        return cls.from_layers([read_file_layer(path)])

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, base: Mapping[str, Any] | None = None
    ) -> CacheConfig:
        """``KVMESH_CHUNK_SIZE=512`` sets ``chunk_size``; ``KVMESH_CONFIG_FILE`` (or LMCache's
        ``LMCACHE_CONFIG_FILE``) names a YAML file read first, then ``base``, then
        ``LMCACHE_<KEY>`` variables, then ``KVMESH_<KEY>`` ones. Values are parsed as YAML
        scalars (``true``, ``2.5``, ``null``)."""
        return cls.from_layers(cls.env_layers(environ, base))

    @classmethod
    def env_layers(
        cls, environ: Mapping[str, str] | None = None, base: Mapping[str, Any] | None = None
    ) -> list[tuple[str, Mapping[str, Any]]]:
        env = os.environ if environ is None else environ
        layers: list[tuple[str, Mapping[str, Any]]] = []
        if env.get(ENV_PREFIX + "CONFIG_FILE"):
            layers.append(read_file_layer(env[ENV_PREFIX + "CONFIG_FILE"]))
        elif env.get(LMCACHE_ENV_PREFIX + "CONFIG_FILE"):
            name, data = read_file_layer(env[LMCACHE_ENV_PREFIX + "CONFIG_FILE"])
            layers.append((f"{name} (LMCACHE_CONFIG_FILE)", data))
        if base:
            layers.append(("config", base))
        for prefix in (LMCACHE_ENV_PREFIX, ENV_PREFIX):
            for name, value in env.items():
                if not name.startswith(prefix) or name == prefix + "CONFIG_FILE":
                    continue
                key = name[len(prefix) :].lower()
                if prefix == ENV_PREFIX and key not in cls.model_fields:
                    continue  # other KVMESH_* variables belong elsewhere
                if prefix == LMCACHE_ENV_PREFIX and lmc_env.not_config(key):
                    continue  # LMCache's runtime switches, not configuration keys
                parsed = yaml.safe_load(value) if value != "" else None
                if parsed is not None and not isinstance(parsed, str) and cls._is_text_field(key):
                    parsed = value  # KVMESH_CACHE_SALT=123 is the salt "123", not the int 123
                layers.append((f"env {name}", {key: parsed}))
        return layers

    @classmethod
    def accepts(cls, key: str) -> bool:
        """Whether ``key`` is a kvmesh or LMCache configuration key (``lmcache.`` prefix allowed)."""
        if key.startswith(lmc.LMCACHE_PREFIX):
            return True  # LMCache's by name: one it would ignore is warned about, as LMCache does
        return key in cls.model_fields or lmc.is_lmcache_key(key) or key.startswith("mp.")

    @property
    def readings(self) -> list[lmc.KeyReading]:
        """How each key given was read (``kvmesh config check`` prints these)."""
        return list(self._readings)

    @property
    def read_as_lmcache(self) -> bool:
        """Whether some layer of this configuration was read as LMCache's."""
        return self._lmcache

    def check_kv_role(self, kv_role: str | None) -> None:
        """Warn (error with ``strict``) when LMCache's ``pd_role`` asks for another vLLM
        ``kv_role`` than the one vLLM was given (see :mod:`kvmesh.config_lmcache_pd`)."""
        lmc_pd.check_role(self._pd_role, kv_role, self.strict)

    @classmethod
    def _is_text_field(cls, key: str) -> bool:
        field = cls.model_fields.get(key)
        return field is not None and field.annotation in (str, str | None)

    # -- derived -------------------------------------------------------------------------
    @property
    def cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * GB)

    @property
    def disk_bytes(self) -> int | None:
        return int(self.max_local_disk_size * GB) or None

    @property
    def disk_url(self) -> str | None:
        if not self.local_disk:
            return None
        return self.local_disk if "://" in self.local_disk else "file://" + os.path.abspath(self.local_disk)

    @classmethod
    def reference(cls) -> list[tuple[str, str, str]]:
        """``(key, default, description)`` rows for the docs."""
        rows = []
        for name, field in cls.model_fields.items():
            rows.append((name, repr(field.default), field.description or ""))
        return rows


def read_file_layer(path: str | os.PathLike[str]) -> tuple[str, Mapping[str, Any]]:
    """``("file NAME", keys)`` of a YAML config file; errors name the file."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"config file {p}: config must be a mapping of keys to values, got {type(data).__name__}"
        )
    return f"file {p.name}", data
