"""Block-level I/O traces: FIEMAP extents of files, and loading a disk-tier trace for the FTL.

The disk tier's JSON-lines trace (``disk_io_trace``) carries, per record, ``op`` (write,
read, trim, fsync), ``class`` (the lifetime class of a write), and the device addresses it
touched as ``extents``: ``[[offset, length], ...]`` in bytes. With ``segments`` placement
those are offsets into the segment file / block device; with file-per-chunk they are the
physical extents the filesystem gave the file (FIEMAP), and a delete becomes a ``trim`` of
the file's extents.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

# Request kinds and GC policies of the FTL (kvmesh.storage.ftl); here so the disk tier's
# tracing, and the CLI's parser (every kvmesh command builds it), never import numba.
OP_WRITE = 0
OP_TRIM = 1
OP_READ = 2
GC_POLICIES = {"greedy": 0, "cost-benefit": 1}

FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 0x1
FIEMAP_EXTENT_LAST = 0x1
_HEAD = struct.Struct("=QQIIII")  # fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count, pad
_EXT = struct.Struct("=QQQQQIIII")  # fe_logical, fe_physical, fe_length, 2 reserved, fe_flags, 3 reserved
_BATCH = 64


def fiemap(fd: int) -> list[tuple[int, int]] | None:
    """Physical extents ``[(device byte offset, length), ...]`` of an open file, in file order;
    ``None`` where the filesystem has no FIEMAP (tmpfs, overlay without it, ...)."""
    out: list[tuple[int, int]] = []
    start = 0
    while True:
        buf = bytearray(_HEAD.pack(start, (1 << 64) - 1 - start, FIEMAP_FLAG_SYNC, 0, _BATCH, 0))
        buf += bytes(_EXT.size * _BATCH)
        try:
            fcntl.ioctl(fd, FS_IOC_FIEMAP, buf)
        except OSError:
            return None
        mapped = _HEAD.unpack_from(buf, 0)[3]
        if mapped == 0:
            return out
        last = False
        for i in range(mapped):
            logical, physical, length, _, _, flags, _, _, _ = _EXT.unpack_from(
                buf, _HEAD.size + i * _EXT.size
            )
            out.append((physical, length))
            start = logical + length
            last = bool(flags & FIEMAP_EXTENT_LAST)
        if last:
            return out


def fiemap_path(path: str) -> list[tuple[int, int]] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return fiemap(fd)
    finally:
        os.close(fd)


@dataclass
class BlockTrace:
    """A trace as the FTL takes it: one row per (request, extent)."""

    ops: np.ndarray
    lpns: np.ndarray
    npages: np.ndarray
    streams: np.ndarray
    arrival_s: np.ndarray
    classes: np.ndarray  # class name of each row ("" for trims/reads)
    page_bytes: int

    @property
    def max_page(self) -> int:
        return int((self.lpns + self.npages).max()) if len(self.lpns) else 0

    def host_bytes_written(self) -> int:
        return int(self.npages[self.ops == OP_WRITE].sum()) * self.page_bytes


_OPS = {"write": OP_WRITE, "trim": OP_TRIM, "delete": OP_TRIM, "read": OP_READ}


def records_to_trace(
    records: Iterable[Mapping[str, object]],
    page_bytes: int = 4096,
    stream_of: Mapping[str, int] | None = None,
    base_offset: int = 0,
    trims: bool = True,
    reads: bool = False,
) -> BlockTrace:
    """Rows for the FTL from trace records. ``stream_of`` maps a write's class to a write
    stream (FDP handle); unknown classes and ``None`` go to stream 0. ``base_offset`` is
    subtracted from every address (the start of the partition or file the tier uses).
    ``trims=False`` drops deletes, as a filesystem without online discard would."""
    ops, lpns, npgs, sts, arr, cls = [], [], [], [], [], []
    t0: float | None = None
    for rec in records:
        op = _OPS.get(str(rec.get("op")))
        if op is None or (op == OP_TRIM and not trims) or (op == OP_READ and not reads):
            continue
        extents = rec.get("extents") or []
        klass = str(rec.get("class", "")) if op == OP_WRITE else ""
        start = rec.get("start")
        t = float(start) if isinstance(start, int | float) else -1.0
        if t >= 0:
            t0 = t if t0 is None else t0
            t -= t0
        stream = (stream_of or {}).get(klass, 0) if op == OP_WRITE else 0
        for ext in extents:  # type: ignore[attr-defined]
            off, length = int(ext[0]) - base_offset, int(ext[1])
            if length <= 0:
                continue
            first = off // page_bytes
            last = -(-(off + length) // page_bytes)
            ops.append(op)
            lpns.append(first)
            npgs.append(last - first)
            sts.append(stream)
            arr.append(t)
            cls.append(klass)
    return BlockTrace(
        np.array(ops, np.int8),
        np.array(lpns, np.int64),
        np.array(npgs, np.int64),
        np.array(sts, np.int64),
        np.array(arr, np.float64),
        np.array(cls, dtype=object),
        page_bytes,
    )


def load_trace(path: str, **kwargs: object) -> BlockTrace:
    """Read a disk-tier JSON-lines trace file (see :func:`records_to_trace`)."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return records_to_trace(records, **kwargs)  # type: ignore[arg-type]


def compact(trace: BlockTrace) -> tuple[BlockTrace, int]:
    """Renumber the pages a trace touches densely, keeping their order: a filesystem on a
    large partition becomes a device just big enough for what the trace used. Returns the
    new trace and its page count. (Reuse of an address is kept, gaps between are dropped.)"""
    if not len(trace.lpns):
        return trace, 0
    starts, ends = trace.lpns, trace.lpns + trace.npages
    bounds = np.unique(np.concatenate([starts, ends]))
    # Each [bounds[i], bounds[i+1]) interval is either wholly touched or not.
    idx_s = np.searchsorted(bounds, starts)
    idx_e = np.searchsorted(bounds, ends)
    touched = np.zeros(len(bounds), np.int64)
    np.add.at(touched, idx_s, 1)
    np.add.at(touched, idx_e, -1)
    used = np.cumsum(touched)[:-1] > 0
    sizes = np.where(used, np.diff(bounds), 0)
    newpos = np.concatenate([[0], np.cumsum(sizes)])
    new_lpns = newpos[idx_s]
    out = BlockTrace(
        trace.ops,
        new_lpns,
        newpos[idx_e] - new_lpns,
        trace.streams,
        trace.arrival_s,
        trace.classes,
        trace.page_bytes,
    )
    return out, int(newpos[-1])
