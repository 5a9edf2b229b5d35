"""kvmesh: one cluster-wide KV cache for many vLLM replicas.

Public names: :class:`CacheEngine`, :class:`CacheConfig`, :class:`KVLayout` and the
exception tree in :mod:`kvmesh.errors`. They are imported lazily: ``import kvmesh.router``
must not pay for torch (the router starts fast and never imports it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmesh.errors import (
    ClosedError,
    ConfigError,
    CorruptChunkError,
    KVMeshError,
    TierError,
    TierUnavailableError,
)

if TYPE_CHECKING:
    from kvmesh.config import CacheConfig
    from kvmesh.core.engine import CacheEngine
    from kvmesh.core.keys import KVLayout

_LAZY = {
    "CacheConfig": "kvmesh.config",
    "CacheEngine": "kvmesh.core.engine",
    "KVLayout": "kvmesh.core.keys",
}

__all__ = [
    "CacheConfig",
    "CacheEngine",
    "ClosedError",
    "ConfigError",
    "CorruptChunkError",
    "KVLayout",
    "KVMeshError",
    "TierError",
    "TierUnavailableError",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmesh' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
