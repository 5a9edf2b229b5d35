"""CacheEngine: the public API over the tiers (cpu → disk → remote).

The engine orchestrates; memory, eviction order, serialization and I/O live in their own
modules, and every call into a lower tier goes through :mod:`kvmesh.core.lower`.
``store`` copies chunks into the cpu pool synchronously and queues lower-tier writes
(write-through, or write-back on cpu eviction); ``retrieve`` walks the tiers in order
and promotes lower-tier hits to cpu. A failing lower tier is a miss and a metric — no tier
error ever reaches a caller of ``store`` or ``retrieve``. ``lookup`` and ``retrieve`` each
run under one deadline of ``remote_timeout_s`` for the remote tier (see
:mod:`kvmesh.tiers.deadline`): a slow remote makes them return fewer tokens, never late.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvmesh.config import CacheConfig
from kvmesh.core.hostmem import check_pool
from kvmesh.core.keys import ChunkKey, KeyBuilder, KVLayout, as_token_array
from kvmesh.core.loadcost import LoadCosts
from kvmesh.core.lower import LowerTiers, chunk_format_for
from kvmesh.core.memory import MemoryObj, MemoryPool, copy_kv, torch_dtype
from kvmesh.core.offload import InFlight, Prefetcher, WriteBehind
from kvmesh.errors import ConfigError, TierError
from kvmesh.metrics import TierMetrics, prometheus_collector
from kvmesh.tiers.base import ChunkData, Tier
from kvmesh.tiers.cpu import CPUTier
from kvmesh.tiers.deadline import deadline

log = logging.getLogger(__name__)
TIER_NAMES = ("cpu", "disk", "remote")
# local_cpu: false keeps a staging pool only, for chunks on their way to the lower tiers.
STAGING_BYTES = 256 << 20  # at most this much staging (or the cpu budget, if smaller), >= 4 chunks
STAGING_WAIT_S = 5.0  # how long a store waits for staging room (writes landing) before a counted skip


@dataclass(frozen=True)
class Held:
    """What :meth:`CacheEngine.lookup_detail` found."""

    tokens: int  # the leading tokens worth loading (a chunk boundary)
    below: bool  # some of them are (or were, before the lookup read them) below the cpu tier
    expect_s: float | None  # the load's predicted seconds (reads and copy); None: not measured yet


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
        # The fleet key first: a bad key file fails here, before any memory is taken.
        chunk_format = chunk_format_for(config, layout)
        self.metrics: dict[str, TierMetrics] = {"engine": TierMetrics("engine")}
        # Measured load and compute costs: a lookup never offers what is computed sooner.
        self.costs = LoadCosts(layout.bytes_per_token, config.prefill_tokens_per_s, config.skip_slow_loads)
        self.cpu = self._open_cpu()
        self._lower = LowerTiers(config, layout, shard, self.cpu, chunk_format)
        # The lower tiers in lookup order, and their write-behind queues (shared dicts).
        self.lower: dict[str, Tier] = self._lower.tiers
        self.writers: dict[str, WriteBehind] = self._lower.writers
        try:
            if config.disk_url:
                self._lower.open(
                    "disk",
                    config.disk_url,
                    config.disk_serde,
                    capacity_bytes=config.disk_bytes,
                    io_trace=config.disk_io_trace,
                )
            if config.remote_url:
                self._lower.open(
                    "remote", config.remote_url, config.remote_serde, capacity_bytes=None, io_trace=None
                )
        except BaseException:
            self._lower.close(0.0)  # a disk tier opened before a failing remote keeps its lock
            self.cpu.close()
            raise
        self.metrics.update(self._lower.metrics)
        self.prefetcher = Prefetcher()
        # Stores running now, and what hands stores over from elsewhere: "stored so far"
        # (wait_for_stores, wait_for_writes, the admin API's check_finish) includes both.
        self._stores = InFlight()
        self.store_barriers: list[Callable[[float | None], bool]] = []
        self._closed = False
        self._adapter_views: dict[str, CacheEngine] = {}
        self._base = self

    def for_adapter(self, adapter: str | None) -> CacheEngine:
        """This engine as seen by requests with LoRA adapter ``adapter`` (its weights
        fingerprint; ``None``: the base model, the engine itself): the same tiers, pool, pins,
        writers and metrics, only the chunk keys differ (their namespace holds the adapter,
        :meth:`KeyBuilder.for_adapter`), so one adapter's chunks never answer another's
        lookups. Built once per adapter; close the engine, never a view."""
        if adapter == self.keys.adapter:
            return self
        if adapter is None:
            return self._base
        view = self._adapter_views.get(adapter)
        if view is None:
            view = object.__new__(CacheEngine)
            view.__dict__.update(self.__dict__)  # shares every tier object, not a copy of them
            view.keys = self._base.keys.for_adapter(adapter)
            self._adapter_views[adapter] = view
        return view

    # -- construction --------------------------------------------------------------------
    def _open_cpu(self) -> CPUTier:
        self.metrics["cpu"] = TierMetrics("cpu")
        # With local_cpu off the pool only stages chunks until their writes land: big enough
        # for a burst of stores (a store waits for room there, see _store), never a cache.
        capacity = self.config.cpu_bytes
        if not self.config.local_cpu:
            capacity = max(4 * self.chunk_bytes, min(capacity, STAGING_BYTES))
        check_pool(capacity)  # a pool the process may not fill is a kill for memory later
        try:
            pool = MemoryPool(capacity, self.chunk_bytes)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return CPUTier(pool, self.config.eviction_policy, self.metrics["cpu"], on_evict=self._on_evict)

    def _budget(self) -> Any:
        """The deadline of one lookup or retrieve (the remote tier's whole budget)."""
        return deadline(self.config.remote_timeout_s)

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
        n = self._stores.begin()
        try:
            return self._store_chunks(arr, fill, skip_tokens)
        finally:
            self._stores.end(n)

    def _store_chunks(self, arr: np.ndarray, fill: Any, skip_tokens: int) -> int:
        keys = self.keys.keys_for_array(arr)
        bounds = self.keys.chunk_bounds(len(arr))
        present = self.cpu.contains(keys)
        stored_to = 0
        # Staging only (local_cpu off): the pool is not a cache, so every store is written
        # through (write-back would leave chunks in staging that wait_for_writes never sees)
        # and a full pool means writes still landing: wait for them rather than drop.
        staging = not self.config.local_cpu and bool(self.writers)
        through = self.config.write_mode == "through" or staging
        wait_s = max(self.config.store_wait_s, STAGING_WAIT_S) if staging else self.config.store_wait_s
        for key, (s, e), here in zip(keys, bounds, present, strict=True):
            if here or e <= skip_tokens:
                stored_to = e
                continue
            obj = self.cpu.allocate(
                self.chunk_bytes
                if e - s == self.config.chunk_size
                else (e - s) * self.layout.bytes_per_token,
                wait_s,
            )
            if obj is None:
                # A later chunk without this one can never be a prefix hit: all of them go.
                left = len(keys) - keys.index(key)
                self.metrics["engine"].skip("staging_full" if staging else "pool_full", left)
                break
            obj.layout = self.layout
            obj.tokens = arr[s:e].copy()
            try:
                fill(s, e, obj.tensor())
            except BaseException:
                obj.release()
                raise
            # Lifetime class (kvmesh.tiers.placement): a partial tail is superseded soonest.
            lifetime = "tail" if e - s < self.config.chunk_size else "store"
            if through:
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
    def where(self, keys: Sequence[ChunkKey], skip: frozenset[str] = frozenset()) -> list[str | None]:
        """Highest tier holding each key, ``None`` where none does (tiers in ``skip`` not
        asked). Unlike :meth:`lookup`, not only the leading run: a sliding-window group of a
        hybrid model needs the chunks of its window, not the prefix's."""
        where: list[str | None] = ["cpu" if h else None for h in self.cpu.contains(keys)]
        with self._budget():
            self._lower.fill_locations(keys, where, skip)
        return where

    def _locate(self, keys: Sequence[ChunkKey], skip: frozenset[str] = frozenset()) -> list[str]:
        """Highest tier holding each key, for the leading run of keys held anywhere (tiers
        in ``skip`` not asked)."""
        return _leading(self.where(keys, skip))

    def lookup(self, tokens: object, pin: bool = False) -> int:
        """How many leading tokens are worth retrieving (a chunk multiple unless
        ``save_unfull_chunk``): the chunks held, cut where loading the rest is predicted
        slower than computing it (:meth:`LoadCosts.cut`). With ``pin``, the chunks offered
        are pinned until :meth:`unpin` so eviction cannot take back what was promised."""
        return self.lookup_held(tokens, pin)[0]

    def lookup_held(self, tokens: object, pin: bool = False, fetch: bool = False) -> tuple[int, bool]:
        """:meth:`lookup`, and whether some of the tokens offered are (or were, before
        ``fetch`` read them) below the cpu tier (:meth:`lookup_detail`)."""
        held = self._held(tokens, pin, fetch, predict=False)  # every lookup: no prediction
        return held.tokens, held.below

    def lookup_detail(self, tokens: object, pin: bool = False, fetch: bool = False) -> Held:
        """:meth:`lookup` with what the connector plans a load by: whether some of the
        tokens offered are (or were, before ``fetch`` read them) below the cpu tier, and
        the seconds the cost model predicts their load takes.

        ``fetch`` (a lookup that runs beside the engine's steps, as the vLLM connector's
        asynchronous ones do): the chunks that only the remote tier can hold are read now
        instead of asked about, so they cost one round trip where asking and then loading
        cost two (a Redis 200 ms away: 0.2 s of the request's TTFT). They land in the cpu
        pool, pinned with the rest. Only as many are read as the cost model would load
        were they all there (:meth:`LoadCosts.cut`), so a slow remote's probe reads one."""
        return self._held(tokens, pin, fetch, predict=True)

    def _held(self, tokens: object, pin: bool, fetch: bool, predict: bool) -> Held:
        arr = as_token_array(tokens)
        keys = self.keys.keys_for_array(arr)
        bounds = self.keys.chunk_bounds(len(arr))
        skip = self.costs.hopeless(list(self.lower), self.config.chunk_size)
        fetchable = self._lower.bounded() - skip if fetch and self.config.promote_on_hit else frozenset()
        where: list[str | None] = ["cpu" if h else None for h in self.cpu.contains(keys)]
        fetched: list[MemoryObj] = []
        landed: list[int] = []  # chunks of the leading run that the fetch read
        try:
            with self._budget():
                self._lower.fill_locations(keys, where, skip | fetchable)
                if fetchable:
                    landed = self._fetch(keys, arr, bounds, where, min(fetchable), fetched)
            leading = _leading(where)
            n = self.costs.cut(leading, bounds) if leading else 0
            if pin and n:
                self.pin_keys(keys[:n])
                # a load follows: the disk starts reading now, while the step is scheduled
                self._lower.advise([k for k, w in zip(keys[:n], where[:n], strict=True) if w != "cpu"])
        finally:
            for obj in fetched:  # pinned (or not offered) now: eviction may take the rest
                obj.release()
        below = any(i < n for i in landed) or any(w != "cpu" for w in leading[:n])
        expect = self.costs.predict_s(leading[:n], bounds[:n]) if n and predict else 0.0
        return Held(bounds[n - 1][1] if n else 0, below, expect)

    def _fetch(
        self,
        keys: Sequence[ChunkKey],
        arr: np.ndarray,
        bounds: Sequence[tuple[int, int]],
        where: list[str | None],
        tier: str,
        held: list[MemoryObj],
    ) -> list[int]:
        """Read from ``tier`` the leading chunks no faster tier holds (see
        :meth:`lookup_held`): ``where[i]`` becomes ``"cpu"`` for each that landed in the
        pool, ``tier`` for one read but not kept there; the pool objects go to ``held``.
        Returns the indices read that continue the leading run."""
        first = next((i for i, w in enumerate(where) if w is None), len(where))
        plan = [w or tier for w in where]
        last = self.costs.cut(plan, bounds)  # a cut (or a probe) is taken here, before reading
        todo = [i for i in range(first, last) if where[i] is None]
        if not todo:
            return []
        found, spent = self._lower.read_many(
            [keys[i] for i in todo], [arr[bounds[i][0] : bounds[i][1]] for i in todo], only=frozenset({tier})
        )
        held.extend(f[2] for f in found if f is not None and f[2] is not None)
        landed: list[int] = []
        for i, f in zip(todo, found, strict=True):
            if f is None:
                break  # the leading run ends here; chunks read past it stay in the pool
            landed.append(i)
        for i, kept in zip(landed, self.cpu.contains([keys[i] for i in landed]), strict=True):
            where[i] = "cpu" if kept else tier
        nbytes = sum(bounds[i][1] - bounds[i][0] for i in landed) * self.layout.bytes_per_token
        if nbytes and tier in spent:
            self.costs.observe_load(tier, nbytes, spent[tier])
        return landed

    def locate(self, tokens: object) -> list[tuple[int, int, str]]:
        """``(start, end, tier)`` of each leading chunk held somewhere."""
        arr = as_token_array(tokens)
        keys = self.keys.keys_for_array(arr)
        bounds = self.keys.chunk_bounds(len(arr))
        return [(s, e, w) for (s, e), w in zip(bounds, self._locate(keys), strict=False) if w]

    # -- retrieve ------------------------------------------------------------------------
    @contextmanager
    def retrieve_chunks(
        self, tokens: object, max_tokens: int | None = None, from_token: int = 0
    ) -> Iterator[list[RetrievedChunk]]:
        """Views of the leading chunks that can be read, valid inside the ``with`` block
        (they hold pool references, released on exit). ``from_token``: start at the chunk
        holding that token (a sliding window's first), not at the prompt's first."""
        arr = as_token_array(tokens)
        keys = self.keys.keys_for_array(arr)
        bounds = self.keys.chunk_bounds(len(arr))
        if max_tokens is not None:
            n = sum(1 for _, e in bounds if e <= max_tokens)
            keys, bounds = keys[:n], bounds[:n]
        if from_token > 0:
            first = sum(1 for _, e in bounds if e <= from_token)
            keys, bounds = keys[first:], bounds[first:]
        held: list[MemoryObj] = []
        chunks: list[RetrievedChunk] = []
        try:
            objs = self.cpu.get(keys)
            held.extend(o for o in objs if o is not None)
            with self._budget():
                missing = [i for i, o in enumerate(objs) if o is None]
                found, spent = self._lower.read_many(
                    [keys[i] for i in missing], [arr[bounds[i][0] : bounds[i][1]] for i in missing]
                )
                lower = dict(zip(missing, found, strict=True))
                loaded: dict[str, int] = {}  # tier -> bytes of this load
                for f in found:
                    if f is not None and f[2] is not None:
                        held.append(f[2])
                for i, (s, e) in enumerate(bounds):
                    obj = objs[i]
                    if obj is not None:
                        chunks.append(RetrievedChunk(s, e, obj.tensor(), "cpu"))
                        continue
                    got = lower[i]
                    if got is None:
                        break  # a miss, or the remote's budget is spent: vLLM recomputes the rest
                    tier, tensor, _ = got
                    loaded[tier] = loaded.get(tier, 0) + (e - s) * self.layout.bytes_per_token
                    chunks.append(RetrievedChunk(s, e, tensor, tier))
                for tier, nbytes in loaded.items():
                    self.costs.observe_load(tier, nbytes, spent[tier])
            yield chunks
        finally:
            for o in held:
                o.release()

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
    def pin_keys(self, keys: Sequence[ChunkKey], tiers: Sequence[str] | None = None) -> list[str]:
        """Pin ``keys`` in the tiers of ``tiers`` (default: all) that declare pins; returns
        the tiers pinned. Counted: each pin is undone by one :meth:`unpin_keys`."""
        return self._set_pins(keys, tiers, unpin=False)

    def unpin_keys(self, keys: Sequence[ChunkKey], tiers: Sequence[str] | None = None) -> list[str]:
        return self._set_pins(keys, tiers, unpin=True)

    def _set_pins(self, keys: Sequence[ChunkKey], tiers: Sequence[str] | None, unpin: bool) -> list[str]:
        names = self._tier_names(None) if tiers is None else [n for t in tiers for n in self._tier_names(t)]
        done = []
        if "cpu" in names:
            (self.cpu.unpin if unpin else self.cpu.pin)(keys)
            done.append("cpu")
        lower = [n for n in names if n != "cpu"]
        done += self._lower.unpin(keys, lower) if unpin else self._lower.pin(keys, lower)
        return done

    def pin(self, tokens: object) -> int:
        """Pin the chunks of ``tokens`` in every tier that knows pins (cpu, disk): never
        evicted until unpinned. Returns the number of chunks."""
        keys = self.keys.keys(tokens)
        self.pin_keys(keys)
        return len(keys)

    def unpin(self, tokens: object) -> int:
        keys = self.keys.keys(tokens)
        self.unpin_keys(keys)
        return len(keys)

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
            elif keys is not None:
                out[name] = self._lower.delete(name, keys, force)
            else:
                out[name] = self._lower.clear(name, force)
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
        target = self._tier_names(tier)[0]
        order = ["cpu", *self.lower]
        above = order[: order.index(target)]
        arr = as_token_array(tokens)
        keys = self.keys.keys_for_array(arr)
        moved = 0
        with self.retrieve_chunks(arr) as chunks:
            for key, c in zip(keys, chunks, strict=False):
                nbytes = c.kv.numel() * c.kv.element_size()
                if target != "cpu":
                    raw = c.kv.contiguous().view(torch.uint8).reshape(-1).numpy().data
                    # Moved here on purpose (prewarm, pin): the longest-lived class.
                    chunk = ChunkData(key, self.layout, arr[c.start : c.end].copy(), raw, lifetime="pinned")
                    stored = self._lower.put_if_absent(target, key, chunk)
                    if stored is None:
                        continue  # not in the target: keep it where it is
                    moved += nbytes if stored else 0
                elif c.tier != "cpu":
                    moved += nbytes
                for name in above:
                    if name == "cpu":
                        self.cpu.delete([key], force=True)
                    else:
                        self._lower.delete(name, [key], force=True)
        return moved

    # -- lifecycle -----------------------------------------------------------------------
    def wait_for_stores(self, timeout: float | None = None) -> bool:
        """Block until every store begun or handed over before this call is in the pool with
        its writes queued: those waiting in a :attr:`store_barriers` entry (the vLLM
        connector's saver registers its queue) and those running now. A chunk queued for the
        disk is in the pool by then too: a lookup after this sees it in both. ``False`` on
        timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for barrier in list(self.store_barriers):
            if not barrier(_left(deadline)):
                return False
        return self._stores.settle(_left(deadline))

    def writes_landed(self, timeout: float | None = None) -> tuple[bool, dict[str, bool]]:
        """Wait (up to ``timeout`` overall) for every store begun so far to be in the pool
        (:meth:`wait_for_stores`), then for the writes queued by then: whether the stores are,
        and per lower tier whether its writes have landed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        stored = self.wait_for_stores(timeout)
        marks = {name: w.submitted for name, w in self.writers.items()}
        return stored, {name: w.wait(_left(deadline), upto=marks[name]) for name, w in self.writers.items()}

    def wait_for_writes(self, timeout: float | None = None) -> bool:
        """Block until every store begun so far is in the pool and every write queued so far
        has landed (:meth:`writes_landed`). ``False`` on timeout."""
        stored, tiers = self.writes_landed(timeout)
        return stored and all(tiers.values())

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: m.snapshot() for name, m in self.metrics.items()}
        out["cpu"]["pinned"] = self.cpu.pinned_count()
        out["cpu"]["capacity_bytes"] = self.cpu.pool.num_slots * self.cpu.pool.slot_bytes
        warnings = self._lower.warnings()
        for name, tier in self.lower.items():
            out[name]["health"] = tier.health()
            out[name]["write_queue_depth"] = self.writers[name].pending
            if name in warnings:
                out[name]["warning"] = warnings[name]
        return out

    def security_warnings(self) -> list[str]:
        """What an operator must know about this engine's trust (``/health`` shows them):
        a shared tier without a fleet key takes KV from anyone who can write to it."""
        return sorted(set(self._lower.warnings().values()))

    def prometheus_collector(self) -> Any:
        return prometheus_collector(self.metrics, costs=self.cost_figures)

    def cost_figures(self) -> dict[str, Any]:
        """The measured costs (:meth:`LoadCosts.figures`) and every tier's use: what a router's
        cost model starts from, and what autoscalers read (KV use across every tier)."""
        out = self.costs.figures()
        out["chunk_size"] = self.config.chunk_size
        use: dict[str, dict[str, float | None]] = {}
        cpu = self.metrics["cpu"].gauges
        use["cpu"] = {
            "bytes_used": cpu.get("bytes_used", 0.0),
            "capacity_bytes": float(self.cpu.pool.num_slots * self.cpu.pool.slot_bytes),
        }
        for name in self.lower:
            cap = self.config.disk_bytes if name == "disk" and self.config.disk_bytes else None
            used = self.metrics[name].gauges.get("bytes_used", 0.0)
            use[name] = {"bytes_used": used, "capacity_bytes": cap}
        out["use"] = use
        return out

    def close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.prefetcher.close()
        self._lower.close(timeout)
        self.cpu.close()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _leading(where: Sequence[str | None]) -> list[str]:
    """The tiers of the leading run of chunks held somewhere (up to the first ``None``)."""
    out: list[str] = []
    for w in where:
        if w is None:
            break
        out.append(w)
    return out


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (a ``time.monotonic()``; ``None``: no limit), at least 0."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
