"""Connector settings: kvmesh's :class:`~kvmesh.CacheConfig` plus a few connector keys.

Sources, later ones winning: the YAML file named by ``config_file`` in
``kv_connector_extra_config``, the inline kvmesh keys beside it, then ``KVMESH_*``
environment variables (``KVMESH_CONFIG_FILE`` included), exactly as
:meth:`CacheConfig.from_env` layers them over a base.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.config import CacheConfig
from kvmesh.errors import ConfigError

# Keys of kv_connector_extra_config that belong to the connector, not to CacheConfig.
CONNECTOR_KEYS = {
    "config_file": "YAML file with kvmesh cache settings",
    "model_id": "name chunks are keyed by (default: the model path/name vLLM was given); "
    "replicas share chunks only when it is equal",
    "socket_dir": "directory of the scheduler->worker unix socket (default: the temp dir)",
    "rpc_timeout_s": "how long the scheduler waits for the worker's lookup answer (default 2)",
}


@dataclass(frozen=True)
class ConnectorOptions:
    cache: CacheConfig
    model_id: str | None = None
    socket_dir: str | None = None
    rpc_timeout_s: float = 2.0

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> ConnectorOptions:
        extra = dict(extra or {})
        own = {k: extra.pop(k) for k in list(extra) if k in CONNECTOR_KEYS}
        base: dict[str, Any] = {}
        if own.get("config_file"):
            base.update(CacheConfig.from_file(str(own["config_file"])).model_dump(exclude_unset=True))
        unknown = sorted(k for k in extra if not CacheConfig.accepts(k))  # LMCache's keys too
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {', '.join(map(repr, unknown))}; "
                f"connector keys: {', '.join(sorted(CONNECTOR_KEYS))}; "
                f"kvmesh keys: {', '.join(sorted(CacheConfig.model_fields))}"
            )
        base.update(extra)
        cache = CacheConfig.from_env(environ, base=base)
        try:
            timeout = float(own.get("rpc_timeout_s", 2.0))
        except (TypeError, ValueError):
            raise ConfigError(f"rpc_timeout_s must be a number, got {own['rpc_timeout_s']!r}") from None
        if timeout <= 0:
            raise ConfigError(f"rpc_timeout_s must be positive, got {timeout}")
        return cls(
            cache=cache,
            model_id=str(own["model_id"]) if own.get("model_id") else None,
            socket_dir=str(own["socket_dir"]) if own.get("socket_dir") else None,
            rpc_timeout_s=timeout,
        )


def check_chunk_size(chunk_size: int, block_size: int) -> None:
    """kvmesh chunks must tile vLLM blocks exactly: a chunk is loaded and saved as whole
    blocks, and a hit must end on a block boundary."""
    if chunk_size % block_size:
        nearest = max(1, round(chunk_size / block_size)) * block_size
        raise ValueError(
            f"kvmesh chunk_size={chunk_size} is not a multiple of vLLM's block_size={block_size}; "
            f"set chunk_size to a multiple of {block_size} (e.g. {nearest})"
        )
