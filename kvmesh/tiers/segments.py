"""The ``segments`` layout of the disk tier: log-structured, per-lifetime-level segments.

One preallocated file ``<dir>/segments.kvs`` of ``n`` slots of ``ru_size`` bytes each (the
device's reclaim-unit size), slot ``i`` at offset ``i * ru_size``: on a raw device or a
file with stable extents, slot boundaries are reclaim-unit boundaries. Each lifetime level
(see :mod:`kvmesh.tiers.placement`) appends into its own open slot, so the device sees
sequential writes per stream. A slot is reclaimed whole: its live chunks are rewritten
(pinned ones always; with ``reclaim="hot"`` also those read since written) or dropped,
then the slot is punched (``fallocate(PUNCH_HOLE)``: a trim of the whole unit).

The on-disk format is in :mod:`kvmesh.tiers.segment_format`.

Crash safety (exact or miss): a batch of records is written, fdatasynced, and only then
indexed. At start the index is rebuilt by scanning each slot's records until the first
that does not parse or carries another slot seq (a leftover of a punched incarnation);
the last record of each slot has its payload verified (a torn tail), and every read
verifies header and payload checksums anyway. A key found twice keeps its newest copy.
Deletes are not persisted: a deleted chunk may come back after a restart — still exact,
it is the chunk its key names — until its slot is reclaimed.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from kvmesh.core import serde
from kvmesh.core.keys import ChunkKey
from kvmesh.core.policy import PinCounts
from kvmesh.core.serde import ChunkFormat
from kvmesh.errors import ConfigError, CorruptChunkError, TierUnavailableError
from kvmesh.tiers import dirlock
from kvmesh.tiers.base import ChunkData, Feature, Into, TierOptions, count_rejected, payload_buffer
from kvmesh.tiers.placement import Placement, check_class
from kvmesh.tiers.segment_format import (
    ALIGN,
    REC_PREFIX,
    pad,
    read_record,
    record_prefix,
    scan_slot,
    start_writeback,
)
from kvmesh.tiers.segment_space import Entry, SegmentSpace, Slot

FILE_NAME = "segments.kvs"


class SegmentTier(SegmentSpace):
    """The disk tier with ``disk_placement=segments`` (same contract as ``DiskTier``)."""

    # Pins; no RECODE: a segment record is rewritten only by reclaim (re-encoding in place
    # would need a second append path; the controller reports the tier as not re-encodable).
    features = Feature.PIN

    def __init__(
        self,
        path: str,
        options: TierOptions,
        placement: Placement,
        reclaim: str = "hot",
        lock: dirlock.DirLock | None = None,
    ) -> None:
        if reclaim not in ("hot", "drop"):
            raise ConfigError(f"segment reclaim={reclaim!r} is unknown; valid: hot, drop")
        if not options.capacity_bytes:
            raise ConfigError("disk_placement=segments needs a byte budget: set max_local_disk_size > 0 (GB)")
        self.name = options.name or "disk"
        self.metrics = options.metrics
        self.path = os.path.abspath(path)
        self.placement = placement
        self.ru = placement.ru_size
        self.reclaim_policy = reclaim
        self.codec = serde.get_codec(options.codec).name
        self.chunk_format = options.chunk_format
        self.chunk_size = options.chunk_size
        self.n_slots = options.capacity_bytes // self.ru
        if self.n_slots < len(placement.levels) + 2:
            raise ConfigError(
                f"max_local_disk_size holds {self.n_slots} segments of disk_ru_size={self.ru}; "
                f"segments needs >= {len(placement.levels) + 2}: raise the size or lower disk_ru_size"
            )
        self._lock = threading.Lock()  # index and slot table
        self._wlock = threading.Lock()  # one writer appends at a time: writes stay sequential
        self._entries: dict[str, Entry] = {}
        self._slots = [Slot() for _ in range(self.n_slots)]
        self._open: dict[int, int] = {}  # level -> open slot
        self._seq = 1
        self._gen = 0
        self._closed = False
        self._pins = PinCounts()
        self._trace: TextIO | None = None
        if options.io_trace:
            self._trace = open(options.io_trace, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        os.makedirs(self.path, exist_ok=True)
        self._dirlock = lock or dirlock.DirLock(self.path)  # one directory, one owner
        self.file = os.path.join(self.path, FILE_NAME)
        self._fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._rebuild()

    # -- Tier API ------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._check_open()
        with self._lock:
            return [k.text in self._entries for k in keys]

    def get(self, keys: Sequence[ChunkKey], into: Into | None = None) -> list[ChunkData | None]:
        self._check_open()
        with self.metrics.timed("get"):
            return [self._get_one(k, into) for k in keys]

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[ChunkData]) -> list[bool]:
        self._check_open()
        with self.metrics.timed("put"), self._wlock:
            return self._append([(k, c, check_class(c.lifetime)) for k, c in zip(keys, chunks, strict=True)])

    def delete(self, keys: Sequence[ChunkKey], force: bool = False) -> int:
        self._check_open()
        with self._lock:
            n = sum(self._remove(k.text, force) for k in keys)
        self.metrics.inc("deletes", n)
        return n

    def clear(self, force: bool = False) -> int:
        self._check_open()
        with self._lock:
            n = sum(self._remove(t, force) for t in list(self._entries))
        self.metrics.inc("deletes", n)
        return n

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        """Counted pins, whether or not a key is present (PinnableTier's contract)."""
        with self._lock:
            for k in keys:
                self._pins.pin(k.text)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            for k in keys:
                self._pins.unpin(k.text)

    def is_pinned(self, key: ChunkKey) -> bool:
        with self._lock:
            return key.text in self._pins

    def health(self) -> str:
        return "up"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._wlock, self._lock:
            os.close(self._fd)
            if self._trace is not None:
                self._trace.close()
                self._trace = None
        self._dirlock.release()

    def drop_page_cache(self, text: str) -> None:
        """Evict the chunk ``text`` from the OS page cache (its byte range of the segment
        file only: never the machine-wide drop_caches), so that the next read of it is
        cold. For benchmarks; best effort."""
        with self._lock:
            ent = self._entries.get(text)
            if ent is None or self._closed:
                return
            with contextlib.suppress(OSError):
                os.posix_fadvise(self._fd, ent.off, ent.size, os.POSIX_FADV_DONTNEED)

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._entries))

    def size_bytes(self) -> int:
        with self._lock:
            return sum(s.live for s in self._slots)

    def status(self) -> dict[str, Any]:
        with self._lock:
            states = [s.state for s in self._slots]
        return {
            **self.placement.status(self.path),
            "slots": self.n_slots,
            "free_slots": states.count("free"),
            "open_slots": states.count("open"),
        }

    # -- writes --------------------------------------------------------------------------
    def _append(self, items: list[tuple[ChunkKey, ChunkData, str]], replace: bool = False) -> list[bool]:
        """Append records (caller holds ``_wlock``), fdatasync once, then index them."""
        done: list[tuple[str, int, int, int]] = []  # key, slot, off, length
        results = []
        for key, chunk, cls in items:
            with self._lock:
                present = key.text in self._entries
            if present and not replace:
                results.append(True)
                continue
            head, body = self.chunk_format.encode(key, chunk.layout, chunk.tokens, chunk.data, self.codec)
            level = self.placement.stream(cls)
            length = REC_PREFIX + len(head) + memoryview(body).nbytes
            if pad(length) > self.ru - ALIGN:
                self.metrics.skip("too_large")  # a chunk larger than a segment never fits
                results.append(False)
                continue
            slot = self._room(level, pad(length))
            if slot is None:
                self.metrics.skip("capacity")
                results.append(False)
                continue
            s = self._slots[slot]
            off = slot * self.ru + s.used
            rec = record_prefix(level, s.seq, length) + head
            filler = bytes(pad(length) - length)
            t0 = time.time()
            try:
                os.pwritev(self._fd, [rec, memoryview(body).cast("B"), filler], off)
            except OSError:
                self.metrics.inc("errors")
                self.metrics.skip("io_error")
                results.append(False)
                continue
            start_writeback(self._fd, off, pad(length))
            s.used += pad(length)
            s.pending += 1
            self._traced("write", t0, [[off, pad(length)]], cls=cls, key=key.text)
            done.append((key.text, slot, off, length))
            results.append(True)
        if done:
            t0 = time.time()
            try:
                os.fdatasync(self._fd)
            except OSError:  # nothing of this batch is known durable: index none of it
                self.metrics.inc("errors")
                with self._lock:
                    for _, slot, _, _ in done:
                        self._slots[slot].pending -= 1
                return [False] * len(results)
            self._traced("fsync", t0, [])
        with self._lock:
            for text, slot, off, length in done:
                self._slots[slot].pending -= 1
                old = self._entries.get(text)
                if old is not None:
                    self._unindex(text, old)
                self._gen += 1
                self._entries[text] = Entry(slot, off, length, pad(length), self._gen)
                self._slots[slot].keys.add(text)
                self._slots[slot].live += pad(length)
                self.metrics.inc("stores")
                self.metrics.inc("bytes_in", pad(length))
            for slot in {d[1] for d in done}:
                s = self._slots[slot]
                if s.state == "closed" and s.live == 0 and not s.pending:
                    self._punch(slot)
            self._gauges()
        return results

    # -- reads ---------------------------------------------------------------------------
    def _get_one(self, key: ChunkKey, into: Into | None, count: bool = True) -> ChunkData | None:
        with self._lock:
            ent = self._entries.get(key.text)
            where = (ent.off, ent.length, ent.gen, self._slots[ent.slot].seq) if ent else None
        got = self._read(key, *where, into) if where else None
        if got is None:
            if count:
                self.metrics.inc("misses")
            return None
        header, raw, stored = got
        with self._lock:
            ent = self._entries.get(key.text)
            if ent is not None:
                ent.hit = ent.hit or count
        if count:
            self.metrics.inc("hits")
            self.metrics.inc("bytes_out", stored)
        return ChunkData(key, header.layout, header.tokens, raw, header.codec, stored)

    def _read(
        self,
        key: ChunkKey | str,
        off: int,
        length: int,
        gen: int,
        seq: int,
        into: Into | None,
        fmt: ChunkFormat | None = None,
    ) -> tuple[serde.ChunkHeader, serde.Buffer, int] | None:
        t0 = time.time()
        text = key.text if isinstance(key, ChunkKey) else key
        fmt = fmt or self.chunk_format
        try:
            header, body = read_record(
                self._fd, off, length, seq, key, lambda h: payload_buffer(into, h), fmt
            )
            raw = fmt.decode_payload(header, body, into)
        except CorruptChunkError as exc:
            if count_rejected(self.metrics, exc):
                with self._lock:
                    ent = self._entries.get(text)
                    if ent is not None and ent.gen == gen:
                        self._unindex(text, ent)
            return None
        except OSError:
            self.metrics.inc("errors")
            return None
        self._traced("read", t0, [[off, pad(length)]], key=text)
        return header, raw, length

    # -- index ---------------------------------------------------------------------------
    def _unindex(self, text: str, ent: Entry) -> None:
        del self._entries[text]
        s = self._slots[ent.slot]
        s.keys.discard(text)
        s.live -= ent.size
        if s.state == "closed" and s.live == 0 and not s.pending:
            self._punch(ent.slot)  # whole-unit invalidation: the device never copies it
        self._gauges()

    def _remove(self, text: str, force: bool) -> bool:
        ent = self._entries.get(text)
        if ent is None or (text in self._pins and not force):
            return False
        self._unindex(text, ent)
        return True

    def _rebuild(self) -> None:
        size = os.fstat(self._fd).st_size
        want = self.n_slots * self.ru
        if size != want:  # new file, or a new budget: resize (slots past the end are gone)
            os.ftruncate(self._fd, want)
        found: dict[str, tuple[int, int, int, int]] = {}  # key -> (seq, slot, off, length)
        # Records of another layout stay indexed (another model's, never asked for here).
        scan_format = self.chunk_format.with_layout(None)
        for i in range(min(size, want) // self.ru):
            got = scan_slot(self._fd, i, self.ru, scan_format)
            if got is None:
                continue
            seq, level, records, used = got
            s = self._slots[i]
            s.seq, s.level, s.state, s.used = seq, level, "closed", used
            self._seq = max(self._seq, seq + 1)
            for key, off, length in records:
                if key not in found or found[key][0] <= seq:
                    found[key] = (seq, i, off, length)
            if records:  # a crash tears at most the last record of a slot: verify it
                key, off, length = records[-1]
                mine = found.get(key, (0, -1))[1] == i
                if mine and self._read(key, off, length, -1, seq, None, scan_format) is None:
                    found.pop(key, None)
        for text, (_, slot, off, length) in found.items():
            self._gen += 1
            self._entries[text] = Entry(slot, off, length, pad(length), self._gen)
            self._slots[slot].keys.add(text)
            self._slots[slot].live += pad(length)
        for i, s in enumerate(self._slots):
            if s.state == "closed" and s.live == 0:
                self._punch(i)
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.set("bytes_used", sum(s.live for s in self._slots))
        self.metrics.set("objects", len(self._entries))

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailableError(f"disk tier {self.path} is closed; open a new one")

    def _traced(self, op: str, t0: float, extents: list[list[int]], cls: str = "", key: str = "") -> None:
        if self._trace is None:
            return
        rec: dict[str, Any] = {"op": op, "start": t0, "end": time.time(), "extents": extents}
        if cls:
            rec["class"] = cls
        if key:
            rec["key"] = key
        if extents:
            rec["bytes"] = sum(e[1] for e in extents)
        self._trace.write(json.dumps(rec) + "\n")
