"""Speculative entries: blocks a replica is about to hold because a request was just sent there.

Between a routing decision and the replica's ``BlockStored`` events there is a window (one
prefill) in which a second request with the same prefix would otherwise be sent elsewhere.
Entries live ``ttl_s`` and count as GPU. Not thread-safe: :class:`BlockIndex` holds its lock.

Keyed by block, not by replica: ``key → (holder mask, {replica id: expiry})``. A lookup is
one dict probe and one OR per prompt block whatever the fleet size: an earlier layout kept
one dict per replica (1,000 probes per block with a request in flight on each of 1,000
replicas), and a hot system prompt held speculatively by hundreds of replicas must not
cost hundreds of steps per block either. Each added batch is kept on a heap by expiry and
removed key by key when it expires, so after :meth:`expire` every mask is exact.
"""

from __future__ import annotations

import heapq

from kvmesh.index.media import BITS, GPU_BIT

_GPU_BIT = GPU_BIT  # speculative holdings count as GPU


class Held:
    """One key's speculative holders: their GPU bits (``1 << (BITS*rid + GPU_BIT)``) and expiries."""

    __slots__ = ("mask", "rids")

    def __init__(self, rid: int, expiry: float) -> None:
        self.mask = 1 << (BITS * rid + _GPU_BIT)
        self.rids = {rid: expiry}


class SpeculativeTable:
    def __init__(self) -> None:
        self.keys: dict[bytes, Held] = {}
        # (expiry, seq, rid, block size, keys, rid's generation): a generation older than
        # the rid's current one belongs to a dropped replica (the id may have been reused).
        self._heap: list[tuple[float, int, int, int, tuple[bytes, ...], int]] = []
        self._gen: dict[int, int] = {}
        self._seq = 0
        self._held = 0  # (key, replica) pairs in ``keys``
        self.sizes: dict[int, int] = {}  # block size → live batches, so queries hash that size

    def __len__(self) -> int:
        """Keys held, counted once per replica that holds them."""
        return self._held

    def add(self, rid: int, block_size: int, keys: tuple[bytes, ...], expiry: float) -> None:
        if not keys:
            return
        table = self.keys
        added = 0
        bit = 1 << (BITS * rid + _GPU_BIT)
        for key in keys:
            held = table.get(key)
            if held is None:
                table[key] = Held(rid, expiry)
                added += 1
            else:
                old = held.rids.get(rid)
                if old is None:
                    added += 1
                    held.rids[rid] = expiry
                    held.mask |= bit
                elif old < expiry:
                    held.rids[rid] = expiry
        self._held += added
        self._seq += 1
        heapq.heappush(self._heap, (expiry, self._seq, rid, block_size, keys, self._gen.get(rid, 0)))
        self.sizes[block_size] = self.sizes.get(block_size, 0) + 1

    def expire(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, rid, bs, keys, gen = heapq.heappop(heap)
            self.sizes[bs] -= 1
            if gen == self._gen.get(rid, 0):
                self._unlink(rid, keys, now)

    def _unlink(self, rid: int, keys: tuple[bytes, ...], now: float) -> None:
        """Remove ``rid`` from ``keys`` where its expiry is ``<= now`` (a later add keeps it)."""
        table = self.keys
        clear = ~(1 << (BITS * rid + _GPU_BIT))
        for key in keys:
            held = table.get(key)
            if held is None:
                continue
            expiry = held.rids.get(rid)
            if expiry is not None and expiry <= now:
                del held.rids[rid]
                held.mask &= clear
                self._held -= 1
                if not held.rids:
                    del table[key]

    def holders(self, key: bytes, now: float) -> list[int]:
        """Replica ids that hold ``key`` speculatively at ``now``."""
        held = self.keys.get(key)
        return [rid for rid, expiry in held.rids.items() if expiry > now] if held else []

    def drop(self, rid: int) -> None:
        """Forget ``rid``'s entries (its cache was cleared, or it left and the id may be reused)."""
        gen = self._gen.get(rid, 0)
        for _, _, r, _, keys, g in self._heap:
            if r == rid and g == gen:
                self._unlink(rid, keys, float("inf"))
        self._gen[rid] = gen + 1
