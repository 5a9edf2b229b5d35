"""The ``cpu`` tier: hot chunks in the preallocated host pool, evicted by policy.

Unlike the lower tiers it holds live :class:`~kvmesh.core.memory.MemoryObj` s, not
serialized bytes: a hit is a view into the pool, and copies in and out run at memcpy speed.

Rules it keeps:

* A pinned key is never evicted (pins nest: ``pin`` twice needs ``unpin`` twice). A pin may
  name a key that is not here yet; it applies when the chunk arrives.
* An object somebody else still references (a reader, a pending write) is never evicted,
  so eviction can never reuse a buffer in use.
* Eviction hands each victim to ``on_evict`` (write-back to disk) before dropping the
  tier's own reference.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvmesh.core.keys import ChunkKey
from kvmesh.core.memory import MemoryObj, MemoryPool
from kvmesh.core.policy import EvictionPolicy, PinCounts, make_policy
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import Feature

EVICTION_SCAN_LIMIT = 64  # bounded work per allocation, as diskcache's cull does
WRITE_BACK_WAIT_S = 1.0  # longest allocate waits for an evicted chunk's write-back to land


class CPUTier:
    """Satisfies :class:`~kvmesh.tiers.base.TierBase` and ``PinnableTier``; its ``get`` and
    ``put`` trade pool objects, not serialized :class:`~kvmesh.tiers.base.ChunkData`."""

    name = "cpu"
    features = Feature.PIN

    def __init__(
        self,
        pool: MemoryPool,
        policy: str = "lru",
        metrics: TierMetrics | None = None,
        on_evict: Callable[[ChunkKey, MemoryObj], None] | None = None,
    ) -> None:
        self.pool = pool
        self.metrics = metrics or TierMetrics("cpu")
        self.on_evict = on_evict
        self._policy: EvictionPolicy = make_policy(policy)
        self._objs: dict[str, MemoryObj] = {}
        self._pins = PinCounts()
        self._lock = threading.RLock()

    # -- queries -------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k.text in self._objs for k in keys]

    def get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """Referenced objects (the caller must ``release`` each) or ``None`` for misses."""
        out: list[MemoryObj | None] = []
        with self._lock:
            for k in keys:
                obj = self._objs.get(k.text)
                if obj is None:
                    self.metrics.inc("misses")
                    out.append(None)
                    continue
                self._policy.touch(k.text)
                self.metrics.inc("hits")
                self.metrics.inc("bytes_out", obj.nbytes)
                out.append(obj.ref_up())
        return out

    def is_pinned(self, key: ChunkKey) -> bool:
        with self._lock:
            return key.text in self._pins

    def __len__(self) -> int:
        with self._lock:
            return len(self._objs)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._objs)

    # -- writes --------------------------------------------------------------------------
    def allocate(self, nbytes: int, wait_s: float = 0.0) -> MemoryObj | None:
        """A free pool object, evicting unpinned unreferenced chunks to make room.

        Returns ``None`` (and counts a skipped store) when nothing can be freed within
        ``wait_s`` seconds, for example when every chunk is pinned.
        """
        deadline = time.monotonic() + wait_s
        while True:
            obj = self.pool.allocate(nbytes)
            if obj is not None:
                return obj
            outcome = self._evict_some()
            seen = self.pool.releases  # after our own eviction's release, so we wait for others
            obj = self.pool.allocate(nbytes)
            if obj is not None:
                return obj
            if outcome == "freed":
                continue  # another thread took the slot: evict again
            if outcome == "held":
                # The victim's slot returns when its write-back (on_evict) lands: wait for that
                # rather than skip every store made while the pool is full in write-back mode.
                deadline = max(deadline, time.monotonic() + WRITE_BACK_WAIT_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.pool.wait_for_release(seen, remaining):
                self.metrics.skip("pool_full")
                return None

    def _evict_some(self) -> str:
        """Evict one victim: ``"freed"`` (its slot is free), ``"held"`` (``on_evict`` still
        holds it, e.g. a pending write-back) or ``"none"`` (nothing evictable)."""
        victims: list[tuple[ChunkKey, MemoryObj]] = []
        with self._lock:
            for text in self._policy.candidates(EVICTION_SCAN_LIMIT):
                obj = self._objs[text]
                if text in self._pins or obj.refs > 1:
                    continue
                del self._objs[text]
                self._policy.remove(text)
                assert obj.key is not None  # set by put()
                victims.append((obj.key, obj))
                break  # one victim frees one slot; the caller retries
            self._update_gauges()
        outcome = "none"
        for key, obj in victims:
            self.metrics.inc("evictions")
            if self.on_evict is not None:
                self.on_evict(key, obj)
            obj.release()
            outcome = "held" if obj.refs > 0 else "freed"
        return outcome

    def put(self, key: ChunkKey, obj: MemoryObj) -> bool:
        """Insert ``obj`` (the tier takes over the caller's reference). A duplicate key keeps
        the resident object and releases ``obj``."""
        obj.key = key
        with self._lock:
            if key.text in self._objs:
                self._policy.touch(key.text)
                dup = True
            else:
                self._objs[key.text] = obj
                self._policy.insert(key.text)
                dup = False
                self.metrics.inc("stores")
                self.metrics.inc("bytes_in", obj.nbytes)
                self._update_gauges()
        if dup:
            obj.release()
        return not dup

    def delete(self, keys: Iterable[ChunkKey], force: bool = False) -> int:
        """Drop chunks; pinned ones only with ``force``. Readers keep their references."""
        dropped: list[MemoryObj] = []
        with self._lock:
            for k in keys:
                if not force and k.text in self._pins:
                    continue
                obj = self._objs.pop(k.text, None)
                if obj is not None:
                    self._policy.remove(k.text)
                    dropped.append(obj)
            self._update_gauges()
        for obj in dropped:
            obj.release()
        self.metrics.inc("deletes", len(dropped))
        return len(dropped)

    def clear(self, force: bool = False) -> int:
        with self._lock:
            keys = [o.key for o in self._objs.values() if o.key is not None]
        return self.delete(keys, force=force)

    def pin(self, keys: Iterable[ChunkKey]) -> None:
        with self._lock:
            for k in keys:
                self._pins.pin(k.text)

    def unpin(self, keys: Iterable[ChunkKey]) -> None:
        with self._lock:
            for k in keys:
                self._pins.unpin(k.text)

    def pinned_count(self) -> int:
        with self._lock:
            return sum(1 for t in self._pins if t in self._objs)

    def health(self) -> str:
        return "up"

    def close(self) -> None:
        self.clear(force=True)

    def _update_gauges(self) -> None:
        self.metrics.set("objects", len(self._objs))
        self.metrics.set("bytes_used", len(self._objs) * self.pool.slot_bytes)
