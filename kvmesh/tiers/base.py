"""The ``Tier`` seam and the URL-scheme registry.

A lower tier (disk, Redis, shared filesystem) stores serialized chunks (see
:mod:`kvmesh.core.serde`). The contract every tier keeps:

* **Batched.** Every operation takes a sequence of keys and answers per key, in order.
* **Errors.** Backend errors are translated at this boundary: ``contains``/``get`` never
  raise for a missing or corrupt object (it is a miss; a corrupt object is deleted and
  counted in ``metrics.corrupt``). A backend that cannot be reached raises
  :class:`~kvmesh.errors.TierUnavailableError`; a full one makes ``put`` return ``False``
  for the chunks it could not store (counted in ``metrics.skipped_stores``). The engine
  turns any :class:`~kvmesh.errors.TierError` into a miss, never into a failed request.
* **Threads.** Every method may be called from several threads at once.
* **Buffers.** ``put`` does not keep references to the buffers it was given once it
  returns; ``get`` returns buffers the caller owns. With ``into``, ``get`` reads a raw
  payload into the buffer ``into(nbytes)`` returns (memory the caller preallocated:
  fresh pages cost more to fault in here than the copy itself).
* **Verification.** ``get`` verifies the header (key) and the payload checksum; the caller
  checks the chunk's own tokens against what it asked for.

Tiers register a factory under their URL schemes with :func:`register_tier`;
:func:`open_tier` picks the factory from the URL's scheme — never an if-chain.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

import numpy as np

from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.core.serde import Buffer, ChunkHeader, empty_buffer
from kvmesh.errors import ConfigError
from kvmesh.metrics import TierMetrics

Into = Callable[[int], memoryview | None]
"""``into(nbytes)``: a buffer for a raw payload of ``nbytes`` (the engine hands out pool
slots, so a read lands in preallocated memory), or ``None`` to let the tier allocate."""


@dataclass
class ChunkData:
    """One chunk as lower tiers take and return it: raw (decoded) KV bytes."""

    key: ChunkKey
    layout: KVLayout
    tokens: np.ndarray  # this chunk's own token ids (uint32)
    data: Buffer  # raw KV bytes, layout.shape(len(tokens)), C order
    codec: str = "raw"  # codec it is stored with (informational on get)
    stored_bytes: int = 0  # bytes it occupies in the tier (set on get)


@dataclass
class TierOptions:
    """Options every tier factory receives; a tier ignores those it has no use for."""

    name: str = ""  # "disk", "remote", ... (metrics label)
    capacity_bytes: int | None = None  # byte budget; None = unbounded
    codec: str = "raw"
    chunk_size: int = 256
    o_direct: bool = False
    io_trace: str | None = None  # path of a JSON-lines I/O trace
    ttl_s: float | None = None
    part_bytes: int = 1 << 20
    retries: int = 3
    probe_interval_s: float = 1.0
    timeout_s: float = 5.0
    metrics: TierMetrics = field(default_factory=lambda: TierMetrics("tier"))


@runtime_checkable
class Tier(Protocol):
    name: str
    metrics: TierMetrics

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    def get(self, keys: Sequence[ChunkKey], into: Into | None = None) -> list[ChunkData | None]: ...

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[ChunkData]) -> list[bool]: ...

    def delete(self, keys: Sequence[ChunkKey]) -> int: ...

    def clear(self) -> int: ...

    def health(self) -> str:
        """``"up"``, ``"degraded"`` or ``"down"``."""
        ...

    def close(self) -> None: ...


def payload_buffer(into: Into | None, nbytes: int, codec: str) -> memoryview:
    """Where a tier reads a stored payload: the caller's buffer for raw chunks when offered,
    else fresh memory. (A zstd payload is decoded into new memory anyway.)"""
    if into is not None and codec == "raw":
        buf = into(nbytes)
        if buf is not None:
            return buf
    return empty_buffer(nbytes)


def counted_read(
    metrics: TierMetrics, key: ChunkKey, item: tuple[ChunkHeader, Buffer, int] | None
) -> ChunkData | None:
    """A verified read ``(header, raw bytes, stored bytes)`` as ChunkData, counted as a hit,
    or ``None`` counted as a miss."""
    if item is None:
        metrics.inc("misses")
        return None
    header, raw, stored = item
    metrics.inc("hits")
    metrics.inc("bytes_out", stored)
    return ChunkData(key, header.layout, header.tokens, raw, header.codec, stored)


TierFactory = Callable[[str, TierOptions], Tier]
_REGISTRY: dict[str, TierFactory] = {}
# Modules that register schemes on import; loaded on first use so that, for example,
# opening a disk tier never imports the Redis client.
_BUILTIN_MODULES = {
    "file": "kvmesh.tiers.disk",
    "redis": "kvmesh.tiers.redis",
    "rediss": "kvmesh.tiers.redis",
    "unix": "kvmesh.tiers.redis",
    "valkey": "kvmesh.tiers.redis",
    "fs": "kvmesh.tiers.fs",
    "s3": "kvmesh.tiers.s3",
    "redis-cluster": "kvmesh.tiers.redis_cluster",
    "mooncakestore": "kvmesh.tiers.mooncake",
    "mem": "kvmesh.tiers.testing",
    "faulty": "kvmesh.tiers.testing",
}


def register_tier(*schemes: str) -> Callable[[TierFactory], TierFactory]:
    """Decorator: make ``factory(url, options)`` the tier for these URL schemes."""

    def deco(factory: TierFactory) -> TierFactory:
        for scheme in schemes:
            _REGISTRY[scheme] = factory
        return factory

    return deco


def open_tier(url: str, options: TierOptions | None = None) -> Tier:
    """Open the tier named by ``url`` (``file:///p``, ``redis://h:p``, ``fs:///p``, ...)."""
    scheme = urlsplit(url).scheme
    if scheme not in _REGISTRY and scheme in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[scheme])
    factory = _REGISTRY.get(scheme)
    if factory is None:
        known = sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))
        raise ConfigError(f"no tier for URL {url!r} (scheme {scheme!r}); known schemes: {', '.join(known)}")
    return factory(url, options or TierOptions())


def served_schemes() -> list[str]:
    """Every URL scheme :func:`open_tier` can open (config validation lists these)."""
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def url_path(url: str) -> str:
    """The filesystem path of a ``file://`` / ``fs://`` URL; a bare path passes through."""
    parts = urlsplit(url)
    if not parts.scheme:
        return url
    # "file://relative/dir" (LMCache writes local_disk like this) means a relative path.
    return parts.netloc + parts.path if parts.netloc else parts.path
