"""The kvmesh exception tree.

::

    KVMeshError
    ├── ConfigError            (also a ValueError) bad or unknown configuration key/value
    ├── TierError              a tier failed; the engine turns it into a miss and a metric
    │   ├── TierUnavailableError   the backing service is down / unreachable
    │   └── TierFullError          no space left (disk full, byte budget exhausted)
    ├── CorruptChunkError      a stored chunk failed its header, token or checksum check
    └── PoolExhaustedError     no pool memory could be freed (everything pinned or in use)

Input validation errors are the built-in ``TypeError`` / ``ValueError`` (wrong token type,
wrong KV shape or dtype), because callers already expect those from Python APIs.
Errors from a lower tier never reach ``CacheEngine.store`` / ``retrieve`` callers: a failing
tier degrades to a miss.
"""

from __future__ import annotations


class KVMeshError(Exception):
    """Base class of every error kvmesh raises on purpose."""


class ConfigError(KVMeshError, ValueError):
    """A configuration key is unknown or its value is invalid."""


class TierError(KVMeshError):
    """A storage tier could not complete an operation."""


class TierUnavailableError(TierError):
    """The service behind a tier (Redis, a mount) cannot be reached."""


class TierFullError(TierError):
    """The tier has no space left for a write."""


class CorruptChunkError(KVMeshError):
    """A stored chunk failed verification: it must be treated as a miss."""


class PoolExhaustedError(KVMeshError):
    """The host memory pool has no free slot and nothing evictable."""
