"""Shared-filesystem tier: ``fs:///path``, a directory many processes and machines use at
once (NFS, CephFS, a local directory shared by the replicas of one host).

One file per chunk, ``<root>/<2 hex>/<key.text>.kvc`` (the 2-hex fan-out keeps directories
small; it is the start of the prefix hash, which is uniform). A file holds one serialized
chunk (:mod:`kvmesh.core.serde`).

Because other processes write and delete at any moment, this tier keeps **no in-memory
index**: ``contains`` asks the filesystem, and readers expect files to vanish or be replaced
between any two calls. Writers never expose a partial file: they write a unique temp file
(``.<key>.<pid>.<random>.tmp``, invisible to readers and to ``keys()``), fsync it and
``os.replace`` it over the final name, which is atomic on POSIX filesystems and on NFS. A
reader that still finds a bad file (bit rot, a foreign tool) treats it as a miss, counts it
in ``corrupt`` (``unauthenticated`` when it fails the fleet key's MAC) and deletes it — only
if the name still points at the file it read, so it never deletes a good file that a
concurrent writer has just put in its place.

Anyone who can write to the directory is untrusted: files open with ``O_NOFOLLOW |
O_NONBLOCK`` and only regular files are read (:func:`~kvmesh.tiers.diskfiles.open_regular`),
so a symlink or a FIFO planted where a chunk should be is a miss, never a read elsewhere or
a read that blocks. Without a fleet key such a writer can still plant well-formed KV, as the
engine's start-up log, its stats and ``/health`` say.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import re
import secrets
import time
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit

from kvmesh.core import serde
from kvmesh.core.keys import ChunkKey
from kvmesh.core.serde import Buffer, ChunkFormat, ChunkHeader
from kvmesh.errors import ConfigError, CorruptChunkError
from kvmesh.tiers.base import (
    ChunkData,
    Feature,
    Into,
    StoredChunk,
    TierOptions,
    count_rejected,
    counted_read,
    payload_buffer,
    register_tier,
)
from kvmesh.tiers.diskfiles import open_regular, sync_dir

log = logging.getLogger(__name__)

SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
# A temp file this old belongs to a writer that died; younger ones may still be renamed.
STALE_TMP_S = 60.0
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class FsTier:
    """Chunks as files in a shared directory; see the module docstring."""

    features = Feature.RECODE  # no pins: other processes delete at will

    def __init__(self, root: str, options: TierOptions) -> None:
        self.name = options.name or "fs"
        self.metrics = options.metrics
        self.codec = serde.get_codec(options.codec).name  # fails fast on an unknown codec
        self.chunk_format = options.chunk_format
        self.root = os.path.abspath(root)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            # A mount that is not there yet is not fatal: the tier reports "down" and every
            # call degrades to a miss until the directory appears.
            log.warning("kvmesh tier %s: cannot create %s (%s); tier is down", self.name, self.root, exc)
        self.metrics.set("up", 1 if self.health() == "up" else 0)

    def path(self, key: ChunkKey) -> str:
        return os.path.join(self.root, key.prefix_hash[:2], key.text + SUFFIX)

    # ---- the Tier protocol ------------------------------------------------------------

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [os.path.exists(self.path(k)) for k in keys]

    def get(self, keys: Sequence[ChunkKey], into: Into | None = None) -> list[ChunkData | None]:
        out: list[ChunkData | None] = []
        for k in keys:
            out.append(counted_read(self.metrics, k, self._read(k, into)))
        return out

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[ChunkData]) -> list[bool]:
        if len(keys) != len(chunks):
            raise ValueError(f"put got {len(keys)} keys but {len(chunks)} chunks; pass one chunk per key")
        results: list[bool] = []
        dirs: set[str] = set()
        for k, c in zip(keys, chunks, strict=True):
            head, body = self.chunk_format.encode(k, c.layout, c.tokens, c.data, self.codec)
            ok = self._write(k, head, body)
            if ok:
                dirs.add(os.path.dirname(self.path(k)))
            results.append(ok)
        for d in dirs:
            sync_dir(d)  # makes the renames durable, once per directory per batch
        return results

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        for k in keys:
            try:
                os.unlink(self.path(k))
                n += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._note_error("delete", exc)
        self.metrics.inc("deletes", n)
        return n

    def clear(self) -> int:
        """Delete every chunk file (and temp files of writers that died); returns chunks
        deleted. Files that are not kvmesh's are left alone."""
        n = 0
        now = time.time()
        for path, name in self._walk():
            try:
                if name.endswith(SUFFIX) and not name.startswith("."):
                    os.unlink(path)
                    n += 1
                elif (
                    name.startswith(".")
                    and name.endswith(TMP_SUFFIX)
                    and now - os.stat(path).st_mtime > STALE_TMP_S
                ):
                    os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._note_error("clear", exc)
        self.metrics.inc("deletes", n)
        return n

    def keys(self) -> Iterator[str]:
        """Key texts of the chunk files present now (temp files are skipped)."""
        for _path, name in self._walk():
            if name.endswith(SUFFIX) and not name.startswith("."):
                yield name[: -len(SUFFIX)]

    def read_stored(self, keys: Sequence[ChunkKey]) -> list[StoredChunk | None]:
        return [self._read(k) for k in keys]

    def rewrite(self, key: ChunkKey, head: bytes, body: Buffer, version: int | None) -> int | None:
        """Replace ``key``'s file as a whole (atomic rename); ``version`` is unused: any
        writer of a key writes the same chunk."""
        if not self._write(key, head, body):
            return None
        sync_dir(os.path.dirname(self.path(key)))
        return len(head) + memoryview(body).nbytes

    def health(self) -> str:
        up = os.path.isdir(self.root) and os.access(self.root, os.W_OK | os.X_OK)
        self.metrics.set("up", 1 if up else 0)
        return "up" if up else "down"

    def close(self) -> None:
        """Nothing to release: no handles are kept between calls."""

    # ---- files --------------------------------------------------------------------------

    def _read(self, key: ChunkKey, into: Into | None = None) -> StoredChunk | None:
        path = self.path(key)
        try:
            f, st = open_regular(path)
            if f is None:
                self._discard_corrupt(path, st, CorruptChunkError("not a regular file"))
                return None
            with f:
                try:
                    header, body = _read_chunk(f, st.st_size, key, self.chunk_format, into)
                    raw = self.chunk_format.decode_payload(header, body, into)
                except CorruptChunkError as exc:
                    self._discard_corrupt(path, st, exc)
                    return None
        except FileNotFoundError:
            return None  # never written, deleted, or evicted by another process
        except OSError as exc:
            self._note_error("read", exc)
            return None
        return StoredChunk(header, raw, st.st_size)

    def _write(self, key: ChunkKey, head: bytes, body: Buffer) -> bool:
        final = self.path(key)
        directory = os.path.dirname(final)
        # pid + random: many processes on many machines may write the same key at once.
        tmp = os.path.join(directory, f".{key.text}.{os.getpid()}.{secrets.token_hex(6)}{TMP_SUFFIX}")
        try:
            try:
                f = open(tmp, "xb")  # noqa: SIM115 - closed by the with below
            except FileNotFoundError:
                os.makedirs(directory, exist_ok=True)
                f = open(tmp, "xb")  # noqa: SIM115
            with f:
                f.write(head)
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if exc.errno in _FULL_ERRNOS:
                self.metrics.skip("full")
            else:
                self._note_error("write", exc)
                self.metrics.skip("io_error")
            return False
        self.metrics.inc("stores")
        self.metrics.inc("bytes_in", len(head) + memoryview(body).nbytes)
        return True

    def _discard_corrupt(self, path: str, st: os.stat_result, exc: CorruptChunkError) -> None:
        if not count_rejected(self.metrics, exc):
            log.debug("kvmesh tier %s: cannot verify %s: %s", self.name, path, exc)
            return
        log.warning("kvmesh tier %s: dropping bad chunk file %s: %s", self.name, path, exc)
        try:
            now = os.lstat(path)  # the link or FIFO itself, never what it points at
            # Another process may have replaced the file since we opened it; only the bad
            # file we actually read is deleted.
            if (now.st_ino, now.st_dev, now.st_mtime_ns) == (st.st_ino, st.st_dev, st.st_mtime_ns):
                os.unlink(path)
        except OSError:
            pass

    def _walk(self) -> Iterator[tuple[str, str]]:
        try:
            subdirs = [e.path for e in os.scandir(self.root) if len(e.name) == 2 and e.is_dir()]
        except OSError as exc:
            self._note_error("scan", exc)
            return
        for d in subdirs:
            try:
                entries = list(os.scandir(d))
            except FileNotFoundError:
                continue
            except OSError as exc:
                self._note_error("scan", exc)
                continue
            for e in entries:
                yield e.path, e.name

    def _note_error(self, op: str, exc: OSError) -> None:
        self.metrics.inc("errors")
        log.debug("kvmesh tier %s: %s failed: %s", self.name, op, exc)


