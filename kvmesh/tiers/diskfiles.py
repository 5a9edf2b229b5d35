"""The disk tier's file I/O: naming, durable writes, verified reads, the I/O trace.

:class:`ChunkFiles` knows nothing of budgets, pins or recency (that is
:class:`~kvmesh.tiers.disk.DiskTier`); it turns a chunk key into a file and back. A write
goes to a temp file beside the final name, is fsynced, and is renamed by the tier under its
index lock; :meth:`ChunkFiles.sync_dir` then makes the rename itself durable.
"""

from __future__ import annotations

import contextlib
import errno
import io
import itertools
import json
import mmap
import os
import stat
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, TextIO, TypeVar

import numpy as np
import xxhash

from kvmesh.core import serde
from kvmesh.core.keys import ChunkKey
from kvmesh.core.serde import ChunkFormat
from kvmesh.errors import CorruptChunkError
from kvmesh.storage.trace import fiemap, fiemap_path
from kvmesh.tiers.base import Into, StoredChunk, payload_buffer
from kvmesh.tiers.placement import Placement
from kvmesh.tiers.segment_format import start_writeback

SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
ALIGN = 4096
T = TypeVar("T")
R = TypeVar("R")
WRITEBACK_PIECE = 4 << 20  # a chunk file is written in pieces of this, each started on its way
IO_THREADS = 8  # files ChunkFiles.each (the disk tier's reads) and advise open at once
# A chunk file is opened without following a final symlink and without blocking: a FIFO
# where a chunk should be blocks a plain open until a writer comes, and its reads forever.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_regular(path: str) -> tuple[io.FileIO | None, os.stat_result]:
    """Open ``path`` for reading if it is a regular file: ``(file, its stat)``; for anything
    else (a symlink, a FIFO, a device, a directory) ``(None, its lstat)``, opened and read
    never. Raises ``FileNotFoundError`` and other ``OSError`` as ``open`` does."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as exc:
        if exc.errno != errno.ELOOP:  # ELOOP: O_NOFOLLOW met a symlink
            raise
        return None, os.lstat(path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None, st
        return open(fd, "rb", buffering=0, closefd=True), st
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


class ChunkFiles:
    """``<root>/<2 hex>/<key>.kvc`` files: one serialized chunk each. Thread-safe."""

    def __init__(
        self,
        root: str,
        o_direct: bool = False,
        io_trace: str | None = None,
        placement: Placement | None = None,
        chunk_format: ChunkFormat = serde.PLAIN,
    ) -> None:
        self.placement = placement or Placement("none")
        self.chunk_format = chunk_format
        self.root = root
        self.o_direct = o_direct
        self._tmp_seq = itertools.count()
        self._stamp_lock = threading.Lock()
        self._last_stamp = 0
        self._local = threading.local()
        self._trace: TextIO | None = None
        self._trace_lock = threading.Lock()
        self._inflight = 0
        # Its threads start here, on the cores of the thread that opens the tier (the vLLM
        # worker opens it on its background cores). Started by the first read instead, the
        # eight starts (each waiting for the GIL beside vLLM's busy worker) took ~6 ms of the
        # first lookup that advised the disk: past the scheduler's wait, a step for its request.
        self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvmesh-disk-io")
        gate = threading.Event()
        for _ in range(IO_THREADS):  # none idle while the gate is shut: each submit starts one
            self._io.submit(gate.wait, 1.0)
        gate.set()
        if io_trace:
            self._trace = open(io_trace, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def path(self, text: str) -> str:
        sub = xxhash.xxh3_64_hexdigest(text.encode())[:2]
        return os.path.join(self.root, sub, text + SUFFIX)

    def stamp(self) -> int:
        """A file mtime (ns), strictly increasing within the process: recency on disk."""
        with self._stamp_lock:
            self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
            return self._last_stamp

    def seen_stamp(self, mtime_ns: int) -> None:
        with self._stamp_lock:
            self._last_stamp = max(self._last_stamp, mtime_ns)

    def touch(self, text: str) -> None:
        with contextlib.suppress(OSError):
            stamp = self.stamp()
            os.utime(self.path(text), ns=(stamp, stamp))

    def drop_page_cache(self, text: str) -> None:
        """``POSIX_FADV_DONTNEED`` on the file of ``text``: its pages leave the page cache, so
        the next read is cold. Best effort: a file gone meanwhile is left alone."""
        self._fadvise(text, os.POSIX_FADV_DONTNEED)

    # ---- reads ------------------------------------------------------------------------

    def advise(self, texts: Sequence[str]) -> None:
        """``POSIX_FADV_WILLNEED`` on the files of ``texts``, on the I/O threads: returns at
        once, and the kernel reads them into the page cache meanwhile (a read of one of them
        then waits for the pages in flight, never reads twice). Best effort: a file gone
        meanwhile is left to the read to report."""
        with contextlib.suppress(RuntimeError):  # closed meanwhile: the reads go without it
            for text in texts:
                self._io.submit(self._advise_one, text)

    def each(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``[fn(x) for x in items]``, several at once on the I/O threads (``fn`` must be
        thread-safe): a cold read of n files then waits about for the slowest, not for the
        sum of their opens and reads. Raises ``RuntimeError`` once closed."""
        if len(items) <= 1:
            return [fn(x) for x in items]
        return list(self._io.map(fn, items))

    def _advise_one(self, text: str) -> None:
        self._fadvise(text, os.POSIX_FADV_WILLNEED)

    def _fadvise(self, text: str, advice: int) -> None:
        try:
            fd = os.open(self.path(text), READ_FLAGS)
        except OSError:
            return
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        except OSError:
            pass
        finally:
            os.close(fd)

    def read(self, key: ChunkKey, stamp: bool, into: Into | None = None) -> StoredChunk:
        """Read and verify one file. Raises ``FileNotFoundError``, :class:`CorruptChunkError`
        or another ``OSError``. With ``stamp`` the file's mtime records this read."""
        fmt, text = self.chunk_format, key.text
        with self.traced("read", text) as rec:
            f, st = open_regular(self.path(text))
            if f is None:
                raise CorruptChunkError(f"chunk file {text} is not a regular file")
            with f:
                head = _header_bytes(f, fmt)
                header = fmt.decode_header(head, key)
                if st.st_size < header.header_size + header.payload_len:
                    raise CorruptChunkError(f"chunk file {text} is shorter than its header says")
                body = payload_buffer(into, header)
                got = 0
                while got < len(body):
                    n = f.readinto(body[got:])
                    if not n:
                        raise CorruptChunkError(f"chunk file {text} truncated inside its payload")
                    got += n
                raw = fmt.decode_payload(header, body, into)
                rec["bytes"] = header.header_size + len(body)
                if stamp:
                    t = self.stamp()
                    os.utime(f.fileno(), ns=(t, t))
        return StoredChunk(header, raw, int(rec["bytes"]), header_bytes=head)

    def check_header(self, path: str, text: str, file_size: int) -> CorruptChunkError | None:
        """``None`` when ``path`` holds a chunk of ``text`` this reader accepts (its header tag
        verifies; the payload is checked when it is read), else why not. Chunks of another
        layout are accepted: another model's, never asked for by this one, left to eviction."""
        try:
            f, _ = open_regular(path)
            if f is None:
                return CorruptChunkError(f"{path} is not a regular file")
            with f:
                header = _read_header(f, text, self.chunk_format.with_layout(None))
        except CorruptChunkError as exc:
            return exc
        except OSError as exc:
            return CorruptChunkError(f"{path} cannot be read: {exc.strerror}")
        if file_size < header.header_size + header.payload_len:
            return CorruptChunkError(f"{path} is shorter than its header says")
        return None

    def scan(self) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """``(key text or "", entry)`` for every file under the 2-hex directories; temp
        files and foreign names come with ``""``."""
        for sub in os.scandir(self.root):
            if not (sub.is_dir() and len(sub.name) == 2):
                continue
            for f in os.scandir(sub.path):
                text = f.name[: -len(SUFFIX)] if f.name.endswith(SUFFIX) else ""
                yield text, f

    # ---- writes -----------------------------------------------------------------------

    def write_tmp(self, text: str, head: bytes, body: serde.Buffer, cls: str = "store") -> tuple[str, int]:
        """Write a durable temp file beside ``text``'s final name: ``(temp path, size)``;
        ``cls``: the write's lifetime class (placement hints, the trace)."""
        tmp = f"{self.path(text)}.{os.getpid()}.{next(self._tmp_seq)}{TMP_SUFFIX}"
        direct = self.o_direct
        try:
            return tmp, self._write(tmp, text, head, body, direct, cls)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if not (direct and exc.errno == errno.EINVAL):
                raise
            msg = f"O_DIRECT refused under {self.root} ({exc}); the disk tier falls back to buffered I/O"
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            self.o_direct = False
            return self.write_tmp(text, head, body, cls)

    def _write(self, tmp: str, text: str, head: bytes, body: serde.Buffer, direct: bool, cls: str) -> int:
        n = len(head) + memoryview(body).nbytes
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # a 2-hex subdirectory not made yet (or removed by hand)
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            sync_dir(self.root)  # the new subdirectory's entry must survive a crash too
            fd = os.open(tmp, flags, 0o644)
        try:
            self.placement.apply(fd, cls)
            with self.traced("write", text) as rec:
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
                    _write_all(fd, mv[:size])
                else:
                    size = n
                    _write_all(fd, memoryview(head))
                    _write_started(fd, memoryview(body).cast("B"), len(head))
                rec["bytes"] = size
                if self._trace is not None:  # the LBAs the filesystem gave the file
                    rec["extents"] = fiemap(fd)
            stamp = self.stamp()
            os.utime(fd, ns=(stamp, stamp))
            with self.traced("fsync", text):
                os.fsync(fd)
        finally:
            os.close(fd)
        return size

    def sync_dir(self, text: str) -> None:
        """fsync the directory holding ``text``'s file, so its last rename survives a crash."""
        with self.traced("fsync_dir", text):
            sync_dir(os.path.dirname(self.path(text)))

    def unlink(self, text: str, size: int) -> None:
        with self.traced("delete", text) as rec, contextlib.suppress(FileNotFoundError):
            if self._trace is not None:  # a delete is a trim of the file's extents
                rec["extents"] = fiemap_path(self.path(text))
            os.unlink(self.path(text))
            rec["bytes"] = size

    def _aligned(self, size: int) -> memoryview:
        mv: memoryview | None = getattr(self._local, "buf", None)
        if mv is None or mv.nbytes < size:
            mv = self._local.buf = memoryview(mmap.mmap(-1, max(size, 1 << 20)))
        return mv

    # ---- the I/O trace ----------------------------------------------------------------

    @contextlib.contextmanager
    def traced(self, op: str, text: str) -> Iterator[dict[str, Any]]:
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

    def close(self) -> None:
        self._io.shutdown(wait=False)
        with self._trace_lock:
            if self._trace is not None:
                self._trace.close()
                self._trace = None


