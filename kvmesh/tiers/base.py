"""The ``Tier`` seam and the URL-scheme registry.

A lower tier (disk, Redis, shared filesystem) stores serialized chunks (see
:mod:`kvmesh.core.serde`). The contract every tier keeps:

* **Batched.** Every operation takes a sequence of keys and answers per key, in order.
* **Errors.** Backend errors are translated at this boundary: ``contains``/``get`` never
  raise for a missing or corrupt object (it is a miss; a corrupt object is deleted and
  counted in ``metrics.corrupt``, one that fails its fleet-key MAC in
  ``metrics.unauthenticated``: see :func:`count_rejected`). A backend that cannot be reached raises
  :class:`~kvmesh.errors.TierUnavailableError`; a full one makes ``put`` return ``False``
  for the chunks it could not store (counted in ``metrics.skipped_stores``). The engine
  turns any :class:`~kvmesh.errors.TierError` into a miss, never into a failed request.
* **Threads.** Every method may be called from several threads at once.
* **Buffers.** ``put`` does not keep references to the buffers it was given once it
  returns; ``get`` returns buffers the caller owns. With ``into``, ``get`` reads a raw
  payload into the buffer ``into(nbytes)`` returns (memory the caller preallocated:
  fresh pages cost more to fault in here than the copy itself).
* **Verification.** ``get`` reads and writes chunks in ``options.chunk_format``
  (:class:`~kvmesh.core.serde.ChunkFormat`: the fleet key, encryption, the engine's
  layout): it verifies the header tag (MAC) before parsing the header, the header's key,
  tokens, layout and sizes before allocating, and the payload's tag before decoding it; the
  caller checks the chunk's own tokens against what it asked for.

Optional features are **declared**, never sniffed: every tier (the cpu tier too) carries a
``features`` flag set (:class:`Feature`), and :func:`as_pinnable` / :func:`as_recodable` /
:func:`as_advisable` narrow a tier to the protocol of a feature it declares (``None`` when
it does not). Callers never ask ``hasattr`` or compare tier names. Re-encoding stored chunks is written once,
in :func:`recode`, over the two primitives a :class:`RecodableTier` provides.

Tiers register a factory under their URL schemes with :func:`register_tier`;
:func:`open_tier` picks the factory from the URL's scheme — never an if-chain. A new tier
(S3, Redis Cluster, ...) registers itself with the decorator and, to be found without an
import, adds its scheme to ``_BUILTIN_MODULES``.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast, runtime_checkable
from urllib.parse import urlsplit

import numpy as np

from kvmesh.config_lmcache import redact_url
from kvmesh.core import serde
from kvmesh.core.fleetkey import unauthenticated_warning
from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.core.serde import Buffer, ChunkFormat, ChunkHeader, Mode, empty_buffer, reused_buffer
from kvmesh.errors import ConfigError, CorruptChunkError, UnauthenticatedChunkError
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
    lifetime: str = ""  # lifetime class of a write (kvmesh.tiers.placement); "" = store


@dataclass
class TierOptions:
    """Options every tier factory receives; a tier ignores those it has no use for."""

    name: str = ""  # "disk", "remote", ... (metrics label)
    capacity_bytes: int | None = None  # byte budget; None = unbounded
    codec: str = "raw"
    chunk_size: int = 256
    o_direct: bool = False
    read_process: bool = False  # disk: reads in a child process (kvmesh.tiers.diskproc)
    io_trace: str | None = None  # path of a JSON-lines I/O trace
    placement: str = "none"  # disk: none | hints | segments (kvmesh.tiers.placement)
    ru_size: int = 64 << 20  # disk: reclaim-unit (segment) size for segments placement
    placement_map: dict[str, str] | None = None  # disk: lifetime class -> level
    ttl_s: float | None = None
    part_bytes: int = 1 << 20
    retries: int = 3
    probe_interval_s: float = 1.0
    timeout_s: float = 5.0  # budget of one whole remote operation, retries included
    eviction_policy: str = "lru"  # a key of kvmesh.core.policy.POLICIES
    shard: int = 0  # TP rank: the disk tier's default sub-directory is rank<shard>
    subdir: str = ""  # disk tier: "" = the path itself, "auto" = <path>/rank<k>/slot<n>
    metrics: TierMetrics = field(default_factory=lambda: TierMetrics("tier"))
    # fleet key (MAC / AEAD) and the layout every chunk must have; default: checksums only
    chunk_format: ChunkFormat = field(default_factory=lambda: serde.PLAIN)


class Feature(enum.Flag):
    """Optional features a tier declares in its ``features`` attribute."""

    NONE = 0
    PIN = enum.auto()  # PinnableTier: counted pins; delete/clear keep pinned chunks unless forced
    RECODE = enum.auto()  # RecodableTier: read_stored + rewrite, so recode() can re-encode chunks
    ADVISE = enum.auto()  # AdvisableTier: advise(keys) starts reading chunks a get will want


@runtime_checkable
class TierBase(Protocol):
    """What every tier answers, the cpu tier included."""

    name: str
    metrics: TierMetrics
    features: Feature

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    def delete(self, keys: Sequence[ChunkKey]) -> int: ...

    def clear(self) -> int: ...

    def health(self) -> str:
        """``"up"``, ``"degraded"`` or ``"down"``."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Tier(TierBase, Protocol):
    """A lower tier: stores serialized chunks and hands back :class:`ChunkData`."""

    def get(self, keys: Sequence[ChunkKey], into: Into | None = None) -> list[ChunkData | None]: ...

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[ChunkData]) -> list[bool]: ...


