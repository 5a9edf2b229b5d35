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
    alive = wanted
    masks: list[int] = []
    alives: list[int] = []
    for key in keys:
        entry = blocks.get(key)
        mask = entry[0] << entry[1] if entry is not None else 0
        if spec:
            held = spec.get(key)
            if held is not None:
                mask |= held.mask  # exact: the table was expired at ``now`` just before
        # Bit 4*rid is a REMOTE holding: shared, so it makes the block count for everyone.
        present = low if mask & low else (mask >> 1 | mask >> 2 | mask >> 3) & low
        alive &= present
        if not alive:
            break
        if entry is not None:
            blocks.move_to_end(key)
        masks.append(mask)
        alives.append(alive)
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
