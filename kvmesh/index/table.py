"""The block index's rows as columns: keys, LRU order and holders in numpy arrays, no objects.

A block used to be an ``OrderedDict`` entry: its 16-byte key object, a tuple of its mask and
holders, an engine-hash object per holder and a ``dict`` entry per holder in the engine-hash
map: 340-385 bytes a block measured (``docs/bench/scale.md``), more with vLLM's default
32-byte engine hashes. Here a block is a row of fixed-width columns and a holder a record:

* **rows**: ``rk`` the key as two int64 words; ``ri`` the LRU links, block size and first
  holder record (int32). Found through ``kslots``, an open-addressing table (linear
  probing, backward-shift deletion: no tombstones) whose slots hold a 32-bit fragment of
  the key's hash beside the row id, so a probe reads a row only when the fragment matches.
* **records**: one per ``(replica id, engine hash)`` holding of a row: ``he`` the engine
  hash as int64 (see :func:`engine_hash`), ``hr`` the replica id, the row, the row's next
  record. Found by ``(rid, block size, engine hash)`` through ``hslots``: the engine-hash
  map a ``BlockRemoved`` or a new block's parent is resolved in.

The holder *masks* (who holds a block in which medium) stay Python ints in the index's own
list, one per row, shared along a chain: a match turns them into ranges with big-int
arithmetic (:mod:`kvmesh.index.matching`). Which rows are new, touched or emptied comes back
from the kernels so the index keeps the masks in step.

The kernels are numba-compiled (:func:`kvmesh.core.jit.kernel`) and called once per event
batch (:meth:`BlockTable.run`: the batch's stores and removals as one program) or per
lookup, never per block: a call costs ~1 µs, what a 4-block store's own work does. They are
loaded at the first index's construction (:func:`warm`). Not thread-safe:
:class:`~kvmesh.index.BlockIndex` holds its lock.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import xxhash

from kvmesh.core.jit import kernel, readonly

KEY_BYTES = 16
_I64 = np.int64
_MASK64 = (1 << 64) - 1
_SIGN = 1 << 63
_LOAD = 0.7  # grow a slot table past this load factor
KEY_WORDS = struct.Struct("<qq")  # a 16-byte key as its two int64 words
# meta fields (one int64 array, so the kernels can update the counters)
_HEAD, _TAIL, _FREE, _ROWS, _HWM, _RFREE, _RECS, _RHWM = range(8)


def engine_hash(h: object) -> int:
    """An engine block hash as a signed 64-bit int: an int in ``[-2**63, 2**64)`` as its low
    64 bits, anything else (vLLM's default 32-byte hashes, wider ints) by its xxh3-64.

    A hash is only ever compared within one replica's map (by replica id and block size): two
    of its own engine hashes colliding in 64 bits would mislink one block's removal.
    """
    if type(h) is int and 0 <= h < _SIGN:  # the usual int hash: itself
        return h
    if isinstance(h, int) and -(1 << 63) <= h <= _MASK64:
        v = h & _MASK64
    elif isinstance(h, bytes):
        v = xxhash.xxh3_64_intdigest(h)
    else:
        v = xxhash.xxh3_64_intdigest(repr(h).encode())
    return v - (1 << 64) if v >> 63 else v


def _u64_bytes(hashes: Sequence[object]) -> bytes | None:
    """Unsigned 64-bit ints packed little-endian in one call; None if any is something else
    (negative, too wide, not an int: ``struct`` takes no bytes for ints, unlike numpy)."""
    n = len(hashes)
    pack = _PACKERS.get(n)
    if pack is None:
        pack = struct.Struct(f"<{n}Q").pack
        if n <= 64:  # the usual event sizes, kept; longer lists are rare
            _PACKERS[n] = pack
    try:
        return pack(*hashes)
    except struct.error:
        return None


_PACKERS: dict[int, Callable[..., bytes]] = {}


def engine_hashes(hashes: Sequence[object]) -> np.ndarray:
    """:func:`engine_hash` of each, as an int64 array (a few per event: packed, ~3x cheaper
    than numpy's conversion)."""
    data = _u64_bytes(hashes)
    if data is not None:
        return np.frombuffer(data, _I64)
    # read-only as frombuffer's: one kernel signature whichever way the hashes came
    return readonly(np.array([engine_hash(h) for h in hashes], dtype=_I64))


def key_words(keys: Sequence[bytes]) -> np.ndarray:
    """16-byte index keys as an ``(n, 2)`` int64 array. Only their total length is checked
    here: keys from outside the index's own hashing go through :func:`check_keys` first."""
    data = b"".join(keys)
    if len(data) != KEY_BYTES * len(keys):
        check_keys(keys)
    return np.frombuffer(data, "<i8").reshape(-1, 2)


def check_keys(keys: Iterable[bytes]) -> None:
    """Raise ValueError unless every key is ``KEY_BYTES`` bytes."""
    for k in keys:
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            raise ValueError(f"index keys are {KEY_BYTES} bytes, got {k!r}")


# -- kernels -------------------------------------------------------------------------------
# State, seven arrays (a kernel call costs ~60 ns per array argument): ``meta``; ``kslots``;
# ``rk[row] = (key hi, key lo)``; ``ri[row] = (prev, next, block size, first record)``;
# ``hslots``; ``he[rec] = engine hash``; ``hr[rec] = (rid, row, next record of the row)``.
# A free row has prev -2 and its next on the free list; a free record has row -1.
PREV, NXT, BS, HEAD = range(4)
RID, ROW, NEXT = range(3)


@kernel
def _mix(a: int, b: int) -> int:
    h = a ^ (b * -7046029254386353131)  # 0x9E3779B97F4A7C15
    h ^= (h >> 31) & 0x1FFFFFFFF
    h *= -4658895280553007687  # 0xBF58476D1CE4E5B9
    h ^= (h >> 29) & 0x7FFFFFFFF
    return h


# A slot holds ``(hash fragment << 32) | (index + 1)``, 0 when empty: the fragment (the low 32
# bits of the entry's hash, its home slot included) is compared before the row or record is
# read, and a deletion finds each entry's home without reading it: one random read per
# probe step fewer.


@kernel
def _kfind(kslots: np.ndarray, rk: np.ndarray, hi: int, lo: int) -> int:
    """The row of key ``(hi, lo)``, or -1."""
    mask = len(kslots) - 1
    frag = _mix(lo, hi) & 0xFFFFFFFF
    i = frag & mask
    while True:
        s = kslots[i]
        if s == 0:
            return -1
        if (s >> 32) & 0xFFFFFFFF == frag:
            r: int = (s & 0xFFFFFFFF) - 1
            if rk[r, 1] == lo and rk[r, 0] == hi:
                return r
        i = (i + 1) & mask


@kernel
def _put(slots: np.ndarray, frag: int, idx: int) -> None:
    mask = len(slots) - 1
    i = frag & mask
    while slots[i] != 0:
        i = (i + 1) & mask
    slots[i] = (frag << 32) | (idx + 1)


@kernel
def _del(slots: np.ndarray, frag: int, idx: int) -> None:
    """Take entry ``idx`` (hash fragment ``frag``) out of ``slots``, shifting its probe run
    back (no tombstone)."""
    mask = len(slots) - 1
    want = (frag << 32) | (idx + 1)
    i = frag & mask
    while slots[i] != want:
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        s = slots[j]
        if s == 0:
            break
        k = (s >> 32) & mask  # where the entry at j wants to be
        # it may move back to the hole at i unless its home lies cyclically in (i, j]
        if (i <= j and i < k <= j) or (i > j and (k > i or k <= j)):
            continue
        slots[i] = s
        i = j
    slots[i] = 0


@kernel
def _kfrag(rk: np.ndarray, row: int) -> int:
    return _mix(rk[row, 1], rk[row, 0]) & 0xFFFFFFFF


@kernel
def _hfrag(rid: int, bs: int, eh: int) -> int:
    return _mix(eh, rid * 1000003 + bs) & 0xFFFFFFFF


@kernel
def _hfind(
    hslots: np.ndarray, ri: np.ndarray, he: np.ndarray, hr: np.ndarray, rid: int, bs: int, eh: int
) -> int:
    """The record of ``(rid, bs, eh)``, or -1."""
    mask = len(hslots) - 1
    frag = _hfrag(rid, bs, eh)
    i = frag & mask
    while True:
        s = hslots[i]
        if s == 0:
            return -1
        if (s >> 32) & 0xFFFFFFFF == frag:
            q: int = (s & 0xFFFFFFFF) - 1
            if he[q] == eh and hr[q, 0] == rid and ri[hr[q, 1], 2] == bs:
                return q
        i = (i + 1) & mask


@kernel
def _lru_unlink(meta: np.ndarray, ri: np.ndarray, r: int) -> None:
    p, n = ri[r, 0], ri[r, 1]
    if p >= 0:
        ri[p, 1] = n
    else:
        meta[0] = n
    if n >= 0:
        ri[n, 0] = p
    else:
        meta[1] = p


@kernel
def _lru_append(meta: np.ndarray, ri: np.ndarray, r: int) -> None:
    t = meta[1]
    ri[r, 0] = t
    ri[r, 1] = -1
    if t >= 0:
        ri[t, 1] = r
    else:
        meta[0] = r
    meta[1] = r


@kernel
def _new_rec(
    meta: np.ndarray,
    ri: np.ndarray,
    hslots: np.ndarray,
    he: np.ndarray,
    hr: np.ndarray,
    rid: int,
    eh: int,
    row: int,
) -> None:
    q = meta[5]
    if q >= 0:
        meta[5] = hr[q, 2]
    else:
        q = meta[7]
        meta[7] = q + 1
    meta[6] += 1
    he[q] = eh
    hr[q, 0] = rid
    hr[q, 1] = row
    hr[q, 2] = ri[row, 3]
    ri[row, 3] = q
    _put(hslots, _hfrag(rid, ri[row, 2], eh), q)


@kernel
def _free_rec(meta: np.ndarray, hr: np.ndarray, q: int) -> None:
    hr[q, 1] = -1
    hr[q, 2] = meta[5]
    meta[5] = q
    meta[6] -= 1


@kernel
def _free_row(
    meta: np.ndarray, kslots: np.ndarray, rk: np.ndarray, ri: np.ndarray, hslots: np.ndarray,
    he: np.ndarray, hr: np.ndarray, row: int,
) -> None:  # fmt: skip
    """Drop ``row`` with its remaining records."""
    q = ri[row, 3]
    while q >= 0:
        n = hr[q, 2]
        _del(hslots, _hfrag(hr[q, 0], ri[row, 2], he[q]), q)
        _free_rec(meta, hr, q)
        q = n
    ri[row, 3] = -1
    _del(kslots, _kfrag(rk, row), row)
    _lru_unlink(meta, ri, row)
    ri[row, 2] = 0
    ri[row, 1] = meta[2]
    ri[row, 0] = -2  # free
    meta[2] = row
    meta[3] -= 1


@kernel
def _unhold(
    meta: np.ndarray, kslots: np.ndarray, rk: np.ndarray, ri: np.ndarray, hslots: np.ndarray,
    he: np.ndarray, hr: np.ndarray, rid: int, row: int,
) -> bool:  # fmt: skip
    """Unlink every record of ``rid`` on ``row``; free the row once none is left (True)."""
    q = ri[row, 3]
    last = -1
    while q >= 0:
        n = hr[q, 2]
        if hr[q, 0] == rid:
            _del(hslots, _hfrag(rid, ri[row, 2], he[q]), q)
            if last >= 0:
                hr[last, 2] = n
            else:
                ri[row, 3] = n
            _free_rec(meta, hr, q)
        else:
            last = q
        q = n
    if ri[row, 3] >= 0:
        return False
    _free_row(meta, kslots, rk, ri, hslots, he, hr, row)
    return True


@kernel
def _unhold_many(
    meta: np.ndarray, kslots: np.ndarray, rk: np.ndarray, ri: np.ndarray, hslots: np.ndarray,
    he: np.ndarray, hr: np.ndarray, rid: int, rows: np.ndarray, out: np.ndarray,
) -> None:  # fmt: skip
    """:func:`_unhold` for each of ``rows``: ``out[i] = (freed, block size)``."""
    for i in range(len(rows)):
        out[i, 1] = ri[rows[i], 2]
        out[i, 0] = _unhold(meta, kslots, rk, ri, hslots, he, hr, rid, rows[i])


@kernel
def _hold_one(
    meta: np.ndarray, kslots: np.ndarray, rk: np.ndarray, ri: np.ndarray, hslots: np.ndarray,
    he: np.ndarray, hr: np.ndarray, rid: int, bs: int, hi: int, lo: int, eh: int, out: np.ndarray, o: int,
) -> None:  # fmt: skip
    """``rid`` holds block ``(hi, lo)`` under engine hash ``eh``: ``out[o] = (row, new,
    moved, freed)``. new: 1 for a new row; moved: the row ``eh`` named before (another key:
    the engine reused the hash), from which every record of ``rid`` was unlinked first, else
    -1; freed: 1 if that left the moved row no holder (freed)."""
    moved = -1
    freed = 0
    q = _hfind(hslots, ri, he, hr, rid, bs, eh)
    if q >= 0:
        old = hr[q, 1]
        if rk[old, 0] != hi or rk[old, 1] != lo:
            moved = old
            if _unhold(meta, kslots, rk, ri, hslots, he, hr, rid, old):
                freed = 1
            q = -1
    row = _kfind(kslots, rk, hi, lo)
    new = 0
    if row < 0:
        row = meta[2]
        if row >= 0:
            meta[2] = ri[row, 1]
        else:
            row = meta[4]
            meta[4] = row + 1
        meta[3] += 1
        rk[row, 0] = hi
        rk[row, 1] = lo
        ri[row, 2] = bs
        ri[row, 3] = -1
        _put(kslots, _kfrag(rk, row), row)
        _lru_append(meta, ri, row)
        new = 1
    else:
        _lru_unlink(meta, ri, row)
        _lru_append(meta, ri, row)
    if q < 0:
        _new_rec(meta, ri, hslots, he, hr, rid, eh, row)
    out[o, 0] = row
    out[o, 1] = new
    out[o, 2] = moved
    out[o, 3] = freed


# A program (:meth:`BlockTable.run`): one replica's stores and removals in order, one call.
# A store: (STORE, n, block size, check, parent engine hash, parent key hi, parent key lo, -);
# a removal: (REMOVE, n, number of block sizes (up to 4), the sizes...). The last column
# comes back as the op's output count.
STORE, REMOVE = 0, 1
_NO_BOUND = 1 << 62  # max_rows that evicts nothing
REMOVE_SIZES = 4


@kernel
def _run(
    meta: np.ndarray, kslots: np.ndarray, rk: np.ndarray, ri: np.ndarray, hslots: np.ndarray,
    he: np.ndarray, hr: np.ndarray, rid: int, ops: np.ndarray, keys: np.ndarray, ehs: np.ndarray,
    max_rows: int, out: np.ndarray,
) -> int:  # fmt: skip
    """Run ``ops`` in order; returns how many ran (all, or up to the first failed check).

    ``keys``: the stores' block keys (two words each), in order; ``ehs``: the engine hashes
    of the stores' blocks and of the removals, in order.
    STORE: with ``check``, first: does rid's engine hash ``parent`` still name the key the
    blocks were chained from? If not, stop before it. Outputs: a :func:`_hold_one` row per
    block, then ``(row, block size, -2, 0)`` per row evicted to keep ``max_rows`` (at most n).
    REMOVE: outputs, per hash: ``(row or -1, freed, block size, 0)``, the row rid held under
    it (the first of the op's sizes that has it) with every record of rid there unlinked.
    ``ops[k, 7]`` is set to op k's output count.
    """
    kp = 0
    e = 0
    o = 0
    for k in range(len(ops)):
        n = ops[k, 1]
        o0 = o
        if ops[k, 0] == 0:
            bs = ops[k, 2]
            if ops[k, 3]:
                q = _hfind(hslots, ri, he, hr, rid, bs, ops[k, 4])
                if q < 0 or rk[hr[q, 1], 0] != ops[k, 5] or rk[hr[q, 1], 1] != ops[k, 6]:
                    return k
            for i in range(n):
                _hold_one(
                    meta, kslots, rk, ri, hslots, he, hr, rid, bs, keys[kp + 2 * i], keys[kp + 2 * i + 1],
                    ehs[e + i], out, o,
                )  # fmt: skip
                o += 1
            kp += 2 * n
            e += n
            evicted = 0
            while meta[3] > max_rows and evicted < n:
                row = meta[0]
                out[o, 0] = row
                out[o, 1] = ri[row, 2]
                out[o, 2] = -2
                out[o, 3] = 0
                _free_row(meta, kslots, rk, ri, hslots, he, hr, row)
                o += 1
                evicted += 1
        else:
            for i in range(n):
                out[o, 0] = -1
                out[o, 1] = 0
                out[o, 2] = 0
                out[o, 3] = 0
                for j in range(ops[k, 2]):
                    bs = ops[k, 3 + j]
                    q = _hfind(hslots, ri, he, hr, rid, bs, ehs[e + i])
                    if q >= 0:
                        row = hr[q, 1]
                        out[o, 0] = row
                        out[o, 2] = bs
                        out[o, 1] = _unhold(meta, kslots, rk, ri, hslots, he, hr, rid, row)
                        break
                o += 1
            e += n
        ops[k, 7] = o - o0
    return len(ops)


@kernel
def _parent_keys(
    hslots: np.ndarray, ri: np.ndarray, rk: np.ndarray, he: np.ndarray, hr: np.ndarray, rid: int,
    sizes: np.ndarray, ehs: np.ndarray, out: np.ndarray,
) -> None:  # fmt: skip
    """``out[i] = (1, key hi, key lo)`` of the block rid holds under ``(sizes[i], ehs[i])``,
    ``(0, 0, 0)`` where none."""
    for i in range(len(ehs)):
        q = _hfind(hslots, ri, he, hr, rid, sizes[i], ehs[i])
        if q < 0:
            out[i, 0] = 0
            out[i, 1] = 0
            out[i, 2] = 0
        else:
            out[i, 0] = 1
            out[i, 1] = rk[hr[q, 1], 0]
            out[i, 2] = rk[hr[q, 1], 1]


@kernel
def _find(kslots: np.ndarray, rk: np.ndarray, keys: np.ndarray, out: np.ndarray) -> None:
    for i in range(len(keys)):
        out[i] = _kfind(kslots, rk, keys[i, 0], keys[i, 1])


@kernel
def _find_recs(
    hslots: np.ndarray, ri: np.ndarray, he: np.ndarray, hr: np.ndarray, rid: int, sizes: np.ndarray,
    ehs: np.ndarray, out: np.ndarray,
) -> None:  # fmt: skip
    """``out[i]``: the row ``rid`` holds under engine hash ``ehs[i]`` (first of ``sizes``), or -1."""
    for i in range(len(ehs)):
        out[i] = -1
        for bs in sizes:
            q = _hfind(hslots, ri, he, hr, rid, bs, ehs[i])
            if q >= 0:
                out[i] = hr[q, 1]
                break


@kernel
def _touch(meta: np.ndarray, ri: np.ndarray, rows: np.ndarray) -> None:
    for r in rows:
        if r >= 0:
            _lru_unlink(meta, ri, r)
            _lru_append(meta, ri, r)


@kernel
def _evict(
    meta: np.ndarray, kslots: np.ndarray, rk: np.ndarray, ri: np.ndarray, hslots: np.ndarray,
    he: np.ndarray, hr: np.ndarray, out: np.ndarray,
) -> None:  # fmt: skip
    """Free the ``len(out)`` least recently used rows; ``out[i] = (row, block size)``."""
    for i in range(len(out)):
        row = meta[0]
        out[i, 0] = row
        out[i, 1] = ri[row, 2]
        _free_row(meta, kslots, rk, ri, hslots, he, hr, row)


@kernel
def _rows_of(hr: np.ndarray, hwm: int, rid: int, out: np.ndarray) -> int:
    n = 0
    for q in range(hwm):
        if hr[q, 1] >= 0 and hr[q, 0] == rid:
            out[n] = hr[q, 1]
            n += 1
    return n


@kernel
def _rehash_keys(kslots: np.ndarray, rk: np.ndarray, ri: np.ndarray, hwm: int) -> None:
    for r in range(hwm):
        if ri[r, 0] != -2:
            _put(kslots, _kfrag(rk, r), r)


@kernel
def _rehash_recs(hslots: np.ndarray, ri: np.ndarray, he: np.ndarray, hr: np.ndarray, hwm: int) -> None:
    for q in range(hwm):
        if hr[q, 1] >= 0:
            _put(hslots, _hfrag(hr[q, 0], ri[hr[q, 1], 2], he[q]), q)


# -- the table -----------------------------------------------------------------------------


_State = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _slots_for(n: int) -> int:
    size = 8
    while size * _LOAD < n:
        size *= 2
    return size


class BlockTable:
    """Rows (blocks) and records (who holds them under which engine hash); see the module
    docstring. Row ids are stable while a row lives and reused after it is freed."""

    def __init__(self, rows: int = 1024) -> None:
        self.meta = np.array([-1, -1, -1, 0, 0, -1, 0, 0], dtype=_I64)
        self.rk = np.empty((0, 2), _I64)
        self.ri = np.empty((0, 4), np.int32)
        self.he = np.empty(0, _I64)
        self.hr = np.empty((0, 3), np.int32)
        self.capacity = 0  # rows the arrays have room for (row ids are below it)
        self._room = 0  # rows and records that fit with no check (see reserve)
        self._grow_rows(rows)
        self._grow_recs(rows)
        self.kslots = np.zeros(_slots_for(rows), _I64)
        self.hslots = np.zeros(_slots_for(rows), _I64)

    def __len__(self) -> int:
        return int(self.meta[_ROWS])

    @property
    def records(self) -> int:
        return int(self.meta[_RECS])

    # -- capacity ------------------------------------------------------------------------

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more rows and records (one record per new holding).

        Counted down in Python and checked against the arrays only when it runs out: a
        check reads numpy scalars, several microseconds against the ~2 of a hold.
        """
        if rows <= self._room:
            self._room -= rows
            return
        meta = self.meta
        if meta[_HWM] + rows > len(self.rk):
            self._grow_rows(max(2 * len(self.rk), int(meta[_HWM]) + rows))
        if meta[_RHWM] + rows > len(self.he):
            self._grow_recs(max(2 * len(self.he), int(meta[_RHWM]) + rows))
        if meta[_ROWS] + rows > _LOAD * len(self.kslots):
            self.kslots = np.zeros(_slots_for(int(meta[_ROWS]) + rows), _I64)
            _rehash_keys(self.kslots, self.rk, self.ri, int(meta[_HWM]))
        if meta[_RECS] + rows > _LOAD * len(self.hslots):
            self.hslots = np.zeros(_slots_for(int(meta[_RECS]) + rows), _I64)
            _rehash_recs(self.hslots, self.ri, self.he, self.hr, int(meta[_RHWM]))
        room = min(
            len(self.rk) - int(meta[_HWM]),
            len(self.he) - int(meta[_RHWM]),
            int(_LOAD * len(self.kslots)) - int(meta[_ROWS]),
            int(_LOAD * len(self.hslots)) - int(meta[_RECS]),
        )
        self._room = room - rows

    def _grow_rows(self, n: int) -> None:
        # np.empty, not zeros: the pages past the copied part stay unmapped until a row uses them
        rk, ri = np.empty((n, 2), _I64), np.empty((n, 4), np.int32)
        rk[: len(self.rk)] = self.rk
        ri[: len(self.ri)] = self.ri
        self.rk, self.ri, self.capacity = rk, ri, n

    def _grow_recs(self, n: int) -> None:
        he, hr = np.empty(n, _I64), np.empty((n, 3), np.int32)
        he[: len(self.he)] = self.he
        hr[: len(self.hr)] = self.hr
        self.he, self.hr = he, hr

    # -- operations ----------------------------------------------------------------------

    def _state(self) -> _State:
        return self.meta, self.kslots, self.rk, self.ri, self.hslots, self.he, self.hr

    def hold(self, rid: int, bs: int, keys: list[bytes], ehs: list[object]) -> list[list[int]]:
        """``rid`` holds these blocks, no eviction: ``[row, new, moved, freed]`` each (see
        :func:`_hold_one`); one store of :meth:`run`."""
        _, out, _ = self.run(rid, [STORE, len(keys), bs, 0, 0, 0, 0, 0], keys, ehs, _NO_BOUND, len(keys))
        return out

    def run(
        self, rid: int, ops: list[int], keys: list[bytes], ehs: list[object], max_rows: int, outputs: int
    ) -> tuple[int, list[list[int]], list[int]]:
        """Run a program (see :func:`_run`; ``ops`` flat, 8 ints per op; ``keys`` the stores'
        16-byte keys; ``ehs`` the engine hashes): how many ops ran, their outputs in order,
        each op's output count. ``outputs``: the most output rows it can write."""
        self.reserve(len(keys))
        table = np.array(ops, _I64).reshape(-1, 8)
        out = np.empty((outputs, 4), _I64)
        done = _run(
            *self._state(), rid, table, key_words(keys).reshape(-1), engine_hashes(ehs), max_rows, out
        )
        counts: list[int] = table[:done, 7].tolist()
        result: list[list[int]] = out[: sum(counts)].tolist()
        return int(done), result, counts

    def parent_keys(self, rid: int, sizes: np.ndarray, ehs: np.ndarray) -> list[bytes | None]:
        """The key of the block rid holds under each ``(block size, engine hash)``, or None."""
        out = np.empty((len(ehs), 3), _I64)
        _parent_keys(self.hslots, self.ri, self.rk, self.he, self.hr, rid, sizes, ehs, out)
        return [KEY_WORDS.pack(hi, lo) if found else None for found, hi, lo in out.tolist()]

    def unhold(self, rid: int, rows: Sequence[int]) -> list[list[int]]:
        """Unlink ``rid``'s records on each row: ``[freed, block size]`` each, freed 1 where
        that left the row no holder (the row is freed)."""
        out = np.empty((len(rows), 2), _I64)
        _unhold_many(*self._state(), rid, np.array(rows, _I64), out)
        result: list[list[int]] = out.tolist()
        return result

    def find(self, keys: np.ndarray) -> list[int]:
        """The row of each key, -1 where none."""
        out = np.empty(len(keys), np.int32)
        _find(self.kslots, self.rk, keys, out)
        rows: list[int] = out.tolist()
        return rows

    def find_held(self, rid: int, sizes: Sequence[int], ehs: np.ndarray) -> list[int]:
        """The row ``rid`` holds under each engine hash (the first block size that has it)."""
        out = np.empty(len(ehs), np.int32)
        _find_recs(self.hslots, self.ri, self.he, self.hr, rid, np.array(sizes, _I64), ehs, out)
        rows: list[int] = out.tolist()
        return rows

    def touch(self, rows: Sequence[int]) -> None:
        """Make these rows the most recently used, in order (-1 entries skipped)."""
        if rows:
            _touch(self.meta, self.ri, np.array(rows, np.int32))

    def evict(self, count: int) -> list[list[int]]:
        """Free the ``count`` least recently used rows: ``[row, block size]`` each."""
        out = np.empty((min(count, len(self)), 2), _I64)
        _evict(*self._state(), out)
        result: list[list[int]] = out.tolist()
        return result

    def rows_of(self, rid: int) -> list[int]:
        """The rows ``rid`` has a record on, each once."""
        out = np.empty(self.records, np.int32)
        n = _rows_of(self.hr, int(self.meta[_RHWM]), rid, out)
        rows: list[int] = np.unique(out[:n]).tolist()
        return rows

    # -- inspection (tests, debugging) ---------------------------------------------------

    def lru(self) -> list[int]:
        """Live rows, least recently used first."""
        out: list[int] = []
        r = int(self.meta[_HEAD])
        while r >= 0:
            out.append(r)
            r = int(self.ri[r, NXT])
        return out

    def key(self, row: int) -> bytes:
        return KEY_WORDS.pack(int(self.rk[row, 0]), int(self.rk[row, 1]))

    def block_size(self, row: int) -> int:
        return int(self.ri[row, BS])

    def holders(self, row: int) -> list[tuple[int, int]]:
        """``(rid, engine hash)`` of each record on ``row``."""
        out: list[tuple[int, int]] = []
        q = int(self.ri[row, HEAD])
        while q >= 0:
            out.append((int(self.hr[q, RID]), int(self.he[q])))
            q = int(self.hr[q, NEXT])
        return out

    def held(self, rid: int, bs: int, eh: int) -> int:
        """The row of record ``(rid, bs, eh)``, or -1."""
        q = _hfind(self.hslots, self.ri, self.he, self.hr, rid, bs, eh)
        return -1 if q < 0 else int(self.hr[q, ROW])


_warm: list[bool] = []


def warm() -> None:
    """Load (or compile) every kernel now, once per process, through the calls the index
    makes: the first event batch would otherwise wait ~0.2 s for them, and every batch
    queued behind it (the ingest bench's lag p99 rose threefold)."""
    if _warm:
        return
    t = BlockTable(rows=2)
    keys = [bytes([i]) * KEY_BYTES for i in range(12)]
    t.hold(0, 16, keys[6:], list(range(6, 12)))  # grows the arrays, rehashes the slots
    t.hold(0, 16, keys[:2], [1, 2])
    ops = [STORE, 2, 16, 1, 2, *KEY_WORDS.unpack(keys[1]), 0, REMOVE, 1, 1, 16, 0, 0, 0, 0]
    t.run(0, ops, keys[2:4], [3, 4, 3], 9, 5)
    rows = t.find(key_words(keys))
    t.touch(rows)
    t.find_held(0, [16], engine_hashes([1, 9]))
    t.parent_keys(0, np.array([16], _I64), np.array([1], _I64))
    t.held(0, 16, 1)
    t.unhold(0, t.rows_of(0)[:1])
    t.evict(1)
    _warm.append(True)