class PinnableTier(TierBase, Protocol):
    """``Feature.PIN``. Pins are counted per key whether or not the key is present (a pin
    on an absent key applies when the chunk arrives), so every ``pin`` is undone by exactly
    one ``unpin`` and an unpin can never drop a pin somebody else took."""

    def pin(self, keys: Sequence[ChunkKey]) -> None: ...

    def unpin(self, keys: Sequence[ChunkKey]) -> None: ...

    def delete(self, keys: Sequence[ChunkKey], force: bool = False) -> int: ...

    def clear(self, force: bool = False) -> int: ...


@dataclass
class StoredChunk:
    """A verified chunk as stored: header, decoded raw KV, the bytes it occupies, an
    opaque ``version`` that :meth:`RecodableTier.rewrite` checks (``None``: unversioned),
    and the header's bytes where the reader kept them (the disk tier's reader process sends
    them to the tier, which verifies them again rather than trust a parsed copy)."""

    header: ChunkHeader
    raw: Buffer
    stored_bytes: int
    version: int | None = None
    header_bytes: bytes = b""


class RecodableTier(Tier, Protocol):
    """``Feature.RECODE``: the two primitives :func:`recode` needs, and the format it writes."""

    chunk_format: ChunkFormat

    def read_stored(self, keys: Sequence[ChunkKey]) -> list[StoredChunk | None]: ...

    def rewrite(self, key: ChunkKey, head: bytes, body: Buffer, version: int | None) -> int | None:
        """Replace ``key``'s stored bytes as a whole (still the ``version`` read, where the
        tier versions chunks). Returns the new stored size, ``None`` when nothing changed."""
        ...


class AdvisableTier(TierBase, Protocol):
    """``Feature.ADVISE``: ``advise(keys)`` tells the tier that ``get(keys)`` follows, so it
    can start the reads before the get is asked (a disk, while vLLM schedules the step).
    Returns at once; best effort: never raises, and a key it does not hold is ignored."""

    def advise(self, keys: Sequence[ChunkKey]) -> None: ...


def as_advisable(tier: TierBase) -> AdvisableTier | None:
    """``tier`` as an :class:`AdvisableTier` when it declares ``Feature.ADVISE``, else ``None``."""
    return cast(AdvisableTier, tier) if Feature.ADVISE in tier.features else None