def _read_chunk(
    f: io.FileIO, size: int, key: ChunkKey, fmt: ChunkFormat, into: Into | None = None
) -> tuple[ChunkHeader, memoryview]:
    """Header and stored payload of an open chunk file, verified against ``size``."""
    prefix = _read_exact(f, serde.PREFIX_SIZE)
    hlen = fmt.header_length(prefix)
    if size < hlen:
        raise CorruptChunkError(f"file is {size} bytes, shorter than its {hlen}-byte header")
    header = fmt.decode_header(prefix + _read_exact(f, hlen - serde.PREFIX_SIZE), key)
    if size != header.header_size + header.payload_len:
        raise CorruptChunkError(
            f"file is {size} bytes, header says {header.header_size + header.payload_len}"
        )
    # Read straight into the buffer the caller will own: no intermediate copy.
    body = payload_buffer(into, header)
    view = body
    pos = 0
    while pos < len(body):
        n = f.readinto(view[pos:])
        if not n:
            raise CorruptChunkError(f"file ended after {pos} of {len(body)} payload bytes")
        pos += n
    return header, body


def _read_exact(f: io.FileIO, n: int) -> bytes:
    data = f.read(n)
    while len(data) < n:
        more = f.read(n - len(data))
        if not more:
            raise CorruptChunkError(f"file ended inside the chunk header ({len(data)} < {n} bytes)")
        data += more
    return data


