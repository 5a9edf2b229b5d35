"""Speculative entries: blocks a replica is about to hold because a request was just sent there.

Between a routing decision and the replica's ``BlockStored`` events there is a window (one
prefill) in which a second request with the same prefix would otherwise be sent elsewhere.
Entries live ``ttl_s`` and count as GPU. Not thread-safe: :class:`BlockIndex` holds its lock.

Keyed by block, not by replica: ``keys`` maps a block key to the GPU bits of its speculative
holders (``1 << (BITS*rid + GPU_BIT)`` each), so a lookup is one dict probe and one OR per
prompt block whatever the fleet size (an earlier layout kept one dict per replica: 1,000
probes per block with a request in flight on each of 1,000 replicas). Each replica's own
``key → expiry`` map says which of its entries a later batch renewed. Each added batch is
kept on a heap by expiry and its keys are unlinked when it expires, so after :meth:`expire`
every mask is exact.

An add is whole-batch C steps where it can be (a 32k-token prompt is 2,000 blocks, added on
the router's loop for every request): the keys the replica did not hold come from one set
difference, its expiries from one ``dict.update``, and keys nobody held from another; only
keys another replica already holds speculatively take a step each.
"""

from __future__ import annotations

import heapq

from kvmesh.index.media import BITS, GPU_BIT

_GPU_BIT = GPU_BIT  # speculative holdings count as GPU


class SpeculativeTable:
    def __init__(self) -> None:
        self.keys: dict[bytes, int] = {}  # key → its speculative holders' GPU bits
        self._expiry: dict[int, dict[bytes, float]] = {}  # rid → key → when its entry ends
        self._top: dict[int, float] = {}  # rid → the latest expiry added for it
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
        mine = self._expiry.get(rid)
        if mine is None:
            mine = self._expiry[rid] = {}
        new = set(keys).difference(mine)  # iterates the batch, not everything rid holds
        if expiry >= self._top.get(rid, float("-inf")):
            mine.update(dict.fromkeys(keys, expiry))  # every expiry only moves later
            self._top[rid] = expiry
        else:  # a shorter ttl than an earlier add: keep each key's later expiry
            for key in keys:
                if mine.get(key, expiry) <= expiry:
                    mine[key] = expiry
        if new:
            table = self.keys
            bit = 1 << (BITS * rid + _GPU_BIT)
            self._held += len(new)
            shared = table.keys() & new  # held by another replica: iterates ``new``
            if shared:
                for key in shared:
                    table[key] |= bit
                new -= shared
            table.update(dict.fromkeys(new, bit))
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
        mine = self._expiry.get(rid)
        if not mine:
            return
        table = self.keys
        clear = ~(1 << (BITS * rid + _GPU_BIT))
        gone = 0
        for key in keys:
            expiry = mine.get(key)
            if expiry is not None and expiry <= now:
                del mine[key]
                gone += 1
                mask = table[key] & clear
                if mask:
                    table[key] = mask
                else:
                    del table[key]
        self._held -= gone
        if not mine:
            del self._expiry[rid]
            self._top.pop(rid, None)

    def holders(self, key: bytes, now: float) -> list[int]:
        """Replica ids that hold ``key`` speculatively at ``now`` (one step per replica: tests)."""
        return sorted(rid for rid, mine in self._expiry.items() if mine.get(key, now) > now)

    def drop(self, rid: int) -> None:
        """Forget ``rid``'s entries (its cache was cleared, or it left and the id may be reused)."""
        mine = self._expiry.get(rid)
        if mine:
            self._unlink(rid, tuple(mine), float("inf"))
        self._gen[rid] = self._gen.get(rid, 0) + 1
