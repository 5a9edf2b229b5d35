"""One typed configuration tree, from a dict, a YAML file or ``KVMESH_*`` variables.

LMCache's key names are accepted as they are (``chunk_size``, ``local_cpu``,
``max_local_cpu_size`` in GB, ``local_disk``, ``max_local_disk_size``, ``remote_url``,
``remote_serde``), so an LMCache YAML file works unchanged where it names features kvmesh
has. Any other unknown key, or a bad value, is a :class:`~kvmesh.errors.ConfigError` that
names the key and lists the valid ones.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvmesh.core.policy import POLICIES
from kvmesh.core.serde import CODEC_ALIASES, CODECS
from kvmesh.errors import ConfigError

GB = 1024**3
ENV_PREFIX = "KVMESH_"


class CacheConfig(BaseModel):
    """Settings of one :class:`~kvmesh.CacheEngine` (sizes in GB, as LMCache has them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chunk_size: int = Field(256, gt=0, description="tokens per chunk (the unit of storage and I/O)")
    local_cpu: bool = Field(True, description="keep hot chunks in the CPU DRAM pool")
    max_local_cpu_size: float = Field(2.0, gt=0, description="CPU pool size in GB (allocated up front)")
    local_disk: str | None = Field(None, description="disk tier: file:///path or a path; None = off")
    max_local_disk_size: float = Field(20.0, ge=0, description="disk tier byte budget in GB (0 = unbounded)")
    remote_url: str | None = Field(None, description="shared tier: redis://, rediss://, unix://, fs:///path")
    remote_serde: str = Field(
        "raw", description="codec in the remote tier: raw | zstd (LMCache: naive = raw)"
    )
    disk_serde: str = Field("raw", description="codec in the disk tier: raw | zstd")
    save_unfull_chunk: bool = Field(False, description="also cache the final partial chunk of a prompt")
    cache_salt: str | None = Field(None, description="tenant isolation: different salts never share")
    write_mode: Literal["through", "back"] = Field(
        "through",
        description="through: store writes to disk and remote at once; back: to disk only on CPU eviction",
    )
    eviction_policy: str = Field("lru", description=f"cpu eviction order: {' | '.join(POLICIES)}")
    disk_o_direct: bool = Field(False, description="write disk chunks with O_DIRECT (aligned buffers)")
    disk_io_trace: str | None = Field(None, description="path of a JSON-lines trace of every disk I/O")
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
    remote_timeout_s: float = Field(5.0, gt=0, description="socket timeout of remote operations")
    max_pending_writes: int = Field(256, gt=0, description="bounded write-behind queue length, per tier")
    store_wait_s: float = Field(
        0.0, ge=0, description="how long store may wait for pool space or queue room before skipping"
    )
    promote_on_hit: bool = Field(True, description="copy lower-tier hits up into the cpu tier")
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
        None, description="router base URL to register with and heartbeat to, e.g. http://router:8080"
    )

    @field_validator("remote_serde", "disk_serde")
    @classmethod
    def _codec_known(cls, v: str) -> str:
        name = CODEC_ALIASES.get(v, v)
        if name not in CODECS:
            raise ValueError(f"unknown codec {v!r}; valid: {', '.join(sorted(CODECS))}")
        return name

    @field_validator("eviction_policy")
    @classmethod
    def _policy_known(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown eviction policy {v!r}; valid: {', '.join(sorted(POLICIES))}")
        return v

    # -- constructors --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(f"config must be a mapping of keys to values, got {type(data).__name__}")
        valid = sorted(cls.model_fields)
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ConfigError(
                f"unknown config key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(valid)}"
            )
        try:
            return cls(**data)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "config"
            raise ConfigError(f"config key {where!r}: {err['msg']} (got {err.get('input')!r})") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> CacheConfig:
        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, base: Mapping[str, Any] | None = None
    ) -> CacheConfig:
        """``KVMESH_CHUNK_SIZE=512`` sets ``chunk_size``; ``KVMESH_CONFIG_FILE`` names a YAML
        file read first. Values are parsed as YAML scalars (``true``, ``2.5``, ``null``)."""
        env = os.environ if environ is None else environ
        data: dict[str, Any] = dict(base or {})
        cfg_file = env.get(ENV_PREFIX + "CONFIG_FILE")
        if cfg_file:
            data.update(cls.from_file(cfg_file).model_dump(exclude_unset=True))
        for name, value in env.items():
            if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "CONFIG_FILE":
                continue
            key = name[len(ENV_PREFIX) :].lower()
            if key not in cls.model_fields:
                continue  # other KVMESH_* variables belong to the router, admin API, ...
            parsed = yaml.safe_load(value) if value != "" else None
            if parsed is not None and not isinstance(parsed, str) and cls._is_text_field(key):
                parsed = value  # KVMESH_CACHE_SALT=123 is the salt "123", not the int 123
            data[key] = parsed
        return cls.from_dict(data)

    @classmethod
    def _is_text_field(cls, key: str) -> bool:
        return cls.model_fields[key].annotation in (str, str | None)

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
