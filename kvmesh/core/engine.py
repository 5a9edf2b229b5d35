"""CacheEngine: the public API over the tiers (cpu → disk → remote).

The engine orchestrates; memory, eviction order, serialization and I/O live in their own
modules. ``store`` copies chunks into the cpu pool synchronously and queues lower-tier
writes (write-through, or write-back on cpu eviction); ``retrieve`` walks the tiers in order
and promotes lower-tier hits to cpu. A failing lower tier is a miss and a metric — no tier
error ever reaches a caller of ``store`` or ``retrieve``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from kvmesh.config import CacheConfig
from kvmesh.core.keys import ChunkKey, KeyBuilder, KVLayout, as_token_array
from kvmesh.core.memory import MemoryObj, MemoryPool, copy_kv, torch_dtype
from kvmesh.core.offload import Prefetcher, WriteBehind
from kvmesh.errors import ConfigError, TierError
from kvmesh.metrics import TierMetrics, prometheus_collector
from kvmesh.tiers.base import ChunkData, Tier, TierOptions, open_tier
from kvmesh.tiers.cpu import CPUTier

log = logging.getLogger(__name__)
TIER_NAMES = ("cpu", "disk", "remote")


@dataclass
class RetrievedChunk:
    """A chunk being read: tokens ``[start, end)``, KV view ``[layers, 2, n, heads, size]``."""

    start: int
    end: int
    kv: torch.Tensor
    tier: str


class CacheEngine:
    """Tiered KV cache of one model (one layout, one shard). Thread-safe."""

    def __init__(
        self,
        config: CacheConfig | dict[str, Any] | None = None,
        *,
        layout: KVLayout,
        model_id: str,
        shard: int = 0,
    ) -> None:
        if config is None:
            config = CacheConfig()
        elif isinstance(config, dict):
            config = CacheConfig.from_dict(config)
        self.config = config
        self.layout = layout
        self.model_id = model_id
        self.keys = KeyBuilder(
            model_id, layout, config.chunk_size, shard, config.cache_salt, config.save_unfull_chunk
        )
        self.chunk_bytes = config.chunk_size * layout.bytes_per_token
        self.metrics: dict[str, TierMetrics] = {"engine": TierMetrics("engine")}
        self.cpu = self._open_cpu()
        self.lower: dict[str, Tier] = {}
        self.writers: dict[str, WriteBehind] = {}
        if config.disk_url:
            self._open_lower("disk", config.disk_url, config.disk_serde)
        if config.remote_url:
            self._open_lower("remote", config.remote_url, config.remote_serde)
        self.prefetcher = Prefetcher()
        self._closed = False

    # -- construction --------------------------------------------------------------------
    def _open_cpu(self) -> CPUTier:
        self.metrics["cpu"] = TierMetrics("cpu")
        # With local_cpu off the pool still stages chunks, but keeps only a few.
        capacity = self.config.cpu_bytes if self.config.local_cpu else 4 * self.chunk_bytes
        try:
            pool = MemoryPool(capacity, self.chunk_bytes)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return CPUTier(pool, self.config.eviction_policy, self.metrics["cpu"], on_evict=self._on_evict)

    def _open_lower(self, name: str, url: str, codec: str) -> None:
        cfg = self.config
        metrics = TierMetrics(name)
        opts = TierOptions(
            name=name,
            capacity_bytes=cfg.disk_bytes if name == "disk" else None,
            codec=codec,
            chunk_size=cfg.chunk_size,
            o_direct=cfg.disk_o_direct,
            io_trace=cfg.disk_io_trace if name == "disk" else None,
            placement=cfg.disk_placement,
            ru_size=cfg.disk_ru_size,
            placement_map=cfg.disk_placement_map,
            ttl_s=cfg.remote_ttl_s,
            part_bytes=cfg.remote_part_size,
            timeout_s=cfg.remote_timeout_s,
            metrics=metrics,
        )
        tier = open_tier(url, opts)
        self.metrics[name] = metrics
        self.lower[name] = tier
        self.writers[name] = WriteBehind(tier, cfg.max_pending_writes, cfg.store_wait_s)

    # -- validation ----------------------------------------------------------------------
    def _check_kv(self, kv: object, num_tokens: int) -> torch.Tensor:
        if not isinstance(kv, torch.Tensor):
            raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        want_dtype = torch_dtype(self.layout.dtype)
        want_shape = self.layout.shape(num_tokens)
        if kv.dtype != want_dtype or tuple(kv.shape) != want_shape:
            raise ValueError(
                f"kv has shape {tuple(kv.shape)} dtype {str(kv.dtype).removeprefix('torch.')}; "
                f"expected shape {want_shape} dtype {self.layout.dtype} "
                "([num_layers, 2, len(tokens), num_kv_heads, head_size])"
            )
        return kv

    # -- store ---------------------------------------------------------------------------
    def store(self, tokens: object, kv: torch.Tensor) -> int:
        """Cache the chunks of ``tokens``. Returns how many tokens are now in cpu (new or
        already there). Never raises for tier trouble; skipped chunks are counted."""
        arr = as_token_array(tokens)
        kv = self._check_kv(kv, len(arr))
        return self._store(arr, lambda s, e, out: copy_kv(out, kv[:, :, s:e]))

    def store_with(self, tokens: object, fill: Any, skip_tokens: int = 0) -> int:
        """Like :meth:`store`, but ``fill(start, end, out)`` writes chunk ``[start, end)`` into
        the pool view ``out`` directly (the vLLM connector gathers paged blocks this way).
        Chunks ending at or before ``skip_tokens`` are assumed cached and not filled."""
        return self._store(as_token_array(tokens), fill, skip_tokens)

    def _store(self, arr: np.ndarray, fill: Any, skip_tokens: int = 0) -> int:
        keys = self.keys.keys_for_array(arr)
        bounds = self.keys.chunk_bounds(len(arr))
        present = self.cpu.contains(keys)
        stored_to = 0
        for key, (s, e), here in zip(keys, bounds, present, strict=True):
            if here or e <= skip_tokens:
                stored_to = e
                continue
            obj = self.cpu.allocate(
                self.chunk_bytes
                if e - s == self.config.chunk_size
                else (e - s) * self.layout.bytes_per_token,
                self.config.store_wait_s,
            )
            if obj is None:
                self.metrics["engine"].inc("skipped_stores")
                break  # a later chunk without this one can never be a prefix hit
            obj.layout = self.layout
            obj.tokens = arr[s:e].copy()
            try:
                fill(s, e, obj.tensor())
            except BaseException:
                obj.release()
                raise
            # Lifetime class (kvmesh.tiers.placement): a partial tail is superseded soonest.
            lifetime = "tail" if e - s < self.config.chunk_size else "store"
            if self.config.write_mode == "through":
                for writer in self.writers.values():
                    writer.submit(key, obj, lifetime)
            elif "remote" in self.writers:
                self.writers["remote"].submit(key, obj, lifetime)
            self.cpu.put(key, obj)
            stored_to = e
        return stored_to

    def _on_evict(self, key: ChunkKey, obj: MemoryObj) -> None:
        if self.config.write_mode == "back" and "disk" in self.writers:
            try:
                if self.lower["disk"].contains([key])[0]:
                    return
            except TierError:
                return
            tail = obj.tokens is not None and len(obj.tokens) < self.config.chunk_size
            self.writers["disk"].submit(key, obj, "tail" if tail else "evict")

    # -- lookup --------------------------------------------------------------------------
    def _locate(self, keys: Sequence[ChunkKey]) -> list[str | None]:
        """Highest tier holding each key, for the leading run of keys held anywhere."""
        where: list[str | None] = ["cpu" if h else None for h in self.cpu.contains(keys)]
        for name, tier in self.lower.items():
            missing = [i for i, w in enumerate(where) if w is None]
            if not missing:
                break
            # only the first run matters; ask about keys from the first miss on
            todo = missing
            try:
                hits = tier.contains([keys[i] for i in todo])
            except TierError:
                self.metrics[name].inc("errors")
                continue
            for i, h in zip(todo, hits, strict=True):
                if h:
                    where[i] = name
        leading: list[str | None] = []
        for w in where:
            if w is None:
                break
            leading.append(w)
        return leading

    def lookup(self, tokens: object, pin: bool = False) -> int:
        """How many leading tokens can be retrieved (a chunk multiple unless
        ``save_unfull_chunk``). With ``pin``, the chunks found are pinned until
        :meth:`unpin` so eviction cannot take back what was promised."""
        arr = as_token_array(tokens)
        keys = self.keys.keys_for_array(arr)
        where = self._locate(keys)
        if pin and where:
            self._pin_keys(keys[: len(where)])
        return self.keys.chunk_bounds(len(arr))[len(where) - 1][1] if where else 0

    def locate(self, tokens: object) -> list[tuple[int, int, str]]:
        """``(start, end, tier)`` of each leading chunk held somewhere."""
        arr = as_token_array(tokens)
        keys = self.keys.keys_for_array(arr)
        bounds = self.keys.chunk_bounds(len(arr))
        return [(s, e, w) for (s, e), w in zip(bounds, self._locate(keys), strict=False) if w]

    # -- retrieve ------------------------------------------------------------------------
    @contextmanager
    def retrieve_chunks(
        self, tokens: object, max_tokens: int | None = None
    ) -> Iterator[list[RetrievedChunk]]:
        """Views of the leading chunks that can be read, valid inside the ``with`` block
        (they hold pool references, released on exit)."""
        arr = as_token_array(tokens)
        keys = self.keys.keys_for_array(arr)
        bounds = self.keys.chunk_bounds(len(arr))
        if max_tokens is not None:
            n = sum(1 for _, e in bounds if e <= max_tokens)
            keys, bounds = keys[:n], bounds[:n]
        held: list[MemoryObj] = []
        chunks: list[RetrievedChunk] = []
        try:
            objs = self.cpu.get(keys)
            held.extend(o for o in objs if o is not None)
            for i, (key, (s, e)) in enumerate(zip(keys, bounds, strict=True)):
                obj, tier = objs[i], "cpu"
                if obj is None:
                    found = self._get_lower(key, arr[s:e])
                    if found is None:
                        break
                    tier, tensor, promoted = found
                    if promoted is not None:
                        held.append(promoted)
                    chunks.append(RetrievedChunk(s, e, tensor, tier))
                    continue
                chunks.append(RetrievedChunk(s, e, obj.tensor(), tier))
            yield chunks
        finally:
            for o in held:
                o.release()

    def _get_lower(
        self, key: ChunkKey, expect_tokens: np.ndarray
    ) -> tuple[str, torch.Tensor, MemoryObj | None] | None:
        """Read ``key`` from the first lower tier holding a valid copy and promote it.
        Returns ``(tier, view, pool object the caller must release or None)``."""
        for name, tier in self.lower.items():
            # The tier reads straight into a pool slot (the promotion target): no fresh
            # memory to fault in, no second copy.
            slots: list[MemoryObj] = []
            into = partial(self._slot_for_read, slots)
            try:
                got = tier.get([key], into=into)[0]
            except TierError:
                self.metrics[name].inc("errors")
                got = None
            if got is not None and (
                got.layout != self.layout or not np.array_equal(got.tokens, expect_tokens)
            ):
                # A hash collision or a foreign writer: never serve it.
                self.metrics[name].inc("corrupt")
                self._safe_delete(tier, name, [key])
                got = None
            if got is None:
                for obj in slots:
                    obj.release()
                continue
            if slots and np.shares_memory(
                np.frombuffer(got.data, dtype=np.uint8), slots[0].byte_view().numpy()
            ):
                obj = slots[0]
                obj.layout, obj.tokens = self.layout, np.array(got.tokens, dtype=np.uint32)
                self.cpu.put(key, obj.ref_up())  # the tier takes one reference, the reader keeps one
                return name, obj.tensor(), obj
            for obj in slots:
                obj.release()
            view, promoted = self._promote(key, got)
            return name, view, promoted
        return None

    def _slot_for_read(self, slots: list[MemoryObj], nbytes: int) -> memoryview | None:
        """``Tier.get(into=...)``: one pool slot per read, remembered in ``slots``."""
        if not self.config.promote_on_hit or slots or nbytes > self.chunk_bytes:
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

    def retrieve(self, tokens: object, out: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
        """``(n, kv)``: the KV of the first ``n`` tokens, ``[layers, 2, n, heads, size]``.
        With ``out`` (a preallocated ``[layers, 2, >= n, heads, size]`` tensor) the KV is
        copied there and ``kv`` is a view of it: no allocation on the hot path."""
        with self.retrieve_chunks(tokens) as chunks:
            n = chunks[-1].end if chunks else 0
            if out is None:
                out = torch.empty(self.layout.shape(n), dtype=torch_dtype(self.layout.dtype))
            elif out.dim() != 5 or out.shape[2] < n or out.dtype != torch_dtype(self.layout.dtype):
                raise ValueError(
                    f"out has shape {tuple(out.shape)} dtype {out.dtype}; expected "
                    f"{self.layout.shape(n)} or longer along dim 2, dtype {self.layout.dtype}"
                )
            for c in chunks:
                copy_kv(out[:, :, c.start : c.end], c.kv)
        return n, out[:, :, :n]

    def prefetch(self, tokens: object) -> bool:
        """Bring lower-tier chunks of ``tokens`` up to cpu in the background."""
        arr = as_token_array(tokens)

        def job() -> None:
            with self.retrieve_chunks(arr):
                pass

        return self.prefetcher.submit(job)

    # -- pins, clear, move ---------------------------------------------------------------
    def _pin_keys(self, keys: Sequence[ChunkKey]) -> None:
        self.cpu.pin(keys)
        disk = self.lower.get("disk")
        if disk is not None and hasattr(disk, "pin"):
            disk.pin(keys)

    def pin(self, tokens: object) -> int:
        """Pin the chunks of ``tokens`` in cpu (and disk): never evicted until unpinned."""
        keys = self.keys.keys(tokens)
        self._pin_keys(keys)
        return len(keys)

    def unpin(self, tokens: object) -> int:
        keys = self.keys.keys(tokens)
        self.cpu.unpin(keys)
        disk = self.lower.get("disk")
        if disk is not None and hasattr(disk, "unpin"):
            disk.unpin(keys)
        return len(keys)

    def _safe_delete(self, tier: Tier, name: str, keys: Sequence[ChunkKey]) -> int:
        try:
            return tier.delete(keys)
        except TierError:
            self.metrics[name].inc("errors")
            return 0

    def clear(
        self, tier: str | None = None, tokens: object | None = None, force: bool = False
    ) -> dict[str, int]:
        """Drop chunks from one tier or all; only those of ``tokens`` if given. Pinned
        chunks stay unless ``force``. Returns chunks dropped per tier."""
        names = self._tier_names(tier)
        keys = self.keys.keys(tokens) if tokens is not None else None
        out: dict[str, int] = {}
        for name in names:
            if name == "cpu":
                out[name] = self.cpu.delete(keys, force) if keys is not None else self.cpu.clear(force)
                continue
            t = self.lower[name]
            if keys is not None:
                out[name] = self._safe_delete(t, name, keys)
            else:
                try:
                    # Only the disk tier knows pins; the shared tiers have none to respect.
                    out[name] = t.clear(force=force) if name == "disk" else t.clear()  # type: ignore[call-arg]
                except TierError:
                    self.metrics[name].inc("errors")
                    out[name] = 0
        return out

    def _tier_names(self, tier: str | None) -> list[str]:
        available = ["cpu", *self.lower]
        if tier is None:
            return available
        if tier not in available:
            raise ValueError(f"unknown tier {tier!r}; this engine has: {', '.join(available)}")
        return [tier]

    def move(self, tokens: object, tier: str) -> int:
        """Make ``tier`` the highest tier holding the chunks of ``tokens``: copy them there
        and drop them from the tiers above it. Returns bytes moved."""
        names = self._tier_names(tier)
        target = names[0]
        order = ["cpu", *self.lower]
        above = order[: order.index(target)]
        arr = as_token_array(tokens)
        keys = self.keys.keys_for_array(arr)
        moved = 0
        with self.retrieve_chunks(arr) as chunks:
            for key, c in zip(keys, chunks, strict=False):
                nbytes = c.kv.numel() * c.kv.element_size()
                if target != "cpu":
                    t = self.lower[target]
                    try:
                        if not t.contains([key])[0]:
                            raw = c.kv.contiguous().view(torch.uint8).reshape(-1).numpy().data
                            toks = arr[c.start : c.end].copy()
                            # Moved here on purpose (prewarm, pin): the longest-lived class.
                            chunk = ChunkData(key, self.layout, toks, raw, lifetime="pinned")
                            if not t.put([key], [chunk])[0]:
                                continue
                            moved += nbytes
                    except TierError:
                        self.metrics[target].inc("errors")
                        continue
                elif c.tier != "cpu":
                    moved += nbytes
                for name in above:
                    if name == "cpu":
                        self.cpu.delete([key], force=True)
                    else:
                        self._safe_delete(self.lower[name], name, [key])
        return moved

    # -- lifecycle -----------------------------------------------------------------------
    def wait_for_writes(self, timeout: float | None = None) -> bool:
        """Block until every write queued so far has landed. ``False`` on timeout."""
        marks = {name: w.submitted for name, w in self.writers.items()}
        return all(w.wait(timeout, upto=marks[name]) for name, w in self.writers.items())

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: m.snapshot() for name, m in self.metrics.items()}
        out["cpu"]["pinned"] = self.cpu.pinned_count()
        out["cpu"]["capacity_bytes"] = self.cpu.pool.num_slots * self.cpu.pool.slot_bytes
        for name, tier in self.lower.items():
            out[name]["health"] = tier.health()
            out[name]["write_queue_depth"] = self.writers[name].pending
        return out

    def prometheus_collector(self) -> Any:
        return prometheus_collector(self.metrics)

    def close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.prefetcher.close()
        for w in self.writers.values():
            w.close(timeout)
        for t in self.lower.values():
            t.close()
        self.cpu.close()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
