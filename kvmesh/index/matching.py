"""The block index's lookup: walk a prompt's keys, then turn the holder masks into ranges.

Kept apart from :mod:`kvmesh.index.block_index` (which owns the state and the lock) so the
hot path is one function with its inputs spelled out. Work is per *holder* of the prompt's
first block, never per registered replica: with 1,000 replicas and a prefix held by two,
the range building visits two replicas, not 1,000 (see ``docs/readme-parts/scale.md``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvmesh.index.prefix import Medium
from kvmesh.index.speculative import Held

BITS = 4  # bits per replica in a block mask, one per Medium
NIBBLE = (1 << BITS) - 1
# A replica's 4 mask bits → its best medium; no bit of its own means REMOTE from another replica.
NIB_MEDIUM = tuple(Medium(max(nib.bit_length() - 1, 0)) for nib in range(1 << BITS))


def match_chain(
    blocks: OrderedDict[bytes, tuple[Any, ...]],
    low: int,
    spec: dict[bytes, Held],
    bs: int,
    keys: Sequence[bytes],
    wanted: int,
    now: float,
) -> dict[int, list[tuple[int, int, Medium]]]:
    """Per replica id: the ``(start, end, medium)`` token ranges of its longest prefix of ``keys``.

    ``blocks``: key → entry whose first two items are the holder mask, shifted down, and the
    shift (matched keys are moved to the LRU end). ``low``: bit ``BITS*rid`` of every
    registered replica. ``spec``: speculative entries (key → :class:`Held`, expired at
    ``now``), counting as GPU. ``wanted``: the ``low`` bits of the replicas asked about.
    """
    # ``spec`` is exact here: the table was expired at ``now`` just before.
    masks, alives = walk(blocks, low, spec, keys, wanted)
    out: dict[int, list[tuple[int, int, Medium]]] = {}
    if not masks:
        return out
    # Neighbouring blocks mostly have the same holders: work per run, not per block.
    runs: list[tuple[int, int, int]] = []
    for i, mask in enumerate(masks):
        if runs and runs[-1][2] == mask:
            runs[-1] = (runs[-1][0], i + 1, mask)
        else:
            runs.append((i, i + 1, mask))
    holders = alives[0]
    while holders:
        bit = holders & -holders  # lowest set bit: one holder of the first block
        holders ^= bit
        shift = bit.bit_length() - 1
        n = _leading(alives, bit)
        ranges: list[tuple[int, int, Medium]] = []
        for start, end, mask in runs:
            if start >= n:
                break
            med = NIB_MEDIUM[(mask >> shift) & NIBBLE]
            end = min(end, n) * bs
            if ranges and ranges[-1][2] == med:
                ranges[-1] = (ranges[-1][0], end, med)
            else:
                ranges.append((start * bs, end, med))
        out[shift // BITS] = ranges
    return out


def _leading(alives: list[int], bit: int) -> int:
    """How many leading entries of ``alives`` (a shrinking bit set) still have ``bit``."""
    lo, hi = 1, len(alives)
    while lo < hi:  # alives[lo-1] has the bit; find the first entry without it
        mid = (lo + hi + 1) // 2
        if alives[mid - 1] & bit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def walk(
    blocks: OrderedDict[bytes, tuple[Any, ...]],
    low: int,
    spec: dict[bytes, Held],
    keys: Sequence[bytes],
    wanted: int,
) -> tuple[list[int], list[int]]:
    """:func:`match_chain`'s walk alone: per matched block its holder mask and the ``low``
    bits of the replicas whose prefix still covers it (matched keys move to the LRU end)."""
    alive = wanted
    masks: list[int] = []
    alives: list[int] = []
    for key in keys:
        entry = blocks.get(key)
        mask = entry[0] << entry[1] if entry is not None else 0
        if spec:
            held = spec.get(key)
            if held is not None:
                mask |= held.mask
        # Bit 4*rid is a REMOTE holding: shared, so it makes the block count for everyone.
        present = low if mask & low else (mask >> 1 | mask >> 2 | mask >> 3) & low
        alive &= present
        if not alive:
            break
        if entry is not None:
            blocks.move_to_end(key)
        masks.append(mask)
        alives.append(alive)
    return masks, alives


def _lane_lut() -> np.ndarray:
    """Byte of an effective mask (see :func:`medium_counts`) → its two replicas' (even rid,
    odd rid) best media, each as one 16-bit lane per Medium value: lane ``v`` is 1 when that
    replica's medium is ``v``."""
    lut = np.zeros((256, 2), np.uint64)
    for byte in range(256):
        for half, nib in enumerate((byte & NIBBLE, byte >> BITS)):
            if nib:
                lut[byte, half] = np.uint64(1 << (16 * int(NIB_MEDIUM[nib])))
    return lut


