"""Local disk / NVMe tier (``file:///path``).

One file per chunk, ``<dir>/<2 hex>/<key>.kvc``, holding the serde header and payload (file
I/O lives in :mod:`kvmesh.tiers.diskfiles`). The 2-hex subdirectory (a hash of the key)
keeps directories small.

One directory, one owner: the tier holds an exclusive lock on its directory
(:mod:`kvmesh.tiers.dirlock`); a second process gets :class:`~kvmesh.errors.DirectoryLockedError`
naming the holder's pid. Opened through :func:`~kvmesh.tiers.base.open_tier` (as the engine
does), each TP rank and each replica gets its own sub-directory by default.

Crash safety comes from ordering alone: a chunk is written to a temp file in its final
directory, fsynced, renamed over its final name, the directory fsynced, and only then
entered in the index; a file is unlinked only after the index stops pointing at it. A crash
therefore leaves complete chunks and ``*.tmp`` leftovers, which the next owner removes (only
the owner: the lock guarantees no one else is writing). The index is not persisted: it is
rebuilt at start from the files' headers, in recency order by mtime. Every write and read
hit stamps the file's mtime (strictly increasing within a process), so recency survives a
restart. Recency itself is :mod:`kvmesh.core.policy` (``eviction_policy``); pinned chunks
leave the policy until their last unpin.

A filesystem that fills before the budget (other files on it, or ``max_local_disk_size``
larger than the disk; checked and said at open) evicts the least recently used chunks worth
the new one and writes it again: the tier goes on as an LRU cache of the room there is.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from kvmesh.core import serde
from kvmesh.core.keys import ChunkKey
from kvmesh.core.policy import PinCounts, make_policy
from kvmesh.core.saylimit import SayLimit, gib, held_back
from kvmesh.errors import CorruptChunkError, TierUnavailableError
from kvmesh.tiers import dirlock
from kvmesh.tiers.base import (
    ChunkData,
    Feature,
    Into,
    StoredChunk,
    TierOptions,
    count_rejected,
    counted_read,
    register_tier,
    url_path,
)
from kvmesh.tiers.diskfiles import ALIGN, SUFFIX, TMP_SUFFIX, ChunkFiles
from kvmesh.tiers.diskproc import Read, ReaderProcess
from kvmesh.tiers.placement import Placement, check_class

if TYPE_CHECKING:
    from kvmesh.tiers.segments import SegmentTier

log = logging.getLogger(__name__)

__all__ = ["ALIGN", "CULL_LIMIT", "SUFFIX", "TMP_SUFFIX", "DiskTier", "open_disk_tier"]

# Most evictions one put may perform (diskcache's cull_limit): keeps a put's latency bounded;
# a put that still does not fit is skipped and the next one carries on evicting.
CULL_LIMIT = 16
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@dataclass
class _Entry:
    size: int  # bytes the file occupies (O_DIRECT padding included)
    gen: int  # which write of this key the file on disk is; guards against racing deletes


class DiskTier:
    """Chunks as files in one directory, with a byte budget and policy-ordered eviction.

    Thread-safe: one lock guards the index; file writes and reads run outside it, while
    renames and unlinks run under it so that the index and the directory never disagree
    about which file a key names.
    """

    features = Feature.PIN | Feature.RECODE | Feature.ADVISE

    def __init__(
        self, path: str, options: TierOptions | None = None, lock: dirlock.DirLock | None = None
    ) -> None:
        opts = options or TierOptions()
        self.name = opts.name or "disk"
        self.metrics = opts.metrics
        self.path = os.path.abspath(path)
        self.codec = serde.get_codec(opts.codec).name
        self.chunk_format = opts.chunk_format
        self.capacity = opts.capacity_bytes
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._policy = make_policy(opts.eviction_policy)  # unpinned keys only
        self._pins = PinCounts()
        self._used = 0
        self._reserved = 0  # bytes of writes in flight, so concurrent puts respect the budget
        self._gen = itertools.count(1)
        self._degraded = False
        self._say = SayLimit()  # a full filesystem: said once, then at most every 5 minutes
        self._closed = False
        self._dirlock = lock or dirlock.DirLock(self.path)
        try:
            # none | hints: where a write of each lifetime class goes (segments is SegmentTier).
            mode = opts.placement if opts.placement != "segments" else "none"
            placement = Placement(mode, opts.ru_size, opts.placement_map)
            self.files = ChunkFiles(self.path, opts.o_direct, opts.io_trace, placement, opts.chunk_format)
            self._rebuild()
            self._check_room()
        except BaseException:
            self._dirlock.release()
            raise
        # The reads in a process of their own (kvmesh.tiers.diskproc); not with an I/O trace,
        # which records this process's reads.
        self._reader: ReaderProcess | None = None
        if opts.read_process and not opts.io_trace:
            try:
                self._reader = ReaderProcess(self.path, self.chunk_format)
            except (OSError, ValueError) as exc:  # no memfd, no process: the reads stay here
                log.warning(
                    "kvmesh disk tier %s: no reader process (%s); reading in this process", self.path, exc
                )

    @property
    def o_direct(self) -> bool:
        return self.files.o_direct

    # ---- the Tier protocol ------------------------------------------------------------

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._check_open()
        with self._lock:
            return [k.text in self._entries for k in keys]

    def get(self, keys: Sequence[ChunkKey], into: Into | None = None) -> list[ChunkData | None]:
        self._check_open()
        with self.metrics.timed("get"):
            try:  # every file at once: a cold read waits for the slowest, not for the sum
                items = self._read_many(keys, into)
            except RuntimeError:  # closed meanwhile
                self._check_open()
                raise
            out: list[ChunkData | None] = []
            for k, item in zip(keys, items, strict=True):
                if item is not None:
                    with self._lock:
                        self._policy.touch(k.text)
                out.append(counted_read(self.metrics, k, item))
            return out

    def advise(self, keys: Sequence[ChunkKey]) -> None:
        """Start reading the files of ``keys`` into the page cache on the I/O threads, and
        return at once: the get that follows finds them read or in flight (a no-op with
        O_DIRECT)."""
        if self._closed or self.files.o_direct:
            return
        with self._lock:
            texts = [k.text for k in keys if k.text in self._entries]
        self.files.advise(texts)

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

    def health(self) -> str:
        return "degraded" if self._degraded else "up"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.close()
        self.files.close()
        self._dirlock.release()

    # ---- PinnableTier -----------------------------------------------------------------

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        """Protect ``keys`` from eviction, present or not (counted: each pin needs its own
        unpin; a pin on a key not stored yet applies when it arrives)."""
        with self._lock:
            for k in keys:
                if self._pins.pin(k.text) and k.text in self._entries:
                    self._policy.remove(k.text)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            for k in keys:
                if self._pins.unpin(k.text) and k.text in self._entries:
                    self._policy.insert(k.text)

    @property
    def placement(self) -> Placement:
        """Where writes of each lifetime class go (``none`` or ``hints``), and what the kernel
        accepted (``placement.status()``)."""
        return self.files.placement

    def is_pinned(self, key: ChunkKey) -> bool:
        with self._lock:
            return key.text in self._pins

    # ---- RecodableTier ----------------------------------------------------------------

    def read_stored(self, keys: Sequence[ChunkKey]) -> list[StoredChunk | None]:
        self._check_open()
        return [self._load(k, None, stamp=False) for k in keys]

    def rewrite(self, key: ChunkKey, head: bytes, body: serde.Buffer, version: int | None) -> int | None:
        """Replace ``key``'s file while write ``version`` is still the current one. Ignores
        the byte budget: a chunk that grows stays, later puts evict to make room."""
        self._check_open()
        try:
            tmp, size = self.files.write_tmp(key.text, head, body, "rewrite")
        except OSError:
            self.metrics.inc("errors")
            return None
        return size if self._commit(key.text, tmp, size, replace_gen=version) else None

    # ---- inspection -------------------------------------------------------------------

    def drop_page_cache(self, text: str) -> None:
        """Evict the chunk ``text`` from the OS page cache (its file only: never the
        machine-wide drop_caches, which would disturb every other process), so that the next
        read of it is cold. For benchmarks; best effort."""
        self.files.drop_page_cache(text)

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._entries))

    def size_bytes(self) -> int:
        with self._lock:
            return self._used

    # ---- internals --------------------------------------------------------------------

    def _read_many(self, keys: Sequence[ChunkKey], into: Into | None) -> list[StoredChunk | None]:
        """``_load`` of every key, by the reader process when there is one and it is free
        (what it could not read, read here)."""
        items: list[StoredChunk | bool | None] = [False] * len(keys)  # False: not read yet
        reader = self._reader
        if reader is not None and keys:
            with reader.held(blocking=False) as free:
                if free:
                    self._read_in_child(reader, keys, into, items)
        todo = [i for i, item in enumerate(items) if item is False]
        if todo:
            loaded = self.files.each(partial(self._load, into=into, stamp=True), [keys[i] for i in todo])
            for i, item in zip(todo, loaded, strict=True):
                items[i] = item
        return [item if isinstance(item, StoredChunk) else None for item in items]

    def _read_in_child(
        self,
        reader: ReaderProcess,
        keys: Sequence[ChunkKey],
        into: Into | None,
        items: list[StoredChunk | bool | None],
    ) -> None:
        """Fill ``items`` with what ``reader`` reads; those it cannot read stay ``False``."""
        gens: dict[int, int] = {}
        with self._lock:
            for i, k in enumerate(keys):
                ent = self._entries.get(k.text)
                if ent is None:
                    items[i] = None
                else:
                    gens[i] = ent.gen
        todo = list(gens)
        while todo:
            reads = reader.batch([keys[i] for i in todo], [self.files.stamp() for _ in todo])
            if reads is None:
                self.metrics.inc("read_process_failures")
                return  # the rest are read here
            later = []
            for i, r in zip(todo, reads, strict=True):
                if r.status == "later":
                    later.append(i)
                    continue
                items[i] = self._landed(keys[i], gens[i], r, reader, into)
            if len(later) == len(todo):
                return  # nothing fits the staging buffer: read here
            todo = later

    def _landed(
        self, key: ChunkKey, gen: int, r: Read, reader: ReaderProcess, into: Into | None
    ) -> StoredChunk | None:
        if r.status == "gone":
            self._drop(key.text, gen)
            return None
        if r.status in ("corrupt", "unauthenticated"):
            if count_rejected(self.metrics, r.error()):
                self._drop(key.text, gen)
            return None
        if r.status != "ok":
            self.metrics.inc("errors")  # EIO and the like: a miss, but the file may be fine
            return None
        dst = into(r.nbytes) if into is not None else None
        if dst is None:
            dst = memoryview(bytearray(r.nbytes))
        np.frombuffer(dst, dtype=np.uint8)[:] = reader.staging[r.offset : r.offset + r.nbytes]
        return StoredChunk(r.chunk_header(), dst, r.stored, version=gen)

    def _load(self, key: ChunkKey, into: Into | None, stamp: bool) -> StoredChunk | None:
        """Read and verify ``key``'s file (``version`` = its write generation), or ``None``
        for a miss. A file found gone or bad leaves the index (if no newer write replaced it)."""
        text = key.text
        with self._lock:
            ent = self._entries.get(text)
        if ent is None:
            return None
        try:
            item = self.files.read(key, stamp, into)
        except FileNotFoundError:
            self._drop(text, ent.gen)
            return None
        except CorruptChunkError as exc:
            if count_rejected(self.metrics, exc):
                self._drop(text, ent.gen)
            return None
        except OSError:
            self.metrics.inc("errors")  # EIO and the like: a miss, but the file may be fine
            return None
        item.version = ent.gen
        return item

    def _put_one(self, key: ChunkKey, chunk: ChunkData) -> bool:
        text = key.text
        with self._lock:
            present = text in self._entries
            if present:
                self._policy.touch(text)
        if present:  # same key, same bytes: no rewrite, only recency
            self.files.touch(text)
            return True
        head, body = self.chunk_format.encode(key, chunk.layout, chunk.tokens, chunk.data, self.codec)
        want = len(head) + memoryview(body).nbytes
        if self.files.o_direct:
            want = -(-want // ALIGN) * ALIGN
        with self._lock:
            fits = self._reserve(want)
        if not fits:
            self.metrics.skip("capacity")  # the budget is taken by pinned or reserved chunks
            return False
        try:
            tmp, size = self._write_tmp(text, head, body, check_class(chunk.lifetime), want)
        except OSError as exc:
            with self._lock:
                self._reserved -= want
            self._degraded = True
            full = exc.errno in _FULL_ERRNOS
            self.metrics.skip("full" if full else "io_error")
            self.metrics.inc("errors", int(not full))
            return False
        if not self._commit(text, tmp, size, replace_gen=None, reserved=want):
            self.metrics.skip("io_error")
            return False
        self._degraded = False
        self.metrics.inc("stores")
        self.metrics.inc("bytes_in", size)
        return True

    def _commit(self, text: str, tmp: str, size: int, replace_gen: int | None, reserved: int = 0) -> bool:
        """Rename ``tmp`` into place, fsync its directory, then index it. With ``replace_gen``
        (recode) only while that write of the key is still the current one. The reservation
        turns into used bytes under the same lock, so no other put slips into the budget."""
        with self._lock:
            old = self._entries.get(text)
            ok = replace_gen is None or (old is not None and old.gen == replace_gen)
            try:
                if ok:
                    os.rename(tmp, self.files.path(text))
            except OSError:
                self.metrics.inc("errors")
                ok = False
            if not ok:
                self._reserved -= reserved
        if not ok:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        # Outside the index lock: an fsync may take milliseconds, and the new name is
        # already complete (readers of the old index entry read the new, equal, bytes).
        # The reservation stays counted until the bytes are counted as used below: released
        # before the fsync, concurrent puts overshot the budget by a chunk (CI caught it).
        self.files.sync_dir(text)
        with self._lock:
            self._reserved -= reserved
            cur = self._entries.get(text)
            if replace_gen is not None and (cur is None or cur.gen != replace_gen):
                # Deleted or rewritten while we synced: the index already says what is there.
                return cur is not None
            self._used += size - (cur.size if cur is not None else 0)
            self._entries[text] = _Entry(size, next(self._gen))
            if cur is None and text not in self._pins:
                self._policy.insert(text)
            self._gauges()
        return True

    def _check_room(self) -> None:
        """Say at open when the budget is more than the filesystem can hold."""
        if self.capacity is None:
            return
        try:
            st = os.statvfs(self.path)
        except OSError:
            return
        room = self._used + st.f_bavail * st.f_frsize
        if self.capacity > room:
            log.warning(
                "kvmesh disk tier %s: max_local_disk_size is %s but the filesystem has room for "
                "%s of chunks here; when it fills, the least recently used are evicted to make room",
                self.path,
                gib(self.capacity),
                gib(room),
            )

    def _write_tmp(self, text: str, head: bytes, body: serde.Buffer, cls: str, want: int) -> tuple[str, int]:
        """``files.write_tmp``; a filesystem full before the budget (other files on it, or a
        budget larger than the disk) evicts the least recently used chunks worth this one
        and tries once more: the tier goes on as an LRU cache of the room there is, rather than
        refuse every new chunk and keep the old ones for ever."""
        try:
            return self.files.write_tmp(text, head, body, cls)
        except OSError as exc:
            if exc.errno not in _FULL_ERRNOS:
                raise
            with self._lock:
                freed = self._evict_bytes(want)
            self._say_full(freed)
            if not freed:
                raise
            return self.files.write_tmp(text, head, body, cls)

    def _evict_bytes(self, want: int, limit: int | None = None) -> int:
        """Evict unpinned chunks, least recently used first, until ``want`` bytes are freed
        (or none is left, or ``limit`` chunks went); the bytes freed. Under ``self._lock``."""
        freed = culled = 0
        while freed < want and len(self._policy) and (limit is None or culled < limit):
            culled += 1
            victim = self._policy.candidates(1)[0]
            size = self._entries[victim].size
            if not self._remove(victim, force=False):
                break
            self.metrics.inc("evictions")
            freed += size
        return freed

    def _say_full(self, freed: int) -> None:
        held = self._say.due("full" if freed else "full_pinned")
        if held is None:
            return
        budget = gib(self.capacity) if self.capacity is not None else "no limit"
        log.warning(
            "kvmesh disk tier %s: the filesystem is full with %s of chunks here (budget %s)%s: %s",
            self.path,
            gib(self._used),
            budget,
            held_back(held),
            "the least recently used are evicted to make room (free space there, or lower "
            "max_local_disk_size)"
            if freed
            else "nothing here can be evicted (all pinned, or none stored): the store is skipped",
        )

    def _reserve(self, size: int) -> bool:
        if self.capacity is not None:
            self._evict_bytes(self._used + self._reserved + size - self.capacity, CULL_LIMIT)
            if self._used + self._reserved + size > self.capacity:
                return False
        self._reserved += size
        return True

    def _remove(self, text: str, force: bool) -> bool:
        ent = self._entries.get(text)
        if ent is None or (text in self._pins and not force):
            return False
        del self._entries[text]
        self._policy.remove(text)
        self._used -= ent.size
        self._gauges()
        self.files.unlink(text, ent.size)
        return True

    def _drop(self, text: str, gen: int) -> None:
        """Forget a file found bad or gone, unless a newer write replaced it meanwhile."""
        with self._lock:
            ent = self._entries.get(text)
            if ent is not None and ent.gen == gen:
                self._remove(text, force=True)

    def _gauges(self) -> None:
        self.metrics.set("bytes_used", self._used)
        self.metrics.set("objects", len(self._entries))

    def _rebuild(self) -> None:
        found: list[tuple[int, str, int]] = []
        for text, f in self.files.scan():
            if f.name.endswith(TMP_SUFFIX):
                # Safe: we hold the directory lock, so no other process is writing here.
                with contextlib.suppress(OSError):
                    os.unlink(f.path)
            elif text:
                st = f.stat(follow_symlinks=False)  # a link is refused, never followed
                bad = (
                    self.files.check_header(f.path, text, st.st_size)
                    if self.files.path(text) == f.path
                    else CorruptChunkError(f"{f.path} is not where {text} belongs")
                )
                if bad is None:
                    found.append((st.st_mtime_ns, text, st.st_size))
                else:
                    count_rejected(self.metrics, bad)  # removed either way: nobody else writes here
                    with contextlib.suppress(OSError):
                        os.unlink(f.path)
        with self._lock:
            for mtime, text, size in sorted(found):
                self._entries[text] = _Entry(size, next(self._gen))
                self._policy.insert(text)
                self._used += size
                self.files.seen_stamp(mtime)
            # A smaller budget than last time: evict down to it now, however long it takes.
            while self.capacity is not None and self._used > self.capacity and len(self._policy):
                self._remove(self._policy.candidates(1)[0], force=False)
                self.metrics.inc("evictions")
            self._gauges()

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailableError(f"disk tier {self.path} is closed; open a new one")


@register_tier("file")
def open_disk_tier(url: str, options: TierOptions) -> DiskTier | SegmentTier:
    """The disk tier of ``url``, in the sub-directory ``options.subdir`` asks for
    (``"auto"``: ``<path>/rank<shard>/slot<n>``; see :mod:`kvmesh.tiers.dirlock`), laid out
    as ``options.placement`` says (``segments``: :class:`~kvmesh.tiers.segments.SegmentTier`)."""
    where, lock = dirlock.claim(os.path.abspath(url_path(url)), options.subdir, options.shard)
    if options.placement == "segments":
        from kvmesh.tiers.segments import SegmentTier

        placement = Placement("segments", options.ru_size, options.placement_map)
        return SegmentTier(where, options, placement, lock=lock)
    return DiskTier(where, options, lock=lock)
