"""Speculative entries: blocks a replica is about to hold because a request was just sent there.

Between a routing decision and the replica's ``BlockStored`` events there is a window (one
prefill) in which a second request with the same prefix would otherwise be sent elsewhere.
Entries live ``ttl_s`` and count as GPU. Not thread-safe: :class:`BlockIndex` holds its lock.

The router adds one entry per routed request, a prompt's worth of keys each time, so adding
and expiring are kept to C-level bulk operations: one ``key → expiry`` dict per replica,
updated in one call; an expired key is only dropped when its replica's dict is swept (all its
batches expired, or the dict grew to twice what its live batches added). Lookups compare
the expiry with the time, so a key not yet swept is never reported.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

_SWEEP_SLACK = 256  # a replica's dict may hold this many expired keys beyond twice its live ones


class SpeculativeTable:
    def __init__(self) -> None:
        self._maps: dict[int, dict[bytes, float]] = {}  # replica id → key → expiry
        self._latest: dict[int, float] = {}  # replica id → the latest expiry it was given
        self._live: dict[int, int] = {}  # replica id → keys its unexpired batches added
        # (expiry, seq, rid, block size, keys, the rid's map then): the map tells a batch of a
        # dropped replica from one of a new replica that reuses its id.
        self._heap: list[tuple[float, int, int, int, int, dict[bytes, float]]] = []
        self._seq = 0
        self.sizes: dict[int, int] = {}  # block size → live batches, so queries hash that size

    def __len__(self) -> int:
        """Keys held (per replica), counting expired ones not swept yet."""
        return sum(len(m) for m in self._maps.values())

    def add(self, rid: int, block_size: int, keys: tuple[bytes, ...], expiry: float) -> None:
        if not keys:
            return
        m = self._maps.get(rid)
        if m is None:
            m = self._maps[rid] = {}
        if expiry >= self._latest.get(rid, expiry):
            # Nothing of rid's expires later: setting every key to ``expiry`` keeps the max.
            m.update(dict.fromkeys(keys, expiry))
            self._latest[rid] = expiry
        else:
            for key in keys:
                old = m.get(key)
                if old is None or old < expiry:
                    m[key] = expiry
        self._live[rid] = self._live.get(rid, 0) + len(keys)
        self._seq += 1
        heapq.heappush(self._heap, (expiry, self._seq, rid, block_size, len(keys), m))
        self.sizes[block_size] = self.sizes.get(block_size, 0) + 1

    def expire(self, now: float) -> None:
        heap = self._heap
        swept: set[int] = set()
        while heap and heap[0][0] <= now:
            _, _, rid, bs, n, m = heapq.heappop(heap)
            self.sizes[bs] -= 1
            if self._maps.get(rid) is not m:
                continue  # rid was dropped since (and maybe reused)
            live = self._live[rid] = self._live[rid] - n
            if live == 0:  # none of rid's batches is live: every key of it has expired
                del self._maps[rid], self._live[rid], self._latest[rid]
            elif len(m) > 2 * live + _SWEEP_SLACK:
                swept.add(rid)
        for rid in swept:
            live_map = self._maps.get(rid)
            if live_map is None:
                continue  # its last batch expired after the sweep was due: the map is gone
            keep = {k: e for k, e in live_map.items() if e > now}
            live_map.clear()  # in place: the heap's batches name this map
            live_map.update(keep)

    def maps(self) -> list[tuple[int, dict[bytes, float]]]:
        """``(replica id, key → expiry)`` per replica; a key is held while its expiry > now."""
        return list(self._maps.items())

    def holders(self, key: bytes, now: float) -> Iterable[int]:
        """Replica ids that hold ``key`` speculatively at ``now``."""
        return [rid for rid, m in self._maps.items() if m.get(key, now) > now]

    def drop(self, rid: int) -> None:
        """Forget ``rid``'s entries (its cache was cleared, or it left and the id may be reused)."""
        self._maps.pop(rid, None)
        self._live.pop(rid, None)
        self._latest.pop(rid, None)