# host:port, [v6]:port or localhost[:port] before an fs:// URL's path
_FS_HOST = re.compile(r"^(?:[^/:@\[\]]+|\[[0-9A-Fa-f:.]+\])(?::\d*)?$")


def fs_root(url: str) -> str:
    """The directory of an ``fs://`` URL: ``fs:///abs/path`` (kvmesh's form). LMCache's legacy
    ``fs://host:port/abs/path`` names ``/abs/path`` on this machine: LMCache's FSConnector
    parses host and port and uses only the path, so kvmesh does the same. A host without a
    port (``fs://dir/sub``) is refused: it used to be read as a relative directory."""
    parts = urlsplit(url)
    host = parts.netloc
    if host and host != "localhost" and (":" not in host or not _FS_HOST.match(host)):
        raise ConfigError(
            f"fs tier URL {url!r}: {host!r} stands where a host goes and the fs tier is a directory; "
            "write fs:///absolute/path (LMCache's fs://host:port/path names /path, host:port unused)"
        )
    if not parts.path.startswith("/"):
        raise ConfigError(f"fs tier URL {url!r} names no absolute directory; write fs:///absolute/path")
    return parts.path


@register_tier("fs")
def _open_fs(url: str, options: TierOptions) -> FsTier:
    root = fs_root(url)
    host = urlsplit(url).netloc
    if host and urlsplit(url).hostname not in ("localhost", "127.0.0.1", "::1"):
        log.warning(
            "kvmesh tier fs: %r in %s is not used (as LMCache's FSConnector does not use it): the "
            "directory is %s on this machine; mount the share there",
            host,
            url,
            root,
        )
    return FsTier(root, options)
