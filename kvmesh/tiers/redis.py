"""Redis / Valkey tier: ``redis://``, ``rediss://``, ``unix://``, ``valkey://``, and
``redis-sentinel://h:p,h:p[/db]?service_name=NAME`` (the master a set of Redis Sentinels
names, followed across failovers; :func:`kvmesh.tiers.redis_wire.sentinel_client`).

Storage layout. Every chunk is **one Redis hash** named by the chunk key (``kvm2-...``):

* field ``h`` — the serde header (key, layout, tokens, codec, payload checksum or MAC);
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

Failures. Every operation runs under :class:`~kvmesh.tiers.breaker.RemoteGuard`: one
deadline (``options.timeout_s``, the config's ``remote_timeout_s``) bounds the whole
operation, retries included, and the client caps each socket wait at the time left; the
first timeout opens the circuit breaker, fast failures (refused, reset) open it after
``failure_threshold`` consecutive attempts. While it is open ``contains``/``get`` answer
misses and ``put`` answers ``False`` at once, without touching the network, until a daemon
thread's ``PING`` (every ``probe_interval_s``, at most 1 s each) succeeds. Nothing raised
by redis-py leaves a method: failures become misses / ``False`` plus the ``errors`` metric.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import redis

from kvmesh.config_lmcache import redact_url
from kvmesh.core import serde
from kvmesh.core.keys import ChunkKey
from kvmesh.core.saylimit import SayLimit, held_back
from kvmesh.core.serde import Buffer
from kvmesh.errors import CorruptChunkError
from kvmesh.tiers.base import (
    ChunkData,
    Feature,
    Into,
    StoredChunk,
    TierOptions,
    count_rejected,
    counted_read,
    register_tier,
)
from kvmesh.tiers.breaker import RemoteGuard
from kvmesh.tiers.redis_wire import (
    DEFAULT_MAX_REPLY_BYTES,
    HEADER,
    NPARTS,
    decode,
    each_hash,
    fields,
    groups,
    make_client,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
# Chunks of every key version (kvm1-: the xxh3 chain, never read now): clear() removes both.
KEY_PATTERN = "kvm[0-9]-*"
# One MULTI carries at most this much payload: a transaction blocks the server while it
# executes and its queued arguments sit in server memory until EXEC.
_TXN_BYTES = 64 << 20
_SCAN_BATCH = 1000
PROBE_REPLY_BYTES = 1 << 16  # a PING's answer is +PONG
PROBE_TIMEOUT_S = 1.0
# Redis's OOM error reply, as redis-py raises it (the types-redis stubs predate it).
_OOM: type[Exception] = redis.exceptions.OutOfMemoryError  # type: ignore[attr-defined]


class RedisTier:
    """A remote tier shared by every replica; see the module docstring for the layout."""

    features = Feature.RECODE  # no pins: a shared tier's chunks belong to every replica

    @staticmethod
    def max_reply_bytes(options: TierOptions) -> int:
        """The most one reply may take on the wire: the largest chunk of the layout in hash
        fields (a chunk read is one ``HGETALL``), or :data:`DEFAULT_MAX_REPLY_BYTES` where the
        layout is not known. A hostile server's endless reply is cut there."""
        most = options.chunk_format.max_stored(options.chunk_size)
        if most is None:
            return DEFAULT_MAX_REPLY_BYTES
        n_fields = most // max(1, options.part_bytes) + 3  # header, part count, parts
        return most + 64 * n_fields  # RESP framing: a field's length lines, well under 64 bytes

    def __init__(self, url: str, options: TierOptions, failure_threshold: int = 3) -> None:
        self.name = options.name or "redis"
        self.metrics = options.metrics
        self.codec = serde.get_codec(options.codec).name  # fails fast on an unknown codec
        self.chunk_format = options.chunk_format
        self.url = redact_url(url)  # logs and metrics never carry the password
        self.part_bytes = max(1, options.part_bytes)
        self.ttl_ms = int(options.ttl_s * 1000) if options.ttl_s else None
        self._client = make_client(url, options.timeout_s, self.max_reply_bytes(options))
        # Probes use their own short-timeout client so that a black-holed host delays
        # neither construction nor the probe loop by the full operation budget.
        self._probe_client = make_client(url, min(options.timeout_s, PROBE_TIMEOUT_S), PROBE_REPLY_BYTES)
        self.guard = RemoteGuard(
            self.name,
            self.url,
            self.metrics,
            ping=lambda: bool(self._probe_client.ping()),
            timeout_s=options.timeout_s,
            retries=options.retries,
            failure_threshold=failure_threshold,
            probe_interval_s=options.probe_interval_s,
            timeout_errors=(redis.TimeoutError, TimeoutError),
            conn_errors=(redis.ConnectionError, OSError),
            server_errors=(redis.RedisError,),
            auth_errors=(redis.AuthenticationError,),
        )
        self.guard.start()
        self._say = SayLimit()  # a refused store's reason: said once, then at most every 5 minutes

    @property
    def probe_interval_s(self) -> float:
        return self.guard.probe_interval_s

    def _guard(self, op: Callable[[], T]) -> T | None:
        return self.guard.guard(op)

    def _note_error(self, exc: BaseException) -> None:
        self.guard.note_error(exc)

    # ---- the Tier protocol ------------------------------------------------------------

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []

        def op() -> list[Any]:
            # The header, not the hash: a write cut off before its header (a timeout, a
            # killed or stopped server) leaves parts that every read takes for a miss; an
            # EXISTS would find them, and every lookup would offer a load that fails.
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.hexists(k.text, HEADER)
            return pipe.execute(raise_on_error=False)

        replies = self._guard(op)
        if replies is None:
            return [False] * len(keys)
        return [r is True or r == 1 for r in replies]  # an error reply (WRONGTYPE): a miss

    def get(self, keys: Sequence[ChunkKey], into: Into | None = None) -> list[ChunkData | None]:
        found = self._read(keys, into)
        out: list[ChunkData | None] = []
        for k, item in zip(keys, found, strict=True):
            out.append(counted_read(self.metrics, k, item))
        return out

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[ChunkData]) -> list[bool]:
        if len(keys) != len(chunks):
            raise ValueError(f"put got {len(keys)} keys but {len(chunks)} chunks; pass one chunk per key")
        if not self.guard.up:
            self.metrics.skip("tier_down", len(keys))  # before encoding: down costs nothing
            return [False] * len(keys)
        # Encoded a transaction's worth at a time (raw sizes bound it): a compressed or sealed
        # payload is new memory, and a batch of them at once would all be alive together.
        encode = self.chunk_format.encode
        results: list[bool] = []
        for start, end in groups([memoryview(c.data).nbytes for c in chunks], _TXN_BYTES):
            some = zip(keys[start:end], chunks[start:end], strict=True)
            encoded = [encode(k, c.layout, c.tokens, c.data, self.codec) for k, c in some]
            results.extend(self._store(keys[start:end], encoded))
            # Dropped before the next group is encoded: sealed payloads go back to the codec
            # buffers' recycler and the next group's reuse their pages (kept in ``encoded``,
            # two groups were alive at once and half of every put's buffers were fresh).
            del encoded
        return results

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        n = self._guard(lambda: int(self._client.unlink(*[k.text for k in keys])))
        self.metrics.inc("deletes", n or 0)
        return n or 0

    def clear(self) -> int:
        """Delete every kvmesh chunk (keys matching ``kvm<digit>-*``); other keys are left alone."""

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
        if not self.guard.up:
            return
        try:
            for name in self._client.scan_iter(match=KEY_PATTERN, count=_SCAN_BATCH):
                yield name.decode()
        except (redis.RedisError, OSError) as exc:
            self._note_error(exc)

    def read_stored(self, keys: Sequence[ChunkKey]) -> list[StoredChunk | None]:
        return self._read(keys)

    def rewrite(self, key: ChunkKey, head: bytes, body: Buffer, version: int | None) -> int | None:
        """Replace ``key``'s hash as a whole, in one ``MULTI`` so no reader sees it half
        replaced (``version`` is unused: every writer of a key writes the same chunk)."""
        if not self._store([key], [(head, body)], atomic=True)[0]:
            return None
        return len(head) + memoryview(body).nbytes

    def health(self) -> str:
        return self.guard.health()

    def close(self) -> None:
        if self.guard.closed:
            return
        self.guard.close()
        for client in (self._client, self._probe_client):
            with contextlib.suppress(redis.RedisError, OSError):
                client.close()

    # ---- reads and writes -------------------------------------------------------------

    def _read(self, keys: Sequence[ChunkKey], into: Into | None = None) -> list[StoredChunk | None]:
        """Verified ``(header, raw KV, stored bytes)`` per key; ``None`` for a miss. Each
        chunk is decoded (its parts copied out) as its reply arrives (:func:`each_hash`)."""
        if not keys:
            return []
        corrupt: list[ChunkKey] = []

        def take(i: int, reply: dict[bytes, bytes] | Exception) -> StoredChunk | None:
            k = keys[i]
            if isinstance(reply, redis.ResponseError) and "WRONGTYPE" in str(reply):
                corrupt.append(k)  # something else sits under a kvmesh key name
                self.metrics.inc("corrupt")
                return None
            if isinstance(reply, Exception):
                self._note_error(reply)
                return None
            if HEADER not in reply:
                return None  # absent, or a writer is still adding its parts
            try:
                return decode(k, reply, self.chunk_format, into)
            except CorruptChunkError as exc:
                if count_rejected(self.metrics, exc):
                    log.warning("kvmesh tier %s: dropping bad chunk %s: %s", self.name, k.text, exc)
                    corrupt.append(k)
                return None

        def op() -> list[StoredChunk | None]:
            corrupt.clear()  # a retried batch starts over
            return each_hash(self._client, [k.text for k in keys], take)

        found = self._guard(op)
        if found is None:
            return [None] * len(keys)
        if corrupt:
            # A writer may have replaced a bad chunk since we read it; deleting its good
            # value then costs one miss, never wrong data, so no WATCH round trip for it.
            self._guard(lambda: self._client.unlink(*[k.text for k in corrupt]))
        return found

    def _store(
        self, keys: Sequence[ChunkKey], encoded: Sequence[tuple[bytes, Buffer]], atomic: bool = False
    ) -> list[bool]:
        results: list[bool] = []
        for start, end in groups([memoryview(body).nbytes for _, body in encoded], _TXN_BYTES):
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
                parts = fields(head, body, self.part_bytes)
                meta = {HEADER: parts.pop(HEADER), NPARTS: parts.pop(NPARTS)}
                pipe.unlink(k.text)
                for name, part in parts.items():
                    pipe.hset(k.text, name, part)  # type: ignore[arg-type]
                pipe.hset(k.text, mapping=meta)  # type: ignore[arg-type]
                if self.ttl_ms:
                    pipe.pexpire(k.text, self.ttl_ms)
                counts.append(len(parts) + 2 + (1 if self.ttl_ms else 0))
            return pipe.execute(raise_on_error=False)

        replies = self._guard(op)
        if replies is None:
            self.metrics.skip("tier_error", len(keys))
            return [False] * len(keys)
        out: list[bool] = []
        refused: list[str] = []
        pos = 0
        for k, (head, body), n in zip(keys, encoded, counts, strict=True):
            errs = [r for r in replies[pos : pos + n] if isinstance(r, Exception)]
            pos += n
            if errs:
                self._refused(errs[0])
                refused.append(k.text)
                out.append(False)
            else:
                self.metrics.inc("stores")
                self.metrics.inc("bytes_in", len(head) + memoryview(body).nbytes)
                out.append(True)
        if refused:
            # What went in of a refused chunk goes: a full Redis refuses a 1 MiB part, then
            # takes the small header after it, and that header would offer every lookup a
            # chunk with holes (one UNLINK per key: a cluster refuses keys of two slots).
            self._guard(lambda: _unlink_each(self._client, refused))
        return out

    def _refused(self, exc: Exception) -> None:
        """Count a chunk whose write Redis refused, with the reason, and say why in the log
        (once per reason, then at most every 5 minutes: a full Redis refuses every
        store, and nothing else tells its operator)."""
        self._note_error(exc)
        reason, advice = _refusal(exc)
        self.metrics.skip(reason)
        held = self._say.due(reason)
        if held is None:
            return
        said, more = str(exc).rstrip(". "), held_back(held)
        log.warning("kvmesh tier %s: Redis refused a store%s: %s. %s", self.name, more, said, advice)


def _refusal(exc: Exception) -> tuple[str, str]:
    """``(skip reason, what to do)`` for a write Redis answered with an error."""
    if isinstance(exc, _OOM):
        return "full", (
            "Its memory is full (maxmemory) and its maxmemory-policy evicts nothing: let it evict "
            "old chunks (maxmemory-policy allkeys-lru, or volatile-lru with a ttl) or give it more memory"
        )
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return "read_only", "remote_url names a read-only replica: name the primary, or its Sentinels"
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return "no_permission", "the user remote_url logs in as may not write kvmesh's keys (ACL)"
    return "tier_error", "Stores are skipped until it takes them again"


def _unlink_each(client: Any, names: Sequence[str]) -> None:
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.unlink(name)
    pipe.execute(raise_on_error=False)


@register_tier("redis", "rediss", "unix", "valkey", "redis-sentinel")
def _open_redis(url: str, options: TierOptions) -> RedisTier:
    return RedisTier(url, options)