_LANES = _lane_lut()
_MAX_ROWS = (1 << 16) - 1  # a 16-bit lane counts at most this many blocks


def medium_counts(masks: list[int], alives: list[int]) -> tuple[list[int], np.ndarray]:
    """:func:`walk`'s result as ``(effective masks, counts)``.

    An effective mask has, per replica, its own medium bits where its prefix still covers
    the block, bit REMOTE alone where only another replica's REMOTE copy does, and nothing
    where its prefix has ended: the nibble's top bit is the replica's medium on that block
    (as :data:`NIB_MEDIUM`), and a zero nibble ends its match. ``counts[rid, v]``: the
    blocks replica ``rid``'s prefix has in the medium of value ``v``, for every replica at
    once: one table lookup and one weighted sum over the masks' bytes, not a loop per
    holder (a system prompt is held by hundreds of a 1,000-replica fleet).
    """
    # alive has bit 4*rid per replica: *15 widens each to its nibble (no carries between them)
    effs = [(m & a * NIBBLE) | a for m, a in zip(masks, alives, strict=True)]
    # Neighbouring blocks mostly have the same holders: count each distinct row once, weighted.
    rows: list[int] = []
    weights: list[int] = []
    for e in effs:
        if rows and rows[-1] == e and weights[-1] < _MAX_ROWS:
            weights[-1] += 1
        else:
            rows.append(e)
            weights.append(1)
    nbytes = (max(e.bit_length() for e in rows) + 7) // 8
    counts: np.ndarray | None = None
    lo = 0
    while lo < len(rows):
        # one pass counts at most _MAX_ROWS blocks, so no 16-bit lane overflows into the next
        hi, total = lo, 0
        while hi < len(rows) and total + weights[hi] <= _MAX_ROWS:
            total += weights[hi]
            hi += 1
        raw = np.frombuffer(b"".join([e.to_bytes(nbytes, "little") for e in rows[lo:hi]]), np.uint8)
        # (rows, bytes, 2 replicas) → (rows, replicas in rid order): byte k holds rids 2k, 2k+1
        lanes = _LANES[raw].reshape(hi - lo, 2 * nbytes)
        summed = np.array(weights[lo:hi], np.uint64) @ lanes if hi > lo + 1 else lanes[0] * np.uint64(total)
        # little-endian: 16-bit lane v of each replica's uint64 is its medium-v count
        got = summed.view(np.uint16).reshape(2 * nbytes, 4).astype(np.int64)
        counts = got if counts is None else counts + got
        lo = hi
    assert counts is not None  # walk() returns at least one block
    return effs, counts


def replica_ranges(effs: list[int], rid: int, bs: int) -> tuple[tuple[int, int, Medium], ...]:
    """One replica's ``(start, end, medium)`` token ranges from :func:`medium_counts`' masks."""
    shift = BITS * rid
    ranges: list[tuple[int, int, Medium]] = []
    for i, eff in enumerate(effs):
        nib = eff >> shift & NIBBLE
        if not nib:
            break
        med = NIB_MEDIUM[nib]
        if ranges and ranges[-1][2] == med:
            ranges[-1] = (ranges[-1][0], (i + 1) * bs, med)
        else:
            ranges.append((i * bs, (i + 1) * bs, med))
    return tuple(ranges)
