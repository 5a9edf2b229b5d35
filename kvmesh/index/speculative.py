"""Speculative entries: blocks a replica is about to hold because a request was just sent there.

Between a routing decision and the replica's ``BlockStored`` events there is a window (one
prefill) in which a second request with the same prefix would otherwise be sent elsewhere.
Entries live ``ttl_s`` and count as GPU. Not thread-safe: :class:`BlockIndex` holds its lock.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class SpeculativeTable:
    def __init__(self) -> None:
        self._holders: dict[bytes, dict[int, float]] = {}  # key → replica id → expiry
        self._heap: list[tuple[float, int, int, int, tuple[bytes, ...]]] = []
        self._seq = 0
        self.sizes: dict[int, int] = {}  # block size → live batches, so queries hash that size

    def __len__(self) -> int:
        return len(self._holders)

    def add(self, rid: int, block_size: int, keys: tuple[bytes, ...], expiry: float) -> None:
        if not keys:
            return
        for key in keys:
            holders = self._holders.setdefault(key, {})
            holders[rid] = max(holders.get(rid, expiry), expiry)
        self._seq += 1
        heapq.heappush(self._heap, (expiry, self._seq, rid, block_size, keys))
        self.sizes[block_size] = self.sizes.get(block_size, 0) + 1

    def expire(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, rid, bs, keys = heapq.heappop(heap)
            self.sizes[bs] -= 1
            for key in keys:
                holders = self._holders.get(key)
                # A later add for the same key may have extended it: only drop what is due.
                if holders is not None and rid in holders and holders[rid] <= now:
                    del holders[rid]
                    if not holders:
                        del self._holders[key]

    def holders(self, key: bytes, now: float) -> Iterable[int]:
        """Replica ids that hold ``key`` speculatively at ``now``."""
        holders = self._holders.get(key)
        if not holders:
            return ()
        return [rid for rid, expiry in holders.items() if expiry > now]

    def drop(self, rid: int) -> None:
        """Forget ``rid``'s entries (its cache was cleared, or it left and the id may be reused)."""
        for key, holders in list(self._holders.items()):
            holders.pop(rid, None)
            if not holders:
                del self._holders[key]