def _header_bytes(f: BinaryIO, fmt: ChunkFormat) -> bytes:
    prefix = f.read(serde.PREFIX_SIZE)
    return prefix + f.read(fmt.header_length(prefix) - len(prefix))


def _read_header(f: BinaryIO, key: ChunkKey | str, fmt: ChunkFormat) -> serde.ChunkHeader:
    return fmt.decode_header(_header_bytes(f, fmt), key)


def _write_all(fd: int, mv: memoryview) -> None:
    while mv.nbytes:
        mv = mv[os.write(fd, mv) :]


def _write_started(fd: int, mv: memoryview, at: int) -> None:
    """:func:`_write_all` of ``mv`` (at file offset ``at``) in pieces whose writeback is
    started as each is written: the device writes one while the next is copied in, and the
    file's fsync waits only for the rest (a chunk of tens of MiB was all still dirty at its
    fsync). A chunk of one piece or less is written as it is."""
    for start in range(0, mv.nbytes, WRITEBACK_PIECE):
        piece = mv[start : start + WRITEBACK_PIECE]
        _write_all(fd, piece)
        if start + WRITEBACK_PIECE < mv.nbytes:  # a full piece, and not the last
            start_writeback(fd, at + start, WRITEBACK_PIECE)


def sync_dir(path: str) -> None:
    """fsync a directory. Some filesystems refuse it; durability is then theirs to give."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
