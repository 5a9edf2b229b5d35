"""The router's block index: which replica holds which prefix, in which medium.

Keys are kvmesh's own chained xxh3-128 hashes over each block's token ids, rooted in the
block size and LoRA name, never the engine's block hashes: those depend on the engine's
hash algorithm and ``PYTHONHASHSEED``, so two replicas (or the router) could not agree on
them. Engine hashes are kept per replica only as opaque ids, to find the parent of a new
``BlockStored`` and to resolve ``BlockRemoved``.

Layout, chosen for memory (10M blocks in ~1 GB) and lookup speed:

* ``_table`` (:class:`~kvmesh.index.table.BlockTable`): a row per block in numpy columns,
  its key, LRU links and block size, and a record per ``(replica, engine hash)`` holding,
  found by ``(rid, block size, engine hash)``: the engine-hash map that resolves a
  ``BlockRemoved`` or a new ``BlockStored``'s parent. No Python object per block or holder.
* ``_masks[row]``: the block's ``(mask >> shift, shift)``. ``mask`` has a byte per replica
  id, bit ``8*rid + slot`` (the medium's bit, ordered by rank: :mod:`kvmesh.index.media`);
  one Python int answers "who holds this block, where" with a few shifts. It is stored
  shifted down to its lowest holder, so its size follows the spread of the holders' ids, not
  the highest id, and consecutive blocks with the same holders share one pair object.

Engine hashes are kept as 64-bit ints (vLLM's default 32-byte hashes by their xxh3-64, see
:func:`~kvmesh.index.table.engine_hash`) and per block size, because vLLM's offloading may
reuse a GPU block's hash for a larger CPU block with other tokens.

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
from kvmesh.index.table import (
    KEY_WORDS,
    REMOVE,
    REMOVE_SIZES,
    STORE,
    BlockTable,
    check_keys,
    engine_hash,
    engine_hashes,
)
from kvmesh.index.table import warm as warm_table

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
    "unregistered",  # batches from a replica not registered, applied with register=False: dropped
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
        warm_table()
        self._table = BlockTable()
        # row → (mask >> shift, shift); None for a free row. Pairs of ints drop out of the
        # cyclic GC, so a full collection does not walk them in the middle of a lookup.
        self._masks: list[tuple[int, int] | None] = []
        self._rid_sizes: dict[int, list[int]] = {}  # rid → the block sizes it has stored, in order
        self._rid_media: dict[int, int] = {}  # rid → the media bits it has stored blocks in
        # (rid, engine hash, block size) → key of the last block of recent stores: a store
        # chained to one (a request's next block) needs no table lookup for its parent's key
        # (the table checks it when the store runs). Bounded: emptied when full (a plain
        # dict's insert is half an OrderedDict's, and a miss costs only a batched lookup).
        self._recent: dict[tuple[int, int, int], bytes] = {}
        self._size_blocks: dict[int, int] = {}  # block size → live blocks
        self._spec = SpeculativeTable()
        self.media = Media()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._last_pair = (0, 0)  # see _share()

    def _share(self, m: int, shift: int) -> tuple[int, int]:
        """``(m, shift)`` (a packed mask), or the equal pair the last row written holds.

        A chain's blocks are stored (and dropped) together, so consecutive blocks get the same
        holders: the same mask. A mask of two far-apart replicas is a big int (replicas 1 and
        334: ~360 bytes), which every block of the prompt would keep a copy of.
        """
        last = self._last_pair
        if shift == last[1] and m == last[0]:
            return last
        self._last_pair = pair = (m, shift)
        return pair

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
            del self._names[rid], self._rid_sizes[rid], self._rid_media[rid]
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
            self._rid_sizes[rid] = []
            self._rid_media[rid] = 0
            self._low |= 1 << (_BITS * rid)
        return rid

    # -- events ---------------------------------------------------------------------------

    def apply(self, replica: str, batch: EventBatch, *, register: bool = True) -> None:
        """Apply one event batch from ``replica``, in order.

        The batch's stores and removals go to the table as one program, in one call (see
        :class:`_Program`): a kernel call costs about what a 4-block store's own work does.

        ``register``: a store from a replica the index does not know registers it. With
        ``False`` the batch is dropped instead (counted ``unregistered``), checked under the
        index's lock: a subscriber's batch already on its way when its replica was removed
        (:meth:`remove_replica`) cannot register the replica again, with entries nothing
        would ever remove.
        """
        tokens = batch_tokens(batch.events)
        self._apply(replica, [self._prepare(ev, tokens.get(id(ev))) for ev in batch.events], register)

    def store(self, replica: str, ev: BlockStored, tokens: np.ndarray | None = None) -> None:
        """Record one ``BlockStored``; ``tokens``: its token ids already validated (see
        :func:`kvmesh.index.events.batch_tokens`), else they are validated here."""
        self._apply(replica, [self._prepare(ev, tokens)])

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
        ev = BlockRemoved(tuple(block_hashes), medium, group_idx, locality=locality, ownership=ownership)
        self._apply(replica, [(ev, None, None)])

    def _prepare(self, ev: Any, tokens: np.ndarray | None) -> _Item:
        """What can be done outside the lock: a store's medium and validated tokens."""
        if not isinstance(ev, BlockStored):
            return ev, None, None
        medium = self.media.get(medium_name(ev.medium, ev.locality, ev.ownership))
        return ev, medium, event_keys(ev, tokens) if medium is not None else None

    def _apply(self, replica: str, items: list[_Item], register: bool = True) -> None:
        with self._lock:
            rid = self._rids.get(replica)
            if rid is None and not register:
                self._counts["unregistered"] += 1
                return
            prog = _Program()
            for i, item in enumerate(items):
                ev = item[0]
                if isinstance(ev, BlockStored):
                    if rid is None:
                        rid = self._rid(replica)
                    self._add_store(rid, prog, items, i)
                elif rid is None:
                    continue  # a replica is known by its stores
                elif isinstance(ev, BlockRemoved):
                    self._add_remove(rid, prog, ev)
                elif isinstance(ev, AllBlocksCleared):
                    self._run(rid, prog)
                    self._counts["clears"] += 1
                    self._clear(rid)
            if rid is not None:
                self._run(rid, prog)

    def _add_store(self, rid: int, prog: _Program, items: list[_Item], i: int) -> None:
        """Add ``items[i]``, a store, to ``prog`` (``items[i + 1:]``: the rest of its batch)."""
        ev, medium, prepared = items[i]
        assert isinstance(ev, BlockStored)
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
        bs, parent = ev.block_size, ev.parent_block_hash
        check: tuple[int, bytes] | None = None
        if parent is None:
            prev = chain_root(bs, ev.lora_name)
        else:
            # The parent's key, as the table should have it when this store runs (it checks):
            # the last block of a recent store (of this batch or an earlier one), or looked up
            # in the table with the rest of the batch's parents.
            eh = engine_hash(parent)
            known = self._recent.get((rid, eh, bs))
            if known is None:
                if (eh, bs) not in prog.looked:
                    prog.looked.update(self._parents(rid, items[i:]))
                known = prog.looked.get((eh, bs))
            if known is None:
                if prog.items:  # a store pending in the batch may make it: ask the table after it
                    self._run(rid, prog)
                    self._add_store(rid, prog, items, i)
                else:
                    self._counts["orphans"] += 1
                return
            check = (eh, known)
            prev = known
        hashes = chain(prepared[0], bs, prev, prepared[1])
        self._stored(rid, prog, bs, slot(medium), hashes, ev.block_hashes, check, items[i])
        if hashes:
            recent = self._recent
            if len(recent) >= _RECENT:
                recent.clear()
            recent[(rid, engine_hash(ev.block_hashes[-1]), bs)] = hashes[-1]

    def _stored(
        self,
        rid: int,
        prog: _Program,
        bs: int,
        bit: int,
        keys: list[bytes],
        ehs: tuple[BlockHash, ...],
        check: tuple[int, bytes] | None,
        item: _Item,
    ) -> None:
        """Add a store to ``prog``; what rid has stored in (media, block sizes) grows with it."""
        prog.store(bs, bit, keys, ehs, check, item)
        self._rid_media[rid] |= 1 << bit
        if bs not in self._rid_sizes[rid]:
            self._rid_sizes[rid].append(bs)

    def _parents(self, rid: int, items: list[_Item]) -> dict[tuple[int, int], bytes | None]:
        """``(engine hash, block size) → key`` (None: not held) of the stores' parents, in
        one table call."""
        wanted = {
            (engine_hash(ev.parent_block_hash), ev.block_size)
            for ev, _, _ in items
            if isinstance(ev, BlockStored) and ev.parent_block_hash is not None
        }
        pairs = list(wanted)
        keys = self._table.parent_keys(
            rid, np.array([bs for _, bs in pairs], np.int64), np.array([eh for eh, _ in pairs], np.int64)
        )
        return dict(zip(pairs, keys, strict=True))

    def _add_remove(self, rid: int, prog: _Program, ev: BlockRemoved) -> None:
        med = self.media.get(medium_name(ev.medium, ev.locality, ev.ownership), register=False)
        if (ev.group_idx or 0) != self._prefix_group.get(rid, 0):
            return
        if med is None:
            self._counts["unknown_medium"] += 1
            return
        bit = 1 << slot(med)
        held_media = self._rid_media[rid]
        if not held_media & bit:
            return  # never stored in this medium
        sizes = self._rid_sizes[rid]
        if held_media == bit and len(sizes) <= REMOVE_SIZES:
            # Only ever stored in this medium: each block it names goes entirely, found and
            # unlinked in the program.
            prog.remove(sizes, ev)
            return
        self._run(rid, prog)
        ehs = engine_hashes(ev.block_hashes)
        # per block size (vLLM's offloading may reuse a GPU block's hash for a CPU block)
        found = [self._table.find_held(rid, (bs,), ehs) for bs in self._rid_sizes[rid]]
        gone: list[int] = []  # rows rid no longer holds in any medium
        for i in range(len(ehs)):
            for rows in found:
                row = rows[i]
                dropped = self._drop_bits(rid, row, bit) if row >= 0 else 0
                if dropped:
                    self._counts["removed_blocks"] += 1
                    if dropped == 2:
                        gone.append(row)
                    break
        self._unlink(rid, gone)

    def _run(self, rid: int, prog: _Program) -> None:
        """Run ``prog`` in the table and bring the masks and counters in step; empty it."""
        while prog.items:
            table, masks, counts, ops = self._table, self._masks, self._counts, prog.ops
            done, out, outputs = table.run(rid, ops, prog.keys, prog.ehs, self.max_blocks, prog.outputs)
            if len(masks) < table.capacity:  # a row id per slot of the table's arrays
                masks.extend([None] * (table.capacity - len(masks)))
            o = 0
            sizes, rid_shift = self._size_blocks, _shift(rid)
            for k in range(done):
                kind, n, bs, count = ops[8 * k], ops[8 * k + 1], ops[8 * k + 2], outputs[k]
                if kind == STORE:
                    # new rows (the usual case) inline; the first other one and the rest by
                    # _replay_store
                    alone, new, j = (1 << prog.bits[k], rid_shift), 0, o
                    while j < o + n:
                        row, is_new, moved, _ = out[j]
                        if not is_new or moved >= 0:
                            break
                        masks[row] = alone
                        new += 1
                        j += 1
                    if new:
                        sizes[bs] = sizes.get(bs, 0) + new
                    if j < o + n:
                        self._replay_store(rid, prog.bits[k], bs, out[j : o + n])
                    counts["stored_blocks"] += n
                    if count > n:
                        for row, size, *_ in out[o + n : o + count]:
                            masks[row] = None
                            self._size_blocks[size] -= 1
                        counts["evictions"] += count - n
                else:
                    at = _BITS * rid
                    for row, freed, size, _ in out[o : o + count]:
                        if row < 0:
                            continue
                        counts["removed_blocks"] += 1
                        m, shift = masks[row]  # type: ignore[misc]  # a live row has its mask
                        if freed and m == (m & BYTE << (at - shift)):  # rid was its only holder
                            masks[row] = None
                            self._size_blocks[size] -= 1
                        else:
                            self._unheld(row, size, freed, self._clear_byte(rid, row))
                o += count
            rest = prog.items[done + 1 :] if done < len(prog.items) else []
            failed = prog.items[done] if done < len(prog.items) else None
            prog.clear()
            if failed is not None:
                # The parent's engine hash moved on before this store ran: look it up again
                # as the table stands, then the rest as before.
                self._recent.clear()
                redo = [failed, *rest]
                for i, item in enumerate(redo):
                    if isinstance(item[0], BlockStored):
                        self._add_store(rid, prog, redo, i)
                    else:
                        self._add_remove(rid, prog, item[0])
        if len(self._table) > self.max_blocks:
            self._evict(len(self._table) - self.max_blocks)

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
        pairs = list(blocks)
        keys = [key for _, key in pairs]
        check_keys(keys)
        with self._lock:
            rid = self._rid(replica)
            prog = _Program()
            self._stored(
                rid, prog, block_size, slot(med), keys, tuple(eh for eh, _ in pairs), None, (None, med, None)
            )
            self._run(rid, prog)

    def _replay_store(self, rid: int, bit: int, bs: int, held: list[list[int]]) -> None:
        """The masks of blocks the table says ``rid`` now holds in medium slot ``bit``, in
        order: ``[row, new, moved, freed]`` each (:func:`kvmesh.index.table._hold_one`)."""
        alone = (1 << bit, _shift(rid))  # a new row's packed mask
        masks, sizes = self._masks, self._size_blocks
        new = 0
        for row, is_new, moved, freed in held:
            if moved >= 0:
                # The engine reused this hash for other tokens: the old block is gone from it
                # (the table unlinked rid's records there; freed: nobody holds it now).
                if new:  # counted first: the old block may be one this call added
                    sizes[bs] = sizes.get(bs, 0) + new
                    new = 0
                self._unheld(moved, bs, freed, self._clear_byte(rid, moved))
            if is_new:
                masks[row] = alone
                new += 1
                continue
            # Worked on packed (see _drop_bits): the mask is never unpacked, a big int
            # allocation or more per block held by far-apart replicas.
            m, shift = masks[row]  # type: ignore[misc]  # a live row has its mask
            at = _BITS * rid - shift  # rid's byte in the packed mask
            if at >= 0:
                m |= 1 << (at + bit)
            else:  # rid is below every holder: it becomes the lowest
                m = m << -at | 1 << bit
                shift = _shift(rid)
            masks[row] = self._share(m, shift)
        if new:
            sizes[bs] = sizes.get(bs, 0) + new

    def _drop_bits(self, rid: int, row: int, bits: int) -> int:
        """Clear ``bits`` (of rid's byte: media slots) of ``rid`` on ``row``'s mask: 0 if it
        had none of them, 1 if it still holds the block in another medium, 2 if it holds it no
        more (its records are still to unlink: :meth:`_unlink`).

        A row's mask is kept packed: ``(m, shift)`` is the mask ``m << shift``, shifted down to
        its lowest holder's byte (a block held by replica 999 alone is an 8-bit int and a
        shift, not an 8,000-bit int).
        """
        pair = self._masks[row]
        if pair is None:
            return 0
        m, shift = pair
        at = _BITS * rid - shift  # rid's byte in the packed mask (below 0: not a holder)
        if at < 0 or not (m >> at) & bits:
            return 0
        if (m >> at) & BYTE & ~bits:  # rid still holds it in another medium
            self._masks[row] = self._share(m & ~(bits << at), shift)
            return 1
        self._clear_byte(rid, row)
        return 2

    def _clear_byte(self, rid: int, row: int) -> bool:
        """Clear rid's byte of ``row``'s mask; True if no holder is left (the mask goes)."""
        m, shift = self._masks[row]  # type: ignore[misc]  # a live row has its mask
        m &= ~(BYTE << (_BITS * rid - shift))
        if not m:
            self._masks[row] = None
            return True
        if not m & BYTE:  # rid was the lowest holder: down to the next one
            low = ((m & -m).bit_length() - 1) // _BITS
            m >>= _BITS * low
            shift = _shift(shift // _BITS + low)
        self._masks[row] = self._share(m, shift)
        return False

    def _unlink(self, rid: int, rows: list[int]) -> None:
        """Unlink rid's records on ``rows`` (whose masks lost rid's byte) in one table call."""
        if rows:
            for row, (freed, bs) in zip(rows, self._table.unhold(rid, rows), strict=True):
                self._unheld(row, bs, freed, self._masks[row] is None)

    def _unheld(self, row: int, bs: int, freed: int, emptied: bool) -> None:
        """The table ``freed`` (or kept) ``row``, whose mask ``emptied`` (or not)."""
        if bool(freed) != emptied:
            raise AssertionError(f"block index: row {row}'s mask and holder records disagree")
        if freed:
            self._size_blocks[bs] -= 1

    def _evict(self, count: int) -> None:
        """Evict the ``count`` least recently stored or matched blocks (one call, not one per
        block: a full index evicts a block for every block it stores)."""
        masks, sizes = self._masks, self._size_blocks
        freed = self._table.evict(count)
        for row, bs in freed:
            masks[row] = None
            sizes[bs] -= 1
        self._counts["evictions"] += len(freed)

    def _clear(self, rid: int) -> None:
        rows = self._table.rows_of(rid)
        for row in rows:
            self._clear_byte(rid, row)
        self._unlink(rid, rows)
        self._rid_media[rid] = 0
        self._spec.drop(rid)

    def _entries(self) -> list[tuple[bytes, tuple[Any, ...]]]:
        """Every block, least recently used first: ``(key, (m, shift, block size, rid,
        engine hash, rid, engine hash, ...))`` (for tests and debugging: one Python tuple per
        block)."""
        t, out = self._table, []
        for row in t.lru():
            m, shift = self._masks[row]  # type: ignore[misc]  # a live row has its mask
            flat = [x for holder in t.holders(row) for x in holder]
            out.append((t.key(row), (m, shift, t.block_size(row), *flat)))
        return out

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
                masks, alives = walk(self._table, self._masks, self._low, spec, keys, wanted)
            else:
                for size, keys in chains:
                    for rid, ranges in match_chain(
                        self._table, self._masks, self._low, spec, size, keys, wanted, now, media
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
            out["blocks"] = len(self._table)
            out["replicas"] = len(self._rids)
            out["speculative_blocks"] = len(self._spec)
            out["named_media"] = len(self.media.named)
            return out

    def __len__(self) -> int:
        return len(self._table)


_Item = tuple[Any, AnyMedium | None, Any]  # (event, a store's medium, its event_keys())


class _Program:
    """One replica's stores and fast removals, for :meth:`BlockTable.run` in one call.

    Gathered as plain lists (ops flat, 8 ints each; the stores' keys; every engine hash) and
    converted once per batch: per event, numpy's conversions cost more than the table's work.
    """

    __slots__ = ("bits", "ehs", "items", "keys", "looked", "ops", "outputs")

    def __init__(self) -> None:
        self.ops: list[int] = []
        self.keys: list[bytes] = []
        self.ehs: list[Any] = []
        self.bits: list[int] = []  # per op: a store's medium slot
        self.items: list[_Item] = []  # per op: the event it came from (to redo from a failed check)
        # parents looked up in the table since the program was last run: key, None if not held
        self.looked: dict[tuple[int, int], bytes | None] = {}
        self.outputs = 0  # output rows the table may write

    def store(
        self,
        bs: int,
        bit: int,
        keys: list[bytes],
        ehs: tuple[BlockHash, ...],
        check: tuple[int, bytes] | None,
        item: _Item,
    ) -> None:
        n = len(keys)
        if check is None:
            self.ops += (STORE, n, bs, 0, 0, 0, 0, 0)
        else:
            self.ops += (STORE, n, bs, 1, check[0], *KEY_WORDS.unpack(check[1]), 0)
        self.keys += keys
        self.ehs += ehs
        self.bits.append(bit)
        self.items.append(item)
        self.outputs += 2 * n  # a row per block, at most as many evictions

    def remove(self, sizes: list[int], ev: BlockRemoved) -> None:
        n = len(ev.block_hashes)
        self.ops += (REMOVE, n, len(sizes), *sizes, *_ZEROS[len(sizes) :])
        self.ehs += ev.block_hashes
        self.bits.append(0)
        self.items.append((ev, None, None))
        self.outputs += n

    def clear(self) -> None:
        self.__init__()  # type: ignore[misc]


_RECENT = 1 << 16  # parents remembered (BlockIndex._recent)
_ZEROS = (0,) * (REMOVE_SIZES + 1)  # a removal's unused size columns and its output count


def _shift(rid: int) -> int:
    """``BITS * rid`` as one shared int object per rid (ints over 256 are not cached by
    Python: a fresh one per block would cost 28 bytes)."""
    return _SHIFTS[rid] if rid < len(_SHIFTS) else rid * _BITS


_SHIFTS = tuple(range(0, 4096 * _BITS, _BITS))
