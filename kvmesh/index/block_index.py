"""The router's block index: which replica holds which prefix, in which medium.

Keys are kvmesh's own chained xxh3-128 hashes over each block's token ids, rooted in the
block size and LoRA name, never the engine's block hashes: those depend on the engine's
hash algorithm and ``PYTHONHASHSEED``, so two replicas (or the router) could not agree on
them. Engine hashes are kept per replica only as opaque ids, to find the parent of a new
``BlockStored`` and to resolve ``BlockRemoved``.

Layout, chosen for memory (1M blocks in a few hundred MB) and lookup speed:

* ``_blocks``: our key → ``(mask >> shift, shift, block_size, rid, engine_hash, rid,
  engine_hash, …)`` in LRU order. ``mask`` has a byte per replica id, bit ``8*rid + slot``
  (the medium's bit, ordered by rank: :mod:`kvmesh.index.media`); one Python int answers
  "who holds this block, where" with a few shifts. It is stored shifted down to its lowest
  holder, so its size follows the spread of the holders' ids, not the highest id (at 1,000
  replicas that was 250-500 of ~650 bytes per block with a nibble per replica).
* ``_emap[rid][block_size]``: engine hash → our key. Split by block size because vLLM's
  offloading may reuse a GPU block's hash for a larger CPU block with other tokens.

A medium with no alias is kept under its publisher's name (up to four per index; see
:mod:`kvmesh.index.media`). ``REMOTE`` is shared storage: a REMOTE bit set by any replica
makes the block count for every registered replica. Speculative entries (a routing decision
whose events have not arrived yet) live in a small side table and count as GPU until they
expire.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from kvmesh.events.codec import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch
from kvmesh.index.events import batch_tokens, event_keys
from kvmesh.index.matches import ReplicaMatches
from kvmesh.index.matching import match_chain, medium_counts, walk
from kvmesh.index.media import BITS, BYTE, AnyMedium, Media, medium_name, slot
from kvmesh.index.prefix import PrefixMatch, PromptKeys, chain, chain_root, combine_ranges
from kvmesh.index.speculative import SpeculativeTable

_BITS = BITS
# vLLM's KV cache spec kinds whose blocks hold every token of a prefix (kv_interface's
# KVCacheSpecKind): a store of any other kind (sliding window, mamba, ...) is not indexed.
PREFIX_KINDS = frozenset({"full_attention", "mla_attention"})
_COUNTERS = (
    "stored_blocks",
    "removed_blocks",
    "orphans",  # BlockStored whose parent we never saw (or evicted): skipped
    "invalid",  # token count does not match blocks × block_size, or bad token ids
    "placeholders",  # vLLM offloading's token-less stores (block_size 0): nothing to key them by
    "unknown_medium",  # a fifth medium without an alias (four are kept by name): skipped
    "ignored_group",  # hybrid-model KV groups other than the full-attention one, see store
    "evictions",
    "clears",
)


class BlockIndex:
    """Thread-safe index of replica × medium × block; see the module docstring.

    ``max_blocks`` bounds memory: the least recently stored or matched block is evicted.
    ``default_block_size`` is used for speculative entries before any event has been seen.
    """

    def __init__(
        self,
        max_blocks: int = 1_000_000,
        default_block_size: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self.default_block_size = default_block_size
        self._clock = clock
        self._lock = threading.Lock()
        self._rids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        # rid -> the KV cache group whose blocks name whole prefixes: 0 until the replica's
        # stores say which group is full attention (vLLM 0.32's kv_cache_spec_kind); a
        # hybrid model's group 0 may be a sliding window (kvmesh's swa test model).
        self._prefix_group: dict[int, int] = {}
        # rid → name as one tuple and name → rid as a dict, both replaced (never changed) when
        # a replica comes or goes: a lookup's result keeps them, and scorers cache their
        # alignment by the tuple's identity.
        self._rid_names: tuple[str | None, ...] = ()
        self._rid_view: dict[str, int] = {}
        self._free_rids: list[int] = []
        self._low = 0  # bit 8*rid set for every registered replica (REMOTE bit positions)
        # Tuples, not lists: tuples of ints and bytes drop out of the cyclic GC, so a full
        # collection does not walk a million entries in the middle of a lookup.
        self._blocks: OrderedDict[bytes, tuple[Any, ...]] = OrderedDict()
        self._emap: dict[int, dict[int, dict[BlockHash, bytes]]] = {}
        self._size_blocks: dict[int, int] = {}  # block size → live blocks
        self._spec = SpeculativeTable()
        self.media = Media()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._last_mask = 0  # see _share()

    def _share(self, m: int) -> int:
        """``m`` (a packed mask), or the equal int object the last entry written holds.

        A chain's blocks are stored (and dropped) together, so consecutive blocks get the same
        holders: the same mask. A mask of two far-apart replicas is a big int (replicas 1 and
        334: ~360 bytes), which every block of the prompt kept a copy of.
        """
        if m == self._last_mask:
            return self._last_mask
        self._last_mask = m
        return m

    # -- replicas -------------------------------------------------------------------------

    def add_replica(self, replica: str) -> None:
        """Register a replica so that it shares REMOTE blocks even before its own events."""
        with self._lock:
            self._rid(replica)

    def replicas(self) -> list[str]:
        with self._lock:
            return sorted(self._rids)

    def clear_replica(self, replica: str) -> None:
        """Forget everything ``replica`` reported (AllBlocksCleared, or an unrepaired gap)."""
        with self._lock:
            rid = self._rids.get(replica)
            if rid is not None:
                self._counts["clears"] += 1
                self._clear(rid)

    def remove_replica(self, replica: str) -> None:
        """Forget ``replica`` and its entries; it no longer shares REMOTE blocks."""
        with self._lock:
            rid = self._rids.pop(replica, None)
            if rid is None:
                return
            self._clear(rid)
            del self._names[rid], self._emap[rid]
            self._prefix_group.pop(rid, None)
            self._rid_names = (*self._rid_names[:rid], None, *self._rid_names[rid + 1 :])
            self._rid_view = dict(self._rids)
            self._low &= ~(1 << (_BITS * rid))
            heapq.heappush(self._free_rids, rid)

    def _rid(self, replica: str) -> int:
        rid = self._rids.get(replica)
        if rid is None:
            # Reuse the lowest free id so that masks stay short under replica churn.
            rid = heapq.heappop(self._free_rids) if self._free_rids else len(self._rids)
            self._rids[replica] = rid
            self._names[rid] = replica
            names = list(self._rid_names) + [None] * (rid + 1 - len(self._rid_names))
            names[rid] = replica
            self._rid_names = tuple(names)
            self._rid_view = dict(self._rids)
            self._emap[rid] = {}
            self._low |= 1 << (_BITS * rid)
        return rid

    # -- events ---------------------------------------------------------------------------

    def apply(self, replica: str, batch: EventBatch) -> None:
        """Apply one event batch from ``replica``, in order."""
        tokens = batch_tokens(batch.events)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.store(replica, ev, tokens.get(id(ev)))
            elif isinstance(ev, BlockRemoved):
                self.remove(replica, ev.block_hashes, ev.medium, ev.group_idx, ev.locality, ev.ownership)
            elif isinstance(ev, AllBlocksCleared):
                self.clear_replica(replica)

    def store(self, replica: str, ev: BlockStored, tokens: np.ndarray | None = None) -> None:
        """Record one ``BlockStored``; ``tokens``: its token ids already validated (see
        :func:`kvmesh.index.events.batch_tokens`), else they are validated here."""
        medium = self.media.get(medium_name(ev.medium, ev.locality, ev.ownership))
        prepared = event_keys(ev, tokens) if medium is not None else None
        with self._lock:
            rid = self._rid(replica)
            if medium is None:
                self._counts["unknown_medium"] += 1
                return
            kind = ev.kv_cache_spec_kind
            if kind is not None and kind in PREFIX_KINDS:
                self._prefix_group[rid] = ev.group_idx or 0
            if (kind is not None and kind not in PREFIX_KINDS) or (
                (ev.group_idx or 0) != self._prefix_group.get(rid, 0)
            ):
                # A hybrid model's other groups (e.g. sliding window) hold only a window of a
                # prefix and drop old blocks all the time under the same hashes: never a
                # full-prefix hit, and their removals would erase the full group's prefix.
                self._counts["ignored_group"] += 1
                return
            if prepared is None:
                self._counts["placeholders" if ev.block_size == 0 else "invalid"] += 1
                return
            bs = ev.block_size
            maps = self._emap[rid]
            emap = maps.get(bs)
            if emap is None:
                emap = maps[bs] = {}
            if ev.parent_block_hash is None:
                prev = chain_root(bs, ev.lora_name)
            else:
                parent = emap.get(ev.parent_block_hash)
                if parent is None:
                    self._counts["orphans"] += 1
                    return
                prev = parent
            hashes = chain(prepared[0], bs, prev, prepared[1])
            self._hold(rid, medium, bs, emap, zip(ev.block_hashes, hashes, strict=True))
            self._counts["stored_blocks"] += len(hashes)
            if len(self._blocks) > self.max_blocks:
                self._evict(len(self._blocks) - self.max_blocks)

    def store_keys(
        self, replica: str, medium: str | None, block_size: int, blocks: Iterable[tuple[BlockHash, bytes]]
    ) -> None:
        """Record ``(engine hash, index key)`` pairs whose keys the caller already has.

        For callers that keep the index's keys themselves (the fleet simulator, which names
        blocks by trace ids): the same holdings as :meth:`store` without hashing tokens.
        """
        med = self.media.get(medium_name(medium))
        if med is None:
            raise ValueError(f"no room for medium {medium!r}: this index keeps {', '.join(self.media.named)}")
        with self._lock:
            rid = self._rid(replica)
            emap = self._emap[rid].setdefault(block_size, {})
            self._counts["stored_blocks"] += self._hold(rid, med, block_size, emap, blocks)
            if len(self._blocks) > self.max_blocks:
                self._evict(len(self._blocks) - self.max_blocks)

    def _hold(
        self,
        rid: int,
        medium: AnyMedium,
        bs: int,
        emap: dict[BlockHash, bytes],
        blocks: Iterable[tuple[BlockHash, bytes]],
    ) -> int:
        """``rid`` holds these ``(engine hash, key)`` blocks in ``medium``; returns how many.

        One call per event, not per block: at ~4 blocks an event the calls were ~5% of ingest.
        """
        bit = slot(medium)
        alone, rid_shift = 1 << bit, _shift(rid)  # a new entry's packed mask and shift
        table = self._blocks
        n = new = 0
        for eh, key in blocks:
            n += 1
            old = emap.get(eh)
            if old is not None and old != key:
                # The engine reused this hash for other tokens: the old block is gone from it.
                if new:  # counted first: the old block may be one this call added
                    self._size_blocks[bs] = self._size_blocks.get(bs, 0) + new
                    new = 0
                self._drop_holder(rid, old, BYTE)
            entry = table.get(key)
            if entry is None:
                table[key] = (alone, rid_shift, bs, rid, eh)
                new += 1
                emap[eh] = key
                continue
            table.move_to_end(key)
            # Worked on packed (see _drop_holder): the mask is never unpacked, a big int
            # allocation or more per block held by far-apart replicas.
            m, shift, holders = entry[0], entry[1], entry[3:]
            at = _BITS * rid - shift  # rid's byte in the packed mask
            if at >= 0:
                held = (m >> at) & BYTE
                m |= 1 << (at + bit)
            else:  # rid is below every holder: it becomes the lowest
                held = 0
                m = m << -at | 1 << bit
                shift = _shift(rid)
            # A replica without a bit here is not among the holders (a new holder of a shared
            # prefix, the common case): no scan of the others.
            if not held or not any(
                holders[i] == rid and holders[i + 1] == eh for i in range(0, len(holders), 2)
            ):
                holders += (rid, eh)
            table[key] = (self._share(m), shift, bs, *holders)
            emap[eh] = key
        if new:
            self._size_blocks[bs] = self._size_blocks.get(bs, 0) + new
        return n

    def remove(
        self,
        replica: str,
        block_hashes: Iterable[BlockHash],
        medium: str | None,
        group_idx: int | None = None,
        locality: str | None = None,
        ownership: str | None = None,
    ) -> None:
        """``replica`` no longer holds these engine blocks in ``medium``."""
        med = self.media.get(medium_name(medium, locality, ownership), register=False)
        with self._lock:
            rid = self._rids.get(replica)
            if rid is None or (group_idx or 0) != self._prefix_group.get(rid, 0):
                return
            if med is None:
                self._counts["unknown_medium"] += 1
                return
            bit = 1 << slot(med)
            maps = self._emap[rid].values()
            for eh in block_hashes:
                for emap in maps:
                    key = emap.get(eh)
                    if key is not None and self._drop_holder(rid, key, bit):
                        self._counts["removed_blocks"] += 1
                        break

    def _drop_holder(self, rid: int, key: bytes, bits: int) -> bool:
        """Clear ``bits`` (of rid's byte: media slots, ``BYTE`` for all) of ``rid`` on ``key``;
        unlink rid entirely once it holds nothing.

        An entry's mask is kept packed: ``(m, shift)`` is the mask ``m << shift``, shifted
        down to its lowest holder's byte (a block held by replica 999 alone is an 8-bit int and
        a shift, not an 8,000-bit int).
        """
        entry = self._blocks.get(key)
        if entry is None:
            return False
        m, shift = entry[0], entry[1]
        at = _BITS * rid - shift  # rid's byte in the packed mask (below 0: not a holder)
        if at < 0 or not (m >> at) & bits:
            return False
        m &= ~(bits << at)
        bs = entry[2]
        if (m >> at) & BYTE:  # rid still holds it in another medium
            self._blocks[key] = (self._share(m), shift, *entry[2:])
            return True
        emap = self._emap[rid].get(bs, {})
        keep: list[Any] = []
        for i in range(3, len(entry), 2):
            r, eh = entry[i], entry[i + 1]
            if r != rid:
                keep += (r, eh)
            elif emap.get(eh) == key:
                del emap[eh]
        if m:
            if not m & BYTE:  # rid was the lowest holder: down to the next one
                low = ((m & -m).bit_length() - 1) // _BITS
                m >>= _BITS * low
                shift = _shift(shift // _BITS + low)
            self._blocks[key] = (self._share(m), shift, bs, *keep)
        else:
            del self._blocks[key]
            self._size_blocks[bs] -= 1
        return True

    def _evict(self, count: int) -> None:
        """Evict the ``count`` least recently stored or matched blocks (one call, not one per
        block: a full index evicts a block for every block it stores)."""
        pop, sizes, emaps = self._blocks.popitem, self._size_blocks, self._emap
        for _ in range(count):
            key, entry = pop(last=False)
            bs = entry[2]
            sizes[bs] -= 1
            for i in range(3, len(entry), 2):
                maps = emaps.get(entry[i])
                emap = maps.get(bs) if maps is not None else None
                if emap is not None and emap.get(entry[i + 1]) == key:
                    del emap[entry[i + 1]]
        self._counts["evictions"] += count

    def _clear(self, rid: int) -> None:
        for maps in self._emap[rid].values():
            for key in list(maps.values()):
                self._drop_holder(rid, key, BYTE)
            maps.clear()
        self._spec.drop(rid)

    # -- speculative entries --------------------------------------------------------------

    def add_speculative(
        self,
        replica: str,
        tokens: object,
        ttl_s: float = 2.0,
        block_size: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Count ``tokens`` as on ``replica``'s GPU for ``ttl_s`` (a request just routed there).

        ``tokens``: token ids, or a :class:`PromptKeys` (then its keys are reused, not rehashed).
        """
        prompt = PromptKeys.of(tokens, lora_name, cache_salt)
        sizes = (block_size,) if block_size else (self._sizes() or (self.default_block_size,))
        chains = [(bs, prompt.chain(bs)) for bs in sizes]
        with self._lock:
            rid = self._rid(replica)
            now = self._clock()
            self._spec.expire(now)
            for bs, keys in chains:
                self._spec.add(rid, bs, keys, now + ttl_s)

    def expire_speculative(self) -> None:
        """Drop the speculative entries whose time is up (queries do it too; this does it early)."""
        with self._lock:
            self._spec.expire(self._clock())

    # -- queries --------------------------------------------------------------------------

    def match(
        self,
        tokens: object,
        block_size: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        replicas: Iterable[str] | None = None,
    ) -> ReplicaMatches:
        """Longest consecutive prefix of ``tokens`` per replica, with the best medium of each range.

        Every block size seen in events is tried (or only ``block_size``); per replica the
        results are combined into token ranges. Replicas without a match are left out.
        ``tokens``: token ids, or a :class:`PromptKeys` (its keys are hashed once, then reused).
        The result is a read-only mapping replica → :class:`PrefixMatch` (see
        :class:`~kvmesh.index.matches.ReplicaMatches`: its arrays serve the scorers).
        """
        prompt = PromptKeys.of(tokens, lora_name, cache_salt)
        sizes = (block_size,) if block_size else self._sizes()
        # Hashing is the bulk of the work and needs no lock.
        chains = [(bs, prompt.chain(bs)) for bs in sizes]
        per_rid: dict[int, list[list[tuple[int, int, AnyMedium]]]] = {}
        found: dict[str, PrefixMatch] = {}
        masks: list[int] = []
        alives: list[int] = []
        bs = 0
        with self._lock:
            now = self._clock()
            self._spec.expire(now)
            wanted = self._low
            if replicas is not None:
                wanted = 0
                for name in replicas:
                    rid = self._rids.get(name)
                    if rid is not None:
                        wanted |= 1 << (_BITS * rid)
            spec = self._spec.keys
            rid_names, rid_view, media = self._rid_names, self._rid_view, self.media.view
            if len(chains) == 1:
                # One block size (the usual case): arrays, ranges built only on demand.
                bs, keys = chains[0]
                masks, alives = walk(self._blocks, self._low, spec, keys, wanted)
            else:
                for size, keys in chains:
                    for rid, ranges in match_chain(
                        self._blocks, self._low, spec, size, keys, wanted, now, media
                    ).items():
                        per_rid.setdefault(rid, []).append(ranges)
                names = self._names
                found = {names[rid]: PrefixMatch(combine_ranges(parts)) for rid, parts in per_rid.items()}
        if masks:
            return ReplicaMatches(rid_names, rid_view, *medium_counts(masks, alives, media), bs, media)
        return ReplicaMatches.of(found, media)

    # -- helpers --------------------------------------------------------------------------

    def _sizes(self) -> tuple[int, ...]:
        sizes = [*self._size_blocks.items(), *self._spec.sizes.items()]
        return tuple(sorted({bs for bs, n in sizes if n > 0}))

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counts)
            out["blocks"] = len(self._blocks)
            out["replicas"] = len(self._rids)
            out["speculative_blocks"] = len(self._spec)
            out["named_media"] = len(self.media.named)
            return out

    def __len__(self) -> int:
        return len(self._blocks)


def _shift(rid: int) -> int:
    """``BITS * rid`` as one shared int object per rid (ints over 256 are not cached by
    Python: a fresh one per block would cost 28 bytes)."""
    return _SHIFTS[rid] if rid < len(_SHIFTS) else rid * _BITS


_SHIFTS = tuple(range(0, 4096 * _BITS, _BITS))
