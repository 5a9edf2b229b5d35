"""Local disk / NVMe tier (``file:///path``).

One file per chunk, ``<dir>/<2 hex>/<key>.kvc``, holding the serde header and payload. The
2-hex subdirectory (a hash of the key) keeps directories small.

Crash safety comes from ordering alone: a chunk is written to a temp file in its final
directory, fsynced, renamed over its final name, and only then entered in the index; a file
is unlinked only after the index stops pointing at it. A crash therefore leaves complete
chunks and ``*.tmp`` leftovers, which the next start removes. The index is not persisted: it
is rebuilt at start from the files' headers, LRU-ordered by mtime. Every write and read hit
stamps the file's mtime (strictly increasing within a process), so recency survives a
restart.

One tier per directory: two live processes on the same directory are not supported.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import mmap
import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, TextIO

import numpy as np
import xxhash

from kvmesh.core import serde
from kvmesh.core.keys import ChunkKey
from kvmesh.errors import CorruptChunkError, TierUnavailableError
from kvmesh.storage.trace import fiemap, fiemap_path
from kvmesh.tiers.base import ChunkData, Into, Tier, TierOptions, payload_buffer, register_tier, url_path
from kvmesh.tiers.placement import Placement, check_class

SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
ALIGN = 4096
# Most evictions one put may perform (diskcache's cull_limit): keeps a put's latency bounded;
# a put that still does not fit is skipped and the next one carries on evicting.
CULL_LIMIT = 16
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@dataclass
class _Entry:
    size: int  # bytes the file occupies (O_DIRECT padding included)
    gen: int  # which write of this key the file on disk is; guards against racing deletes
    pins: int = 0


class DiskTier:
    """Chunks as files in one directory, with a byte budget and LRU eviction.

    Thread-safe: one lock guards the index; file writes and reads run outside it, while
    renames and unlinks run under it so that the index and the directory never disagree
    about which file a key names.
    """

    def __init__(self, path: str, options: TierOptions | None = None) -> None:
        opts = options or TierOptions()
        self.name = opts.name or "disk"
        self.metrics = opts.metrics
        self.path = os.path.abspath(path)
        self.codec = serde.get_codec(opts.codec).name
        self.capacity = opts.capacity_bytes
        self.o_direct = opts.o_direct
        # none | hints: where a write of each lifetime class goes (segments is SegmentTier).
        mode = opts.placement if opts.placement != "segments" else "none"
        self.placement = Placement(mode, opts.ru_size, opts.placement_map)
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # unpinned keys only, oldest first
        self._used = 0
        self._reserved = 0  # bytes of writes in flight, so concurrent puts respect the budget
        self._gen = itertools.count(1)
        self._tmp_seq = itertools.count()
        self._last_stamp = 0
        self._degraded = False
        self._closed = False
        self._local = threading.local()
        self._trace: TextIO | None = None
        self._trace_lock = threading.Lock()
        self._inflight = 0
        os.makedirs(self.path, exist_ok=True)
        if opts.io_trace:
            self._trace = open(opts.io_trace, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._rebuild()

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
        with self.metrics.timed("put"):
            return [self._put_one(k, c) for k, c in zip(keys, chunks, strict=True)]

    def delete(self, keys: Sequence[ChunkKey], force: bool = False) -> int:
        """Remove ``keys``; pinned ones stay unless ``force``. Returns how many went."""
        self._check_open()
        with self._lock:
            n = sum(self._remove(k.text, force) for k in keys)
        self.metrics.inc("deletes", n)
        return n

    def clear(self, force: bool = False) -> int:
        """Remove every chunk that is not pinned (every chunk if ``force``)."""
        self._check_open()
        with self._lock:
            n = sum(self._remove(text, force) for text in list(self._entries))
        self.metrics.inc("deletes", n)
        return n

    def pin(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Protect ``keys`` from eviction (counted: each pin needs its own unpin)."""
        with self._lock:
            return [self._pin(k.text, +1) for k in keys]

    def unpin(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [self._pin(k.text, -1) for k in keys]

    def recode(self, keys: Sequence[ChunkKey], codec: str) -> tuple[int, int]:
        """Re-encode stored chunks with ``codec``; returns their total bytes before and after.
        Ignores the byte budget: a chunk that grows stays, later puts evict to make room."""
        self._check_open()
        codec = serde.get_codec(codec).name
        before = after = 0
        for k in keys:
            with self._lock:
                ent = self._entries.get(k.text)
                gen, old_size = (ent.gen, ent.size) if ent is not None else (0, 0)
            loaded = self._load(k.text, gen, None) if ent is not None else None
            if loaded is None:
                continue
            header, raw, _ = loaded
            new_size = old_size
            if header.codec != codec:
                head, body = serde.encode(k, header.layout, header.tokens, raw, codec)
                try:
                    tmp, new_size = self._write_file(k.text, head, body, "rewrite")
                except OSError:
                    self.metrics.inc("errors")
                    continue
                if not self._commit(k.text, tmp, new_size, replace_gen=gen):
                    continue
            before += old_size
            after += new_size
        return before, after

    def health(self) -> str:
        return "degraded" if self._degraded else "up"

    def close(self) -> None:
        self._closed = True
        with self._trace_lock:
            if self._trace is not None:
                self._trace.close()
                self._trace = None

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._entries))

    def size_bytes(self) -> int:
        with self._lock:
            return self._used

    def _get_one(self, key: ChunkKey, into: Into | None = None) -> ChunkData | None:
        text = key.text
        with self._lock:
            ent = self._entries.get(text)
            gen = ent.gen if ent is not None else 0
            stamp = self._stamp()
        loaded = self._load(text, gen, stamp, into) if ent is not None else None
        if loaded is None:
            self.metrics.inc("misses")
            return None
        header, raw, stored = loaded
        with self._lock:
            if text in self._lru:
                self._lru.move_to_end(text)
        self.metrics.inc("hits")
        self.metrics.inc("bytes_out", stored)
        return ChunkData(key, header.layout, header.tokens, raw, header.codec, stored)

    def _load(
        self, text: str, gen: int, stamp: int | None, into: Into | None = None
    ) -> tuple[serde.ChunkHeader, serde.Buffer, int] | None:
        """Read and verify one file: ``(header, raw bytes, bytes read)``, or ``None`` for a miss.
        Stamps the file's mtime with ``stamp`` so recency survives a restart."""
        try:
            with self._traced("read", text) as rec, open(self._file(text), "rb", buffering=0) as f:
                header = self._read_header(f, text)
                if os.fstat(f.fileno()).st_size < header.header_size + header.payload_len:
                    raise CorruptChunkError(f"chunk file {text} is shorter than its header says")
                body = payload_buffer(into, header.payload_len, header.codec)
                got = 0
                while got < len(body):
                    n = f.readinto(body[got:])
                    if not n:
                        raise CorruptChunkError(f"chunk file {text} truncated inside its payload")
                    got += n
                raw = serde.decode_payload(header, body)
                rec["bytes"] = header.header_size + len(body)
                if stamp is not None:
                    os.utime(f.fileno(), ns=(stamp, stamp))
        except (FileNotFoundError, CorruptChunkError) as exc:
            self._drop(text, gen, corrupt=isinstance(exc, CorruptChunkError))
            return None
        except OSError:
            self.metrics.inc("errors")  # EIO and the like: a miss, but the file may be fine
            return None
        # The raw codec hands back a view of ``body``: give the caller the buffer itself.
        return header, body if header.codec == "raw" else raw, int(rec["bytes"])

    @staticmethod
    def _read_header(f: BinaryIO, text: str) -> serde.ChunkHeader:
        prefix = f.read(serde.PREFIX_SIZE)
        return serde.decode_header(prefix + f.read(serde.header_length(prefix) - len(prefix)), text)

    def _put_one(self, key: ChunkKey, chunk: ChunkData) -> bool:
        text = key.text
        with self._lock:
            present = text in self._entries
            if present and text in self._lru:
                self._lru.move_to_end(text)
            stamp = self._stamp()
        if present:  # same key, same bytes: no rewrite, only recency
            with contextlib.suppress(OSError):
                os.utime(self._file(text), ns=(stamp, stamp))
            return True
        head, body = serde.encode(key, chunk.layout, chunk.tokens, chunk.data, self.codec)
        want = len(head) + memoryview(body).nbytes
        if self.o_direct:
            want = -(-want // ALIGN) * ALIGN
        with self._lock:
            fits = self._reserve(want)
        if not fits:
            self.metrics.inc("skipped_stores")
            return False
        try:
            tmp, size = self._write_file(text, head, body, check_class(chunk.lifetime))
        except OSError as exc:
            with self._lock:
                self._reserved -= want
            self._degraded = True
            self.metrics.inc("skipped_stores")
            self.metrics.inc("errors", int(exc.errno not in _FULL_ERRNOS))
            return False
        if not self._commit(text, tmp, size, replace_gen=None, reserved=want):
            self.metrics.inc("skipped_stores")
            return False
        self._degraded = False
        self.metrics.inc("stores")
        self.metrics.inc("bytes_in", size)
        return True

    def _write_file(self, text: str, head: bytes, body: serde.Buffer, cls: str = "store") -> tuple[str, int]:
        """Write a durable temp file beside ``text``'s final name: ``(temp path, size)``."""
        tmp = f"{self._file(text)}.{os.getpid()}.{next(self._tmp_seq)}{TMP_SUFFIX}"
        direct = self.o_direct
        try:
            return tmp, self._write_tmp(tmp, text, head, body, direct, cls)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if not (direct and exc.errno == errno.EINVAL):
                raise
            msg = f"O_DIRECT refused under {self.path} ({exc}); the disk tier falls back to buffered I/O"
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            self.o_direct = False
            return self._write_file(text, head, body, cls)

    def _write_tmp(
        self, tmp: str, text: str, head: bytes, body: serde.Buffer, direct: bool, cls: str = "store"
    ) -> int:
        n = len(head) + memoryview(body).nbytes
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # a 2-hex subdirectory not made yet (or removed by hand)
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            fd = os.open(tmp, flags, 0o644)
        try:
            self.placement.apply(fd, cls)
            with self._traced("write", text) as rec:
                rec["class"] = cls
                if direct:
                    # O_DIRECT wants an aligned buffer and length: copy into a page-aligned
                    # mmap kept per thread, padded; the header's payload_len marks the end.
                    size = -(-n // ALIGN) * ALIGN
                    mv = self._aligned(size)
                    # numpy copies at memcpy speed (memoryview slice assignment does not).
                    buf = np.frombuffer(mv, dtype=np.uint8, count=size)
                    buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
                    buf[len(head) : n] = np.frombuffer(body, dtype=np.uint8)
                    buf[n:size] = 0
                    self._write_all(fd, mv[:size])
                else:
                    size = n
                    self._write_all(fd, memoryview(head))
                    self._write_all(fd, memoryview(body).cast("B"))
                rec["bytes"] = size
                if self._trace is not None:  # the LBAs the filesystem gave the file
                    rec["extents"] = fiemap(fd)
            with self._lock:
                stamp = self._stamp()
            os.utime(fd, ns=(stamp, stamp))
            with self._traced("fsync", text):
                os.fsync(fd)
        finally:
            os.close(fd)
        return size

    def _aligned(self, size: int) -> memoryview:
        mv: memoryview | None = getattr(self._local, "buf", None)
        if mv is None or mv.nbytes < size:
            mv = self._local.buf = memoryview(mmap.mmap(-1, max(size, 1 << 20)))
        return mv

    @staticmethod
    def _write_all(fd: int, mv: memoryview) -> None:
        while mv.nbytes:
            mv = mv[os.write(fd, mv) :]

    def _commit(self, text: str, tmp: str, size: int, replace_gen: int | None, reserved: int = 0) -> bool:
        """Rename ``tmp`` into place, then index it. With ``replace_gen`` (recode) only while
        that write of the key is still the current one. The reservation turns into used bytes
        under the same lock, so no other put can slip into the budget in between."""
        with self._lock:
            self._reserved -= reserved
            old = self._entries.get(text)
            ok = replace_gen is None or (old is not None and old.gen == replace_gen)
            try:
                if ok:
                    os.rename(tmp, self._file(text))
            except OSError:
                self.metrics.inc("errors")
                ok = False
            if ok:
                self._used += size - (old.size if old is not None else 0)
                self._entries[text] = _Entry(size, next(self._gen), old.pins if old is not None else 0)
                if old is None:
                    self._lru[text] = None
                self._gauges()
        if not ok:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return ok

    def _reserve(self, size: int) -> bool:
        if self.capacity is not None:
            culled = 0
            while self._used + self._reserved + size > self.capacity and self._lru and culled < CULL_LIMIT:
                victim = next(iter(self._lru))
                self._remove(victim, force=False)
                self.metrics.inc("evictions")
                culled += 1
            if self._used + self._reserved + size > self.capacity:
                return False
        self._reserved += size
        return True

    def _pin(self, text: str, delta: int) -> bool:
        ent = self._entries.get(text)
        if ent is None or ent.pins + delta < 0:
            return False
        ent.pins += delta
        if ent.pins:
            self._lru.pop(text, None)
        else:
            self._lru[text] = None
        return True

    def _remove(self, text: str, force: bool) -> bool:
        ent = self._entries.get(text)
        if ent is None or (ent.pins and not force):
            return False
        del self._entries[text]
        self._lru.pop(text, None)
        self._used -= ent.size
        self._gauges()
        with self._traced("delete", text) as rec, contextlib.suppress(FileNotFoundError):
            if self._trace is not None:  # a delete is a trim of the file's extents
                rec["extents"] = fiemap_path(self._file(text))
            os.unlink(self._file(text))
            rec["bytes"] = ent.size
        return True

    def _drop(self, text: str, gen: int, corrupt: bool) -> None:
        """Forget a file found bad or gone, unless a newer write replaced it meanwhile."""
        with self._lock:
            ent = self._entries.get(text)
            if ent is not None and ent.gen == gen:
                self._remove(text, force=True)
        if corrupt:
            self.metrics.inc("corrupt")

    def _stamp(self) -> int:
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        return self._last_stamp

    def _gauges(self) -> None:
        self.metrics.set("bytes_used", self._used)
        self.metrics.set("objects", len(self._entries))

    def _rebuild(self) -> None:
        found: list[tuple[int, str, int]] = []
        for sub in os.scandir(self.path):
            if not (sub.is_dir() and len(sub.name) == 2):
                continue
            for f in os.scandir(sub.path):
                if f.name.endswith(TMP_SUFFIX):
                    with contextlib.suppress(OSError):
                        os.unlink(f.path)
                elif f.name.endswith(SUFFIX):
                    text = f.name[: -len(SUFFIX)]
                    st = f.stat()
                    if self._file(text) == f.path and self._header_ok(f.path, text, st.st_size):
                        found.append((st.st_mtime_ns, text, st.st_size))
                    else:
                        self.metrics.inc("corrupt")
                        with contextlib.suppress(OSError):
                            os.unlink(f.path)
        with self._lock:
            for mtime, text, size in sorted(found):
                self._entries[text] = _Entry(size, next(self._gen))
                self._lru[text] = None
                self._used += size
                self._last_stamp = max(self._last_stamp, mtime)
            # A smaller budget than last time: evict down to it now, however long it takes.
            while self.capacity is not None and self._used > self.capacity and self._lru:
                self._remove(next(iter(self._lru)), force=False)
                self.metrics.inc("evictions")
            self._gauges()

    def _header_ok(self, path: str, text: str, file_size: int) -> bool:
        try:
            with open(path, "rb", buffering=0) as f:
                header = self._read_header(f, text)
        except (OSError, CorruptChunkError):
            return False
        return file_size >= header.header_size + header.payload_len

    def _file(self, text: str) -> str:
        sub = xxhash.xxh3_64_hexdigest(text.encode())[:2]
        return os.path.join(self.path, sub, text + SUFFIX)

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailableError(f"disk tier {self.path} is closed; open a new one")

    @contextlib.contextmanager
    def _traced(self, op: str, text: str) -> Iterator[dict[str, Any]]:
        rec: dict[str, Any] = {"op": op, "key": text, "bytes": 0}
        if self._trace is None:
            yield rec
            return
        with self._trace_lock:
            rec["queue_depth"] = self._inflight
            self._inflight += 1
        rec["start"] = time.time()
        try:
            yield rec
        finally:
            rec["end"] = time.time()
            with self._trace_lock:
                self._inflight -= 1
                if self._trace is not None:
                    self._trace.write(json.dumps(rec) + "\n")


@register_tier("file")
def open_disk_tier(url: str, options: TierOptions) -> Tier:
    if options.placement == "segments":
        from kvmesh.tiers.segments import SegmentTier

        placement = Placement("segments", options.ru_size, options.placement_map)
        return SegmentTier(url_path(url), options, placement)
    return DiskTier(url_path(url), options)
