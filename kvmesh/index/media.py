"""Media: where the index believes a block lives, whoever published it.

Four media have aliases (:class:`Medium`: ``GPU``, ``CPU``, ``DISK`` with vLLM's
``STORAGE``, ``REMOTE``). Any other medium a publisher of vLLM KV events names (a vLLM
tiering offload's secondary tier, another connector's backend) is kept under its own name
as an :class:`OtherMedium`, up to :data:`NAMED` of them per index: its blocks are indexed
and matched like any other, its tokens scored at a configured weight until a cost model
measures it. vLLM 0.32 qualifies a medium by ``locality`` (``LOCAL``/``REMOTE`` relative to
the publisher) and ``ownership`` (the secondary tier that published it); a qualified
medium is never taken for one of the four (a ``STORAGE`` tier on another host is not this
replica's disk), so it is named ``STORAGE:REMOTE``, ``STORAGE/fs``, ``CPU:REMOTE/obj``, ...

In a block's holder mask each replica has one byte (:data:`BITS`), one bit per medium:
REMOTE (shared, bit 0), the named media (bits 1-4, in the order the index met them), DISK,
CPU, GPU (bit 7). A replica's best medium on a block is its set bit of highest rank: GPU,
CPU, DISK, then the named media (local ones before those on another host), then REMOTE. A
named medium ranks below the replica's own disk because nothing is known about it.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

import numpy as np

BITS = 8  # mask bits per replica
BYTE = (1 << BITS) - 1
NAMED = 4  # named media one index keeps
NAMED_SLOTS = (1, 2, 3, 4)


class Medium(enum.IntEnum):
    """The media with aliases; the value is their column in per-medium token counts."""

    REMOTE = 0
    DISK = 1
    CPU = 2
    GPU = 3


@dataclass(frozen=True, slots=True)
class OtherMedium:
    """A medium the index keeps under the publisher's name; ``slot`` is its bit (1-4)."""

    name: str
    slot: int

    @property
    def column(self) -> int:
        """Its column in per-medium token counts (after the four of :class:`Medium`)."""
        return len(Medium) + self.slot - NAMED_SLOTS[0]

    def __str__(self) -> str:
        return self.name


AnyMedium = Medium | OtherMedium

SLOT = {Medium.REMOTE: 0, Medium.DISK: 5, Medium.CPU: 6, Medium.GPU: 7}
GPU_BIT = SLOT[Medium.GPU]
COLUMNS = len(Medium) + NAMED  # per-medium token counts: the four, then the named slots
# the column of each bit of a replica's byte, and back
COLUMN_OF_SLOT = (0, 4, 5, 6, 7, 1, 2, 3)
SLOT_OF_COLUMN = tuple(COLUMN_OF_SLOT.index(c) for c in range(COLUMNS))

# vLLM says "GPU"/"CPU" (None means GPU) and "STORAGE" for its local storage offload;
# kvmesh's own tier events use its tier names.
_ALIASES = {
    "GPU": Medium.GPU,
    "CPU": Medium.CPU,
    "DISK": Medium.DISK,
    "STORAGE": Medium.DISK,
    "REMOTE": Medium.REMOTE,
}


def medium_name(medium: str | None, locality: str | None = None, ownership: str | None = None) -> str:
    """The name the index keeps an event's medium under (``GPU`` when it names none)."""
    name = "GPU" if medium is None else medium.upper()
    if locality is not None and locality.upper() != "LOCAL":
        name += ":" + locality.upper()
    if ownership:
        name += "/" + ownership
    return name


def slot(medium: AnyMedium) -> int:
    """Its bit in a replica's byte."""
    return medium.slot if isinstance(medium, OtherMedium) else SLOT[medium]


_RANK = {Medium.REMOTE: 0, Medium.DISK: 50, Medium.CPU: 60, Medium.GPU: 70}


def rank(medium: AnyMedium) -> int:
    """Higher is a better (faster to load) place; see the module docstring."""
    if isinstance(medium, OtherMedium):
        return (10 if ":REMOTE" in medium.name else 20) + medium.slot
    return _RANK[medium]


@dataclass(frozen=True, slots=True)
class MediaView:
    """One index's media as the lookup uses them (replaced whole when a medium is named):
    ``by_slot`` the medium of each bit, ``best`` a replica's byte → the bit of its best
    medium, ``lanes`` a byte → its best medium's column as one 16-bit lane of 1 in two
    uint64 (see :func:`kvmesh.index.matching.medium_counts`)."""

    by_slot: tuple[AnyMedium, ...]
    best: tuple[int, ...]
    lanes: np.ndarray

    @classmethod
    def of(cls, by_slot: tuple[AnyMedium, ...]) -> MediaView:
        ranks = [rank(m) for m in by_slot]
        best = [0] * (1 << BITS)
        lanes = np.zeros((1 << BITS, 2), np.uint64)
        for byte in range(1, 1 << BITS):
            top = max((b for b in range(BITS) if byte >> b & 1), key=ranks.__getitem__)
            best[byte] = top
            col = column(by_slot[top])
            lanes[byte, col // 4] = np.uint64(1 << (16 * (col % 4)))
        lanes.flags.writeable = False
        return cls(by_slot, tuple(best), lanes)


def column(medium: AnyMedium) -> int:
    return medium.column if isinstance(medium, OtherMedium) else int(medium)


class Media:
    """The media one index knows: the aliased four, and the named ones as it meets them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._named: dict[str, OtherMedium] = {}
        # a named slot not used yet holds a stand-in (no block has its bit)
        by_slot: list[AnyMedium] = [OtherMedium("", b) for b in range(BITS)]
        for med, b in SLOT.items():
            by_slot[b] = med
        self.view = MediaView.of(tuple(by_slot))  # replaced, never changed
        self.refused = 0  # events of a medium past the named ones: not indexed

    def get(self, name: str | None, register: bool = True) -> AnyMedium | None:
        """The medium of that name (an alias or a named one; None: unknown and not registered,
        or one more than :data:`NAMED` named media)."""
        if name is None:
            return Medium.GPU
        alias = _ALIASES.get(name.upper())
        if alias is not None:
            return alias
        got = self._named.get(name)
        if got is not None or not register:
            return got
        with self._lock:
            got = self._named.get(name)
            if got is None:
                if len(self._named) >= NAMED:
                    self.refused += 1
                    return None
                got = self._named[name] = OtherMedium(name, NAMED_SLOTS[len(self._named)])
                by_slot = list(self.view.by_slot)
                by_slot[got.slot] = got
                self.view = MediaView.of(tuple(by_slot))
            return got

    @property
    def by_slot(self) -> tuple[AnyMedium, ...]:
        return self.view.by_slot

    @property
    def named(self) -> tuple[str, ...]:
        return tuple(self._named)