def as_pinnable(tier: TierBase) -> PinnableTier | None:
    """``tier`` as a :class:`PinnableTier` when it declares ``Feature.PIN``, else ``None``."""
    return cast(PinnableTier, tier) if Feature.PIN in tier.features else None


def as_recodable(tier: TierBase) -> RecodableTier | None:
    """``tier`` as a :class:`RecodableTier` when it declares ``Feature.RECODE``, else ``None``."""
    return cast(RecodableTier, tier) if Feature.RECODE in tier.features else None


def recode(tier: RecodableTier, keys: Sequence[ChunkKey], codec: str) -> tuple[int, int]:
    """Re-encode the stored chunks of ``keys`` with ``codec``. Returns their stored bytes
    before and after, summed over the keys found (a chunk already in ``codec``, or one whose
    rewrite failed, counts the same on both sides). Later writes keep the tier's own codec."""
    codec = serde.get_codec(codec).name
    before = after = 0
    for key, item in zip(keys, tier.read_stored(keys), strict=True):
        if item is None:
            continue
        before += item.stored_bytes
        if item.header.codec == codec:
            after += item.stored_bytes
            continue
        head, body = tier.chunk_format.encode(key, item.header.layout, item.header.tokens, item.raw, codec)
        new_size = tier.rewrite(key, head, body, item.version)
        after += item.stored_bytes if new_size is None else new_size
    return before, after


def payload_buffer(into: Into | None, header: ChunkHeader) -> memoryview:
    """Where a tier reads a stored payload: the caller's buffer for raw chunks when offered,
    else fresh memory. (A zstd payload is decoded into new memory anyway; a sealed one is
    decrypted into the caller's buffer by ``decode_payload``.)"""
    if header.mode == Mode.AEAD:  # ciphertext, decrypted away at once: recycled memory
        return reused_buffer(header.payload_len)
    if into is not None and header.codec == "raw":
        buf = into(header.payload_len)
        if buf is not None:
            return buf
    return empty_buffer(header.payload_len)


def shared_tier_warning(url: str | None, keyed: bool) -> str | None:
    """What start-up, stats, ``/health`` and ``kvmesh config check`` say of a shared
    (remote) tier ``url`` without a fleet key; ``None`` when there is nothing to say."""
    if keyed or not url:
        return None
    return unauthenticated_warning(f"the shared remote tier {redact_url(url)}")


def count_rejected(metrics: TierMetrics, exc: CorruptChunkError) -> bool:
    """Count a chunk that failed verification (``unauthenticated`` when its fleet-key tag
    failed, else ``corrupt``); whether the tier should delete it. A reader without a fleet
    key leaves keyed chunks alone: they belong to the fleet that has one."""
    if isinstance(exc, UnauthenticatedChunkError):
        metrics.inc("unauthenticated")
        return exc.discard
    metrics.inc("corrupt")
    return True


def counted_read(metrics: TierMetrics, key: ChunkKey, item: StoredChunk | None) -> ChunkData | None:
    """A verified read as ChunkData, counted as a hit, or ``None`` counted as a miss."""
    if item is None:
        metrics.inc("misses")
        return None
    header = item.header
    metrics.inc("hits")
    metrics.inc("bytes_out", item.stored_bytes)
    return ChunkData(key, header.layout, header.tokens, item.raw, header.codec, item.stored_bytes)


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
    "redis-sentinel": "kvmesh.tiers.redis",
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


def url_flag(query: dict[str, str], name: str) -> bool:
    """``query.pop(name)`` as a boolean: true/false, 1/0, yes/no; anything else is refused
    (``ssl=ture`` read as false once meant plain TCP)."""
    value = query.pop(name, "false").lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"{name}={value!r}; write {name}=true or {name}=false")
    return value in ("true", "1", "yes")
