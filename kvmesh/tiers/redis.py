"""Redis / Valkey tier: ``redis://``, ``rediss://``, ``unix://``, ``valkey://``.

Storage layout. Every chunk is **one Redis hash** named by the chunk key (``kvm1-...``):

* field ``h`` — the serde header (key, layout, tokens, codec, payload checksum);
* field ``n`` — number of payload parts, ASCII;
* fields ``0`` .. ``n-1`` — the encoded payload cut into parts of at most ``part_bytes``.

Why a hash and not ``<key>`` + ``<key>:<i>`` string keys: a chunk is then a single Redis
object: it is replaced as a whole (UNLINK, the parts, then the header last, so a reader
without a header sees a miss; ``recode`` wraps this in ``MULTI``), expires in one
piece, is evicted in one piece under ``maxmemory-policy allkeys-lru`` (separate part keys
would be evicted one by one and leave chunks with holes), lives in one cluster slot, and is
read in one round trip (a pipeline of ``HGETALL``). Parts still matter: the Python client,
not the server, is the bottleneck for large values, and it sends a ``memoryview`` part
without copying it and parses 1 MiB replies far faster than one 32 MiB reply.

Failures. Connection errors and timeouts are retried with jittered exponential backoff
(``options.retries``); after ``failure_threshold`` consecutive failed attempts a circuit
breaker marks the tier down: ``contains``/``get`` answer misses and ``put`` answers
``False`` at once, without touching the network, until a daemon thread's ``PING`` (every
``probe_interval_s``) succeeds. Nothing raised by redis-py leaves a method: failures become
misses / ``False`` plus the ``errors`` metric (the engine would turn a ``TierError`` into a
miss anyway, and swallowing here spares every caller the ``try``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis
from redis.backoff import EqualJitterBackoff, NoBackoff
from redis.retry import Retry

from kvmesh.core import serde
from kvmesh.core.keys import ChunkKey
from kvmesh.core.serde import Buffer, ChunkHeader
from kvmesh.errors import ConfigError, CorruptChunkError, TierError, TierUnavailableError
from kvmesh.tiers.base import ChunkData, Into, TierOptions, counted_read, payload_buffer, register_tier

log = logging.getLogger(__name__)

T = TypeVar("T")
KEY_PATTERN = "kvm1-*"
_HEADER = b"h"
_NPARTS = b"n"
# Errors that mean "Redis cannot be reached": they feed the breaker. Anything else redis-py
# raises (a WRONGTYPE reply, OOM) is the server answering, so it must not trip it.
_CONN_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
# One MULTI carries at most this much payload: a transaction blocks the server while it
# executes and its queued arguments sit in server memory until EXEC.
_TXN_BYTES = 64 << 20
_SCAN_BATCH = 1000


class RedisTier:
    """A remote tier shared by every replica; see the module docstring for the layout."""

    def __init__(self, url: str, options: TierOptions, failure_threshold: int = 3) -> None:
        self.name = options.name or "redis"
        self.metrics = options.metrics
        self.codec = serde.get_codec(options.codec).name  # fails fast on an unknown codec
        self.url = url
        self.part_bytes = max(1, options.part_bytes)
        self.ttl_ms = int(options.ttl_s * 1000) if options.ttl_s else None
        self.retries = max(0, options.retries)
        self.failure_threshold = max(1, failure_threshold)
        self.probe_interval_s = options.probe_interval_s
        self._backoff = EqualJitterBackoff(cap=0.5, base=0.02)  # jitter: replicas don't retry in step
        self._client = _make_client(url, options.timeout_s)
        # Probes use their own short-timeout client so that a black-holed host delays
        # neither construction nor the probe loop by the full operation timeout.
        self._probe_client = _make_client(url, min(options.timeout_s, 1.0))
        self._lock = threading.Lock()
        self._failures = 0
        self._up = threading.Event()
        self._closed = threading.Event()
        if self._ping():
            self._mark_up()
        else:
            # Unreachable at start is not an error: the tier starts down and the probe
            # thread brings it up when Redis answers.
            log.warning("kvmesh tier %s: %s unreachable at start; starting down", self.name, url)
            self.metrics.set("up", 0)
        self._probe = threading.Thread(target=self._probe_loop, name=f"kvmesh-probe-{self.name}", daemon=True)
        self._probe.start()

    # ---- the Tier protocol ------------------------------------------------------------

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []

        def op() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k.text)
            return pipe.execute()

        replies = self._guard(op)
        if replies is None:
            return [False] * len(keys)
        return [r == 1 for r in replies]

    def get(self, keys: Sequence[ChunkKey], into: Into | None = None) -> list[ChunkData | None]:
        found = self._read(keys, into)
        out: list[ChunkData | None] = []
        for k, item in zip(keys, found, strict=True):
            out.append(counted_read(self.metrics, k, item))
        return out

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[ChunkData]) -> list[bool]:
        if len(keys) != len(chunks):
            raise ValueError(f"put got {len(keys)} keys but {len(chunks)} chunks; pass one chunk per key")
        if not self._up.is_set() or self._closed.is_set():
            self.metrics.inc("skipped_stores", len(keys))  # before encoding: down costs nothing
            return [False] * len(keys)
        encoded = [
            serde.encode(k, c.layout, c.tokens, c.data, self.codec) for k, c in zip(keys, chunks, strict=True)
        ]
        return self._store(keys, encoded)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        n = self._guard(lambda: int(self._client.unlink(*[k.text for k in keys])))
        self.metrics.inc("deletes", n or 0)
        return n or 0

    def clear(self) -> int:
        """Delete every kvmesh chunk (keys matching ``kvm1-*``); other keys are left alone."""

        def op() -> int:
            removed = 0
            batch: list[bytes] = []
            for name in self._client.scan_iter(match=KEY_PATTERN, count=_SCAN_BATCH):
                batch.append(name)
                if len(batch) >= _SCAN_BATCH:
                    removed += int(self._client.unlink(*batch))
                    batch = []
            if batch:
                removed += int(self._client.unlink(*batch))
            return removed

        n = self._guard(op) or 0
        self.metrics.inc("deletes", n)
        return n

    def keys(self) -> Iterator[str]:
        """Key texts of the chunks stored (a snapshot-ish SCAN; may miss concurrent writes)."""
        if not self._up.is_set() or self._closed.is_set():
            return
        try:
            for name in self._client.scan_iter(match=KEY_PATTERN, count=_SCAN_BATCH):
                yield name.decode()
        except (redis.RedisError, OSError) as exc:
            self._note_error(exc)

    def recode(self, keys: Sequence[ChunkKey], codec: str) -> tuple[int, int]:
        """Re-store ``keys`` with ``codec``. Returns stored bytes before and after, summed
        over the keys found (keys already in ``codec`` count the same on both sides)."""
        codec = serde.get_codec(codec).name
        before = after = 0
        for k, item in zip(keys, self._read(keys), strict=True):
            if item is None:
                continue
            header, raw, stored = item
            before += stored
            if header.codec == codec:
                after += stored
                continue
            head, body = serde.encode(k, header.layout, header.tokens, raw, codec)
            if self._store([k], [(head, body)], atomic=True)[0]:
                after += len(head) + memoryview(body).nbytes
            else:
                after += stored
        return before, after

    def health(self) -> str:
        if self._closed.is_set() or not self._up.is_set():
            return "down"
        return "degraded" if self._failures else "up"

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._probe.join(timeout=max(2.0, self.probe_interval_s + 1.0))
        for client in (self._client, self._probe_client):
            with contextlib.suppress(redis.RedisError, OSError):
                client.close()

    # ---- reads and writes -------------------------------------------------------------

    def _read(
        self, keys: Sequence[ChunkKey], into: Into | None = None
    ) -> list[tuple[ChunkHeader, Buffer, int] | None]:
        """Verified ``(header, raw KV, stored bytes)`` per key; ``None`` for a miss."""
        if not keys:
            return []

        def op() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k.text)
            return pipe.execute(raise_on_error=False)

        replies = self._guard(op)
        if replies is None:
            return [None] * len(keys)
        out: list[tuple[ChunkHeader, Buffer, int] | None] = []
        corrupt: list[ChunkKey] = []
        for k, reply in zip(keys, replies, strict=True):
            if isinstance(reply, redis.ResponseError) and "WRONGTYPE" in str(reply):
                corrupt.append(k)  # something else sits under a kvmesh key name
                out.append(None)
            elif isinstance(reply, Exception):
                self._note_error(reply)
                out.append(None)
            elif not reply or _HEADER not in reply:
                out.append(None)  # absent, or a writer is still adding its parts
            else:
                try:
                    out.append(_decode(k, reply, into))
                except CorruptChunkError as exc:
                    log.warning("kvmesh tier %s: dropping corrupt chunk %s: %s", self.name, k.text, exc)
                    corrupt.append(k)
                    out.append(None)
        if corrupt:
            self.metrics.inc("corrupt", len(corrupt))
            # A writer may have replaced a bad chunk since we read it; deleting its good
            # value then costs one miss, never wrong data, so no WATCH round trip for it.
            self._guard(lambda: self._client.unlink(*[k.text for k in corrupt]))
        return out

    def _store(
        self, keys: Sequence[ChunkKey], encoded: Sequence[tuple[bytes, Buffer]], atomic: bool = False
    ) -> list[bool]:
        results: list[bool] = []
        for start, end in _groups([memoryview(body).nbytes for _, body in encoded], _TXN_BYTES):
            results.extend(self._write_group(keys[start:end], encoded[start:end], atomic))
        return results

    def _write_group(
        self, keys: Sequence[ChunkKey], encoded: Sequence[tuple[bytes, Buffer]], atomic: bool = False
    ) -> list[bool]:
        counts: list[int] = []

        def op() -> list[Any]:
            # Plain pipeline by default: a chunk key names its content, so two writers of
            # one key write the same bytes, and MULTI (which makes Redis hold every queued
            # byte until EXEC) halves write throughput here. Parts go first, the header
            # last: a reader that finds no header sees a miss, never a half-written chunk.
            # ``recode`` replaces content under the same key, so it uses MULTI.
            pipe = self._client.pipeline(transaction=atomic)
            counts.clear()
            for k, (head, body) in zip(keys, encoded, strict=True):
                fields = self._fields(head, body)
                meta = {_HEADER: fields.pop(_HEADER), _NPARTS: fields.pop(_NPARTS)}
                pipe.unlink(k.text)
                for name, part in fields.items():
                    pipe.hset(k.text, name, part)  # type: ignore[arg-type]
                pipe.hset(k.text, mapping=meta)  # type: ignore[arg-type]
                if self.ttl_ms:
                    pipe.pexpire(k.text, self.ttl_ms)
                counts.append(len(fields) + 2 + (1 if self.ttl_ms else 0))
            return pipe.execute(raise_on_error=False)

        replies = self._guard(op)
        if replies is None:
            self.metrics.inc("skipped_stores", len(keys))
            return [False] * len(keys)
        out: list[bool] = []
        pos = 0
        for (head, body), n in zip(encoded, counts, strict=True):
            errs = [r for r in replies[pos : pos + n] if isinstance(r, Exception)]
            pos += n
            if errs:
                self._note_error(errs[0])
                self.metrics.inc("skipped_stores")
                out.append(False)
            else:
                self.metrics.inc("stores")
                self.metrics.inc("bytes_in", len(head) + memoryview(body).nbytes)
                out.append(True)
        return out

    def _fields(self, head: bytes, body: Buffer) -> dict[bytes, Buffer]:
        # memoryview slices: redis-py writes them to the socket as they are, no copy.
        mv = memoryview(body).cast("B")
        pb = self.part_bytes
        n = (mv.nbytes + pb - 1) // pb
        fields: dict[bytes, Buffer] = {_HEADER: head, _NPARTS: str(n).encode()}
        for i in range(n):
            fields[str(i).encode()] = mv[i * pb : (i + 1) * pb]
        return fields

    # ---- retries and the circuit breaker ----------------------------------------------

    def _guard(self, op: Callable[[], T]) -> T | None:
        """Run ``op`` with retries; ``None`` when it could not run (down, closed, error)."""
        try:
            return self._run(op)
        except TierError:
            return None

    def _run(self, op: Callable[[], T]) -> T:
        if self._closed.is_set():
            raise TierUnavailableError(f"tier {self.name} is closed")
        if not self._up.is_set():
            raise TierUnavailableError(f"tier {self.name}: {self.url} is down; waiting for it to answer PING")
        attempt = 0
        while True:
            try:
                result = op()
            except _CONN_ERRORS as exc:
                self.metrics.inc("errors")
                tripped = self._record_failure(exc)
                if tripped or attempt >= self.retries:
                    raise TierUnavailableError(f"tier {self.name}: {self.url} unreachable: {exc}") from None
                attempt += 1
                time.sleep(self._backoff.compute(attempt))
            except redis.RedisError as exc:
                self._note_error(exc)
                raise TierError(f"tier {self.name}: {exc}") from None
            else:
                with self._lock:
                    self._failures = 0
                return result

    def _record_failure(self, exc: BaseException) -> bool:
        """Count one failed attempt; True when the breaker is (now) open."""
        with self._lock:
            self._failures += 1
            if self._failures < self.failure_threshold and self._up.is_set():
                return False
            if self._up.is_set():
                self._up.clear()
                self.metrics.set("up", 0)
                log.warning(
                    "kvmesh tier %s: %d consecutive failures (%s); marking down, probing every %.1fs",
                    self.name,
                    self._failures,
                    exc,
                    self.probe_interval_s,
                )
            return True

    def _mark_up(self) -> None:
        with self._lock:
            self._failures = 0
            self._up.set()
        self.metrics.set("up", 1)

    def _note_error(self, exc: BaseException) -> None:
        self.metrics.inc("errors")
        log.debug("kvmesh tier %s: %s", self.name, exc)

    def _ping(self) -> bool:
        try:
            return bool(self._probe_client.ping())
        except (redis.RedisError, OSError):
            return False

    def _probe_loop(self) -> None:
        while not self._closed.wait(self.probe_interval_s):
            if not self._up.is_set() and self._ping():
                log.warning("kvmesh tier %s: %s answers again; marking up", self.name, self.url)
                self._mark_up()


def _decode(
    key: ChunkKey, fields: dict[bytes, bytes], into: Into | None = None
) -> tuple[ChunkHeader, Buffer, int]:
    head = fields.get(_HEADER)
    if head is None:
        raise CorruptChunkError("chunk hash has no header field")
    header = serde.decode_header(head, expected_key=key.text)
    try:
        n = int(fields.get(_NPARTS, b""))
    except ValueError:
        raise CorruptChunkError("chunk hash has no valid part count") from None
    parts = [fields.get(str(i).encode()) for i in range(n)]
    if any(p is None for p in parts):
        raise CorruptChunkError(f"chunk is missing parts (has {sum(p is not None for p in parts)} of {n})")
    sizes = sum(len(p) for p in parts if p is not None)
    if sizes != header.payload_len:
        raise CorruptChunkError(f"chunk parts hold {sizes} bytes, header says {header.payload_len}")
    body: Buffer
    if n == 1 and parts[0] is not None and into is None:
        body = parts[0]  # no assembly copy for a value that fits one part
    else:
        # One copy of every part into the caller's buffer (or one of ours); numpy copies at
        # memcpy speed where memoryview slice assignment runs ~6x slower here.
        body = payload_buffer(into, header.payload_len, header.codec)
        out = np.frombuffer(body, dtype=np.uint8)
        pos = 0
        for p in parts:
            if p is not None:
                out[pos : pos + len(p)] = np.frombuffer(p, dtype=np.uint8)
                pos += len(p)
    raw = serde.decode_payload(header, body)
    return header, raw, len(head) + header.payload_len


def _groups(sizes: Sequence[int], limit: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` runs of consecutive items whose sizes sum to at most ``limit``
    (an item larger than ``limit`` forms a run of its own)."""
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > limit:
            yield start, i
            start, total = i, 0
        total += size
    if start < len(sizes):
        yield start, len(sizes)


def _make_client(url: str, timeout_s: float) -> redis.Redis[bytes]:
    parts = urlsplit(url)
    if parts.scheme == "valkey":  # same protocol; redis-py knows only redis/rediss/unix
        url = urlunsplit(parts._replace(scheme="redis"))
    # redis-py's own retries are off: the tier retries whole batches and counts every
    # failed attempt towards the breaker, which hidden retries inside redis-py would blur.
    try:
        return redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
    except ValueError as exc:
        raise ConfigError(
            f"invalid Redis URL {url!r} ({exc}); write redis://[user:pass@]host:port/db, "
            "rediss://..., valkey://host:port/db or unix:///path/to.sock"
        ) from None


@register_tier("redis", "rediss", "unix", "valkey")
def _open_redis(url: str, options: TierOptions) -> RedisTier:
    return RedisTier(url, options)
