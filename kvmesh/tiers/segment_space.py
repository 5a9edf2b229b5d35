"""Space in the ``segments`` layout: the slot table, opening slots, and whole-slot reclaim.

:class:`SegmentSpace` is the part of :class:`~kvmesh.tiers.segments.SegmentTier` that decides
where a record goes and which slot is reclaimed when none is free. A slot is reclaimed whole:
the closed slot with the least live data loses its unpinned cold chunks, keeps (rewrites)
its pinned and, with ``reclaim="hot"``, recently read ones, up to half a segment, and is
then punched (a trim of the whole reclaim unit).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from kvmesh.core.keys import ChunkKey
from kvmesh.core.policy import PinCounts
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import ChunkData, Into
from kvmesh.tiers.segment_format import ALIGN, punch, slot_header


@dataclass
class Entry:
    slot: int
    off: int  # file offset of the record
    length: int  # record bytes, unpadded
    size: int  # padded bytes on disk
    gen: int
    hit: bool = False


@dataclass
class Slot:
    seq: int = 0
    level: int = 0
    state: str = "free"  # free | open | closed
    used: int = ALIGN  # write pointer (the slot header takes the first 4 KiB)
    live: int = 0
    pending: int = 0  # records written, not yet indexed: the slot must not be reclaimed
    keys: set[str] = field(default_factory=set)


class SegmentSpace:
    """Slot allocation and reclaim over the state :class:`SegmentTier` owns (declared here)."""

    ru: int
    n_slots: int
    chunk_size: int
    reclaim_policy: str
    metrics: TierMetrics
    _fd: int
    _lock: threading.Lock
    _entries: dict[str, Entry]
    _slots: list[Slot]
    _open: dict[int, int]
    _seq: int
    _pins: PinCounts

    def _append(self, items: list[tuple[ChunkKey, ChunkData, str]], replace: bool = False) -> list[bool]:
        raise NotImplementedError

    def _get_one(self, key: ChunkKey, into: Into | None, count: bool = True) -> ChunkData | None:
        raise NotImplementedError

    def _unindex(self, text: str, ent: Entry) -> None:
        raise NotImplementedError

    def _traced(self, op: str, t0: float, extents: list[list[int]], cls: str = "", key: str = "") -> None:
        raise NotImplementedError

    def _room(self, level: int, size: int) -> int | None:
        """The open slot of ``level`` with ``size`` bytes free, opening (and reclaiming) as needed."""
        slot = self._open.get(level)
        if slot is not None and self._slots[slot].used + size <= self.ru:
            return slot
        with self._lock:
            if slot is not None:
                self._close_slot(slot)
            free = self._free_slot()
        for _ in range(2 * self.n_slots):
            if free is not None:
                break
            if not self._reclaim_one():
                return None
            with self._lock:
                free = self._free_slot()
        if free is None:
            return None
        s = self._slots[free]
        s.seq, s.level, s.state, s.used, s.live, s.keys = self._seq, level, "open", ALIGN, 0, set()
        self._seq += 1
        t0 = time.time()
        os.pwrite(self._fd, slot_header(s.seq, self.ru, level), free * self.ru)
        self._traced("write", t0, [[free * self.ru, ALIGN]], cls="meta")
        self._open[level] = free
        return free

    def _close_slot(self, slot: int) -> None:
        s = self._slots[slot]
        self._open.pop(s.level, None)
        s.state = "closed"
        if s.live == 0 and not s.pending:
            self._punch(slot)

    def _free_slot(self) -> int | None:
        return next((i for i, s in enumerate(self._slots) if s.state == "free"), None)

    def _reclaim_one(self) -> bool:
        """Reclaim the closed slot with the least live data (oldest first on ties): keep its
        pinned (and, for ``hot``, recently read) chunks by rewriting them, drop the rest."""
        with self._lock:
            closed = [
                (s.live, s.seq, i) for i, s in enumerate(self._slots) if s.state == "closed" and not s.pending
            ]
            if not closed:
                return False
            _, _, victim = min(closed)
            ents = [(text, self._entries[text]) for text in self._slots[victim].keys]
            # Pinned chunks first, then hot ones, up to half a segment: every reclaim then
            # frees at least half a segment, so a cache of nothing but hot chunks still
            # makes progress (the rest of its hot chunks get dropped, oldest segment first).
            ents.sort(key=lambda te: (te[0] not in self._pins, te[1].off))
            keep, budget = [], self.ru // 2
            for text, ent in ents:
                hot = self.reclaim_policy == "hot" and ent.hit
                pinned = text in self._pins
                if pinned or (hot and budget >= ent.size):
                    keep.append((text, pinned))
                    budget -= ent.size
        if keep and len(keep) == len(ents) and all(p for _, p in keep):
            return False  # a slot of pinned chunks only: nothing can be freed
        saved = []
        for text, pins in keep:
            try:
                key = ChunkKey.parse(text, self.chunk_size)
            except ValueError:
                continue
            got = self._get_one(key, None, count=False)
            if got is not None:
                saved.append((got, pins))
        with self._lock:
            for text in list(self._slots[victim].keys):
                self._unindex(text, self._entries[text])  # the last one punches the slot
                self.metrics.inc("evictions")
            if self._slots[victim].state != "free":
                self._punch(victim)
        for got, _ in saved:  # pins are counted by key: the rewritten copy keeps them
            self._append([(got.key, got, "rewrite")])
            self.metrics.inc("rewrites")
        return True

    def _punch(self, slot: int) -> None:
        """Free ``slot`` and trim it whole (caller holds ``_lock``)."""
        s = self._slots[slot]
        s.state, s.live, s.keys, s.used = "free", 0, set(), ALIGN
        t0 = time.time()
        if not punch(self._fd, slot * self.ru, self.ru):
            # No hole punching here: at least wipe the header so a restart sees a free slot.
            os.pwrite(self._fd, bytes(ALIGN), slot * self.ru)
        self._traced("trim", t0, [[slot * self.ru, self.ru]])
