"""The engine's lower tiers (disk, remote): opening them, their write-behind queues, and
reads that land in the cpu pool.

Every call into a lower tier goes through here, so the rules hold in one place: a
:class:`~kvmesh.errors.TierError` becomes a miss and an ``errors`` count, a chunk whose
layout or tokens differ from what was asked is deleted and never served, and the remote
slot is bounded by the current operation's deadline (:mod:`kvmesh.tiers.deadline`): once
it is spent the remote tier is not asked again and its chunks are misses.
Optional features are found through the tier's declared ``features`` (``as_pinnable``),
never by name or ``hasattr``.

Every lower tier reads and writes one :class:`~kvmesh.core.serde.ChunkFormat`
(:func:`chunk_format_for`): the fleet key of ``fleet_key_file`` / ``KVMESH_FLEET_KEY_FILE``
(chunks carry a keyed MAC, or with ``encrypt_at_rest`` an AEAD), and the engine's layout, so
a stored header can never make a read allocate more than one of this engine's chunks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial

import numpy as np
import torch

from kvmesh.config import CacheConfig
from kvmesh.core.fleetkey import FleetKey
from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.core.memory import MemoryObj, torch_dtype
from kvmesh.core.offload import WriteBehind
from kvmesh.core.serde import ChunkFormat
from kvmesh.errors import TierError
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import (
    ChunkData,
    Tier,
    TierOptions,
    as_advisable,
    as_pinnable,
    open_tier,
    shared_tier_warning,
)
from kvmesh.tiers.cpu import CPUTier
from kvmesh.tiers.deadline import expired

log = logging.getLogger(__name__)
BOUNDED = frozenset({"remote"})  # slots a spent operation deadline stops asking
SHARED = frozenset({"remote"})  # slots other processes write to: unauthenticated without a key
Found = tuple[str, torch.Tensor, MemoryObj | None]
"""A chunk read from a lower tier: ``(tier, view, pool object the caller must release or None)``."""


def chunk_format_for(config: CacheConfig, layout: KVLayout) -> ChunkFormat:
    """The chunk format of an engine: its fleet key (``ConfigError`` when the file cannot be
    read, or ``encrypt_at_rest`` has no key) and its layout."""
    return ChunkFormat(FleetKey.from_config(config.fleet_key_file), config.encrypt_at_rest, layout)


class LowerTiers:
    """The lower tiers of one engine, in lookup order, with one writer each."""

    def __init__(
        self,
        config: CacheConfig,
        layout: KVLayout,
        shard: int,
        cpu: CPUTier,
        chunk_format: ChunkFormat | None = None,
    ) -> None:
        self.config = config
        self.layout = layout
        self.chunk_format = chunk_format or chunk_format_for(config, layout)
        self.shard = shard
        self.cpu = cpu
        self.chunk_bytes = config.chunk_size * layout.bytes_per_token
        self.tiers: dict[str, Tier] = {}
        self.writers: dict[str, WriteBehind] = {}
        self.metrics: dict[str, TierMetrics] = {}

    def open(
        self, name: str, url: str, codec: str, *, capacity_bytes: int | None, io_trace: str | None
    ) -> None:
        cfg = self.config
        metrics = TierMetrics(name)
        opts = TierOptions(
            name=name,
            capacity_bytes=capacity_bytes,
            codec=codec,
            chunk_size=cfg.chunk_size,
            o_direct=cfg.disk_o_direct,
            read_process=cfg.disk_read_process,
            io_trace=io_trace,
            placement=cfg.disk_placement,
            ru_size=cfg.disk_ru_size,
            placement_map=cfg.disk_placement_map,
            ttl_s=cfg.remote_ttl_s,
            part_bytes=cfg.remote_part_size,
            timeout_s=cfg.remote_timeout_s,
            eviction_policy=cfg.eviction_policy,
            shard=self.shard,
            subdir=cfg.disk_subdir,
            metrics=metrics,
            chunk_format=self.chunk_format,
        )
        tier = open_tier(url, opts)
        if warning := self.warnings().get(name):
            log.warning("kvmesh: %s", warning)
        self.metrics[name] = metrics
        self.tiers[name] = tier
        self.writers[name] = WriteBehind(tier, cfg.max_pending_writes, cfg.store_wait_s)

    def warnings(self) -> dict[str, str]:
        """Per tier, what an operator must know about its trust: a shared tier without a
        fleet key takes KV from anyone who can write to it."""
        w = shared_tier_warning(self.config.remote_url, self.chunk_format.fleet_key is not None)
        return {name: w for name in SHARED} if w else {}

    def _skip(self, name: str) -> bool:
        return name in BOUNDED and expired()

    # ---- queries ----------------------------------------------------------------------

    def fill_locations(
        self, keys: Sequence[ChunkKey], where: list[str | None], skip: frozenset[str] = frozenset()
    ) -> None:
        """Set ``where[i]`` to the first lower tier holding ``keys[i]``, for keys not found
        yet (``None``); only keys from the first miss on are asked about. Tiers in ``skip``
        are not asked (:meth:`kvmesh.core.loadcost.LoadCosts.hopeless`)."""
        for name, tier in self.tiers.items():
            first = next((i for i, w in enumerate(where) if w is None), None)
            if first is None:
                return
            if self._skip(name) or name in skip:
                continue
            todo = [i for i in range(first, len(where)) if where[i] is None]
            try:
                hits = tier.contains([keys[i] for i in todo])
            except TierError:
                self.metrics[name].inc("errors")
                continue
            for i, h in zip(todo, hits, strict=True):
                if h:
                    where[i] = name

    def contains(self, name: str, keys: Sequence[ChunkKey]) -> list[bool]:
        """Raises TierError (callers that report per-tier errors want it)."""
        return self.tiers[name].contains(keys)

    # ---- reads into the pool ----------------------------------------------------------

    def advise(self, keys: Sequence[ChunkKey]) -> None:
        """Tell every tier that can take the hint that reads of ``keys`` follow (the disk
        starts them on its I/O threads and returns at once)."""
        if not keys:
            return
        for name, tier in self.tiers.items():
            advisable = as_advisable(tier)
            if advisable is not None and not self._skip(name):
                advisable.advise(keys)

    def bounded(self) -> frozenset[str]:
        """The open tiers whose calls the operation deadline bounds (the remote)."""
        return frozenset(self.tiers) & BOUNDED

    def read_many(
        self,
        keys: Sequence[ChunkKey],
        expect_tokens: Sequence[np.ndarray],
        only: frozenset[str] | None = None,
    ) -> tuple[list[Found | None], dict[str, float]]:
        """Read each of ``keys`` from the first lower tier holding a valid copy, and promote
        it: per key ``(tier, view, pool object the caller must release or None)``, or
        ``None``; and the seconds each tier's read took.

        One ``get`` per tier for every key still missing, so a remote tier is asked once per
        load, not once per chunk: its client pipelines the batch into one round trip
        (15 chunks from a Redis 200 ms away took 3 s read one at a time, 0.2 s in one
        pipeline), and the disk tier reads what ``advise`` already started. ``only``: read
        from those tiers alone.
        """
        out: list[Found | None] = [None] * len(keys)
        spent: dict[str, float] = {}
        for name, tier in self.tiers.items():
            todo = [i for i, f in enumerate(out) if f is None]
            if not todo:
                break
            if self._skip(name) or (only is not None and name not in only):
                continue
            # The tier reads straight into pool slots (the promotion targets): no fresh
            # memory to fault in, no second copy.
            slots: list[MemoryObj] = []
            t0 = time.perf_counter()
            try:
                got = tier.get([keys[i] for i in todo], into=partial(self._slot_for_read, slots))
            except TierError:
                self.metrics[name].inc("errors")
                got = [None] * len(todo)
            spent[name] = time.perf_counter() - t0
            used: set[int] = set()
            for i, item in zip(todo, got, strict=True):
                if item is None:
                    continue
                if item.layout != self.layout or not np.array_equal(item.tokens, expect_tokens[i]):
                    # A hash collision or a foreign writer: never serve it.
                    self.metrics[name].inc("corrupt")
                    self.delete(name, [keys[i]], force=True)
                    continue
                out[i] = self._land(name, keys[i], item, slots, used)
            for j, obj in enumerate(slots):
                if j not in used:
                    obj.release()
        return out, spent

    def _land(
        self, name: str, key: ChunkKey, got: ChunkData, slots: list[MemoryObj], used: set[int]
    ) -> Found:
        """The chunk read into one of ``slots`` becomes that slot's cpu entry; one read
        into fresh memory is promoted by a copy (or served as it is, promotion off)."""
        data = np.frombuffer(got.data, dtype=np.uint8)
        for j, obj in enumerate(slots):
            if j not in used and np.shares_memory(data, obj.byte_view().numpy()):
                used.add(j)
                obj.layout, obj.tokens = self.layout, np.array(got.tokens, dtype=np.uint32)
                self.cpu.put(key, obj.ref_up())  # the tier takes one reference, the reader keeps one
                return name, obj.tensor(), obj
        view, promoted = self._promote(key, got)
        return name, view, promoted

    def _slot_for_read(self, slots: list[MemoryObj], nbytes: int) -> memoryview | None:
        """``Tier.get(into=...)``: one pool slot per chunk read, remembered in ``slots``
        (a tier may call it from several threads: ``list.append`` is atomic)."""
        if not self.config.promote_on_hit or nbytes > self.chunk_bytes:
            return None
        obj = self.cpu.allocate(nbytes)
        if obj is None:
            return None
        slots.append(obj)
        return obj.raw()

    def _promote(self, key: ChunkKey, got: ChunkData) -> tuple[torch.Tensor, MemoryObj | None]:
        data = got.data
        if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly):
            data = bytearray(data)
        src = torch.from_numpy(np.frombuffer(data, dtype=np.uint8))
        if self.config.promote_on_hit:
            obj = self.cpu.allocate(src.numel())
            if obj is not None:
                obj.layout, obj.tokens = self.layout, np.array(got.tokens, dtype=np.uint32)
                obj.byte_view().copy_(src)
                self.cpu.put(key, obj.ref_up())  # the tier takes one reference, the reader keeps one
                return obj.tensor(), obj
        dtype = torch_dtype(self.layout.dtype)
        return src.view(dtype).view(self.layout.shape(len(got.tokens))), None

    # ---- writes, pins, deletes --------------------------------------------------------

    def put_if_absent(self, name: str, key: ChunkKey, chunk: ChunkData) -> bool | None:
        """Store ``chunk`` in ``name`` unless it is there: ``True`` stored now, ``False``
        already there, ``None`` not stored (full, or the tier failed)."""
        tier = self.tiers[name]
        try:
            if tier.contains([key])[0]:
                return False
            return True if tier.put([key], [chunk])[0] else None
        except TierError:
            self.metrics[name].inc("errors")
            return None

    def pin(self, keys: Sequence[ChunkKey], names: Sequence[str] | None = None) -> list[str]:
        """Pin ``keys`` in every pinnable lower tier (of ``names``); the tiers pinned."""
        return self._pins(keys, names, unpin=False)

    def unpin(self, keys: Sequence[ChunkKey], names: Sequence[str] | None = None) -> list[str]:
        return self._pins(keys, names, unpin=True)

    def _pins(self, keys: Sequence[ChunkKey], names: Sequence[str] | None, unpin: bool) -> list[str]:
        done = []
        for name in self.tiers if names is None else names:
            tier = as_pinnable(self.tiers[name])
            if tier is not None:
                (tier.unpin if unpin else tier.pin)(keys)
                done.append(name)
        return done

    def pinnable(self, name: str) -> bool:
        return as_pinnable(self.tiers[name]) is not None

    def delete(self, name: str, keys: Sequence[ChunkKey], force: bool = False) -> int:
        tier = self.tiers[name]
        pinnable = as_pinnable(tier)
        try:
            return pinnable.delete(keys, force=force) if pinnable is not None else tier.delete(keys)
        except TierError:
            self.metrics[name].inc("errors")
            return 0

    def clear(self, name: str, force: bool = False) -> int:
        tier = self.tiers[name]
        pinnable = as_pinnable(tier)
        try:
            # Tiers without pins (the shared ones) have none to respect.
            return pinnable.clear(force=force) if pinnable is not None else tier.clear()
        except TierError:
            self.metrics[name].inc("errors")
            return 0

    def close(self, timeout: float) -> None:
        for w in self.writers.values():
            w.close(timeout)
        for t in self.tiers.values():
            t.close()
