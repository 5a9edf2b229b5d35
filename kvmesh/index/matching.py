"""The block index's lookup: walk a prompt's keys, then turn the holder masks into ranges.

Kept apart from :mod:`kvmesh.index.block_index` (which owns the state and the lock) so the
hot path is one function with its inputs spelled out. Work is per *holder* of the prompt's
first block, never per registered replica: with 1,000 replicas and a prefix held by two,
the range building visits two replicas, not 1,000 (see ``docs/bench/scale.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmesh.index.media import BITS, BYTE, COLUMNS, AnyMedium, MediaView
from kvmesh.index.table import BlockTable, key_words

Masks = list[tuple[int, int] | None]  # row → (mask >> shift, shift): BlockIndex._masks


def match_chain(
    table: BlockTable,
    masks: Masks,
    low: int,
    spec: dict[bytes, int],
    bs: int,
    keys: Sequence[bytes],
    wanted: int,
    now: float,
    media: MediaView,
) -> dict[int, list[tuple[int, int, AnyMedium]]]:
    """Per replica id: the ``(start, end, medium)`` token ranges of its longest prefix of ``keys``.

    ``table``, ``masks``: the index's rows and each row's holder mask, shifted down, with the
    shift (matched rows are moved to the LRU end). ``low``: bit ``BITS*rid`` of every
    registered replica. ``spec``: speculative entries (key → its holders' GPU bits, expired at
    ``now``), counting as GPU. ``wanted``: the ``low`` bits of the replicas asked about.
    ``media``: the index's media (a replica's byte → its best medium).
    """
    # ``spec`` is exact here: the table was expired at ``now`` just before.
    found, alives = walk(table, masks, low, spec, keys, wanted)
    out: dict[int, list[tuple[int, int, AnyMedium]]] = {}
    if not found:
        return out
    # Neighbouring blocks mostly have the same holders: work per run, not per block.
    runs: list[tuple[int, int, int]] = []
    for i, mask in enumerate(found):
        if runs and runs[-1][2] == mask:
            runs[-1] = (runs[-1][0], i + 1, mask)
        else:
            runs.append((i, i + 1, mask))
    holders = alives[0]
    by_slot, best = media.by_slot, media.best
    while holders:
        bit = holders & -holders  # lowest set bit: one holder of the first block
        holders ^= bit
        shift = bit.bit_length() - 1
        n = _leading(alives, bit)
        ranges: list[tuple[int, int, AnyMedium]] = []
        for start, end, mask in runs:
            if start >= n:
                break
            med = by_slot[best[(mask >> shift) & BYTE]]
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
    table: BlockTable,
    row_masks: Masks,
    low: int,
    spec: dict[bytes, int],
    keys: Sequence[bytes],
    wanted: int,
) -> tuple[list[int], list[int]]:
    """:func:`match_chain`'s walk alone: per matched block its holder mask and the ``low``
    bits of the replicas whose prefix still covers it (matched rows move to the LRU end)."""
    low7f, low80 = low * 0x7F, low << 7
    alive = wanted
    masks: list[int] = []
    alives: list[int] = []
    last, present = -1, 0
    rows = table.find(key_words(keys)) if keys else []
    for key, row in zip(keys, rows, strict=True):
        pair = row_masks[row] if row >= 0 else None
        mask = pair[0] << pair[1] if pair is not None else 0
        if spec:
            held = spec.get(key)
            if held is not None:
                mask |= held
        # Neighbouring blocks mostly have the same holders: the same mask, the same answer
        # (and the same int objects, which medium_counts compares by identity).
        if mask != last:
            last = mask
            # Bit 8*rid is a REMOTE holding: shared, so the block counts for everyone. Else a
            # replica is present with any bit of its byte (no REMOTE bit is set then): bit 7
            # of (b & 0x7f) + 0x7f | b, for every byte at once (no carry between them).
            present = low if mask & low else (((mask & low7f) + low7f | mask) & low80) >> 7
        else:
            mask = last
        now_alive = alive & present
        if now_alive != alive:
            alive = now_alive
        if not alive:
            break
        masks.append(mask)
        alives.append(alive)
    table.touch(rows[: len(masks)])
    return masks, alives


_MAX_ROWS = (1 << 16) - 1  # a 16-bit lane counts at most this many blocks


def medium_counts(masks: list[int], alives: list[int], media: MediaView) -> tuple[list[int], np.ndarray]:
    """:func:`walk`'s result as ``(effective masks, counts)``.

    An effective mask has, per replica, its own medium bits where its prefix still covers
    the block, bit REMOTE alone where only another replica's REMOTE copy does, and nothing
    where its prefix has ended: its best bit is the replica's medium on that block (as
    ``media.best`` ranks them), and a zero byte ends its match. ``counts[rid, c]``: the blocks
    replica ``rid``'s prefix has in the medium of column ``c`` (:class:`Medium` values,
    then the named media's slots: :data:`kvmesh.index.media.COLUMNS`), for every replica
    at once: one table lookup and one weighted sum over the masks' bytes, not a loop per
    holder (a system prompt is held by hundreds of a 1,000-replica fleet).
    """
    # Neighbouring blocks mostly have the same holders (walk() hands out the same int objects
    # for them): each distinct row is computed and counted once, weighted.
    effs: list[int] = []
    rows: list[int] = []
    weights: list[int] = []
    pm: int | None = None
    pa: int | None = None
    e = -1
    for m, a in zip(masks, alives, strict=True):
        if m is not pm or a is not pa:
            pm, pa = m, a
            # alive has bit 8*rid per replica: *255 widens each to its byte (no carries)
            new = (m & a * BYTE) | a
            if new != e:
                e = new
                rows.append(e)
                weights.append(1)
                effs.append(e)
                continue
        if weights[-1] < _MAX_ROWS:
            weights[-1] += 1
        else:
            rows.append(e)
            weights.append(1)
        effs.append(e)
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
        # (rows, bytes, 2 words) → (rows, words in rid order): byte k is rid k's
        lanes = media.lanes[raw].reshape(hi - lo, 2 * nbytes)
        summed = np.array(weights[lo:hi], np.uint64) @ lanes if hi > lo + 1 else lanes[0] * np.uint64(total)
        # little-endian: 16-bit lane c of each replica's two words is its column-c count
        got = summed.view(np.uint16).reshape(nbytes, COLUMNS).astype(np.int64)
        counts = got if counts is None else counts + got
        lo = hi
    assert counts is not None  # walk() returns at least one block
    return effs, counts


def replica_ranges(
    effs: list[int], rid: int, bs: int, media: MediaView
) -> tuple[tuple[int, int, AnyMedium], ...]:
    """One replica's ``(start, end, medium)`` token ranges from :func:`medium_counts`' masks."""
    shift = BITS * rid
    ranges: list[tuple[int, int, AnyMedium]] = []
    by_slot, best = media.by_slot, media.best
    for i, eff in enumerate(effs):
        byte = eff >> shift & BYTE
        if not byte:
            break
        med = by_slot[best[byte]]
        if ranges and ranges[-1][2] == med:
            ranges[-1] = (ranges[-1][0], (i + 1) * bs, med)
        else:
            ranges.append((i * bs, (i + 1) * bs, med))
    return tuple(ranges)
