"""RedisTier against a real redis-server (see conftest.py for the fixtures)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvmesh.core.fleetkey import FleetKey
from kvmesh.core.keys import ChunkKey, KeyBuilder, KVLayout
from kvmesh.core.serde import ChunkFormat
from kvmesh.errors import ConfigError
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import ChunkData, TierOptions, open_tier, recode
from kvmesh.tiers.redis import RedisTier
from tests.waiting import eventually

pytestmark = pytest.mark.redis

LAYOUT = KVLayout(2, 2, 8, "float32")
KB = KeyBuilder("m", LAYOUT, chunk_size=16)
# 16 tokens x 16 KiB = 256 KiB per chunk: four 64 KiB parts.
BIG = KVLayout(4, 8, 64, "float32")
KB_BIG = KeyBuilder("m", BIG, chunk_size=16)


def payload(key: ChunkKey, layout: KVLayout) -> bytes:
    """Deterministic per key; small normal floats, so the zstd plane codec compresses them."""
    rng = np.random.default_rng(int(key.prefix_hash[:16], 16))
    n = key.num_tokens * layout.bytes_per_token // 4
    # Values that fit float16 leave the low mantissa bytes zero, as bf16-born KV does.
    return rng.standard_normal(n, dtype=np.float32).astype(np.float16).astype(np.float32).tobytes()


def make_chunks(kb: KeyBuilder, n: int, start: int = 0) -> tuple[list[ChunkKey], list[ChunkData]]:
    tokens = np.arange(start, start + n * kb.chunk_size, dtype=np.uint32)
    keys = kb.keys(tokens)
    chunks = [
        ChunkData(k, kb.layout, tokens[i * kb.chunk_size : (i + 1) * kb.chunk_size], payload(k, kb.layout))
        for i, k in enumerate(keys)
    ]
    return keys, chunks


def assert_same(got: ChunkData | None, want: ChunkData) -> None:
    assert got is not None
    assert got.key == want.key
    assert bytes(got.data) == bytes(want.data)
    assert np.array_equal(got.tokens, want.tokens)
    assert got.layout == want.layout


@pytest.fixture
def open_redis() -> Iterator[Callable[..., RedisTier]]:
    """``open_redis(url, **TierOptions fields)``; every tier opened is closed afterwards."""
    opened: list[RedisTier] = []

    def factory(url: str, **opts: object) -> RedisTier:
        opts.setdefault("probe_interval_s", 0.1)
        opts.setdefault("timeout_s", 1.0)
        tier = open_tier(url, TierOptions(name="remote", metrics=TierMetrics("remote"), **opts))
        assert isinstance(tier, RedisTier)
        opened.append(tier)
        return tier

    yield factory
    for tier in opened:
        tier.close()
        assert tier.guard._probe is None or not tier.guard._probe.is_alive()


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_multipart_round_trip(redis_server, redis_url, open_redis, codec) -> None:
    tier = open_redis(redis_url, codec=codec, part_bytes=64 << 10)
    keys, chunks = make_chunks(KB_BIG, 3)
    assert tier.put(keys, chunks) == [True, True, True]
    got = tier.get(keys)
    for g, c in zip(got, chunks, strict=True):
        assert_same(g, c)
        assert g is not None and g.codec == codec and g.stored_bytes > 0
    client = redis_server.client()
    n_parts = int(client.hget(keys[0].text, "n"))
    assert n_parts > 1  # really multi-part
    assert client.hlen(keys[0].text) == n_parts + 2  # header + count + parts, nothing else
    assert all(len(v) <= 64 << 10 for f, v in client.hgetall(keys[0].text).items() if f.isdigit())
    snap = tier.metrics.snapshot()
    assert snap["hits"] == 3 and snap["stores"] == 3 and snap["errors"] == 0


def test_large_value_default_part_size(redis_server, redis_url, open_redis) -> None:
    kb = KeyBuilder("m", KVLayout(8, 8, 128, "float32"), chunk_size=128)  # 8 MiB per chunk
    tier = open_redis(redis_url)
    keys, chunks = make_chunks(kb, 2)
    assert tier.put(keys, chunks) == [True, True]
    for g, c in zip(tier.get(keys), chunks, strict=True):
        assert_same(g, c)
    assert int(redis_server.client().hget(keys[0].text, "n")) == 8


def test_sealed_stores_reuse_their_buffers(redis_url, open_redis, monkeypatch) -> None:
    """With encrypt_at_rest every stored chunk is sealed into new memory. A put of two
    transactions' worth (16 chunks of 8 MiB) takes its buffers from the recycler once it
    has run before: the first group's go back before the second is encoded, and the
    recycler keeps a whole group's (fresh pages cost more than sealing here)."""
    import kvmesh.core.codecs.base as codecs

    class Counting(codecs._Recycler):
        fresh = 0

        def get(self, nbytes: int) -> memoryview:
            with self._lock:
                reuse = any(nbytes <= b.size <= 2 * nbytes for b in self._free)
            Counting.fresh += not reuse
            return super().get(nbytes)

    monkeypatch.setattr(codecs, "_RECYCLER", Counting(codecs._RECYCLER.limit))
    kb = KeyBuilder("m", KVLayout(8, 8, 128, "float32"), chunk_size=128)  # 8 MiB per chunk
    fmt = ChunkFormat(FleetKey([FleetKey.generate().encode()]), encrypt=True, layout=kb.layout)
    tier = open_redis(redis_url, chunk_format=fmt, timeout_s=10.0)
    keys, chunks = make_chunks(kb, 16)
    assert all(tier.put(keys, chunks))
    first = Counting.fresh
    assert 0 < first <= 8  # one group's worth at most: the second reuses the first's
    assert all(tier.put(keys, chunks))
    assert Counting.fresh == first  # nothing fresh the second time
    assert_same(tier.get(keys[-1:])[0], chunks[-1])


def test_a_new_connection_sends_no_client_setinfo(redis_server, redis_url) -> None:
    """The tier's client opens connections without redis-py's CLIENT SETINFO and
    MAINT_NOTIFICATIONS round trips (QUIET_HANDSHAKE); a default redis-py client sends them."""
    from kvmesh.tiers.redis_wire import make_client

    admin = redis_server.client()

    def setinfos() -> int:
        """CLIENT SETINFO commands the server got: counted as calls where it knows them
        (Redis >= 7.2), as error replies where it does not (Debian 12's 7.0, which does not
        know MAINT_NOTIFICATIONS either)."""
        calls = admin.info("commandstats").get("cmdstat_client|setinfo", {}).get("calls", 0)
        return int(calls) + int(admin.info("stats")["total_error_replies"])

    try:
        before = setinfos()
        client = make_client(redis_url, timeout_s=2.0)
        assert client.ping()
        client.close()
        assert setinfos() == before
        default = redis_server.client()
        assert default.ping()  # a default redis-py client sends them
        default.close()
        assert setinfos() >= before + 2
    finally:
        admin.close()


def test_replies_are_parsed_by_hiredis(redis_url, open_redis) -> None:
    """The tier's connections parse with hiredis (a dependency: redis-py picks it whenever it
    is installed), and a multi-part chunk read through it comes back whole. Its pure-Python
    parser took ~23 ms for a 2,000-token reload's 11.8 MB of replies, hiredis ~6 ms."""
    from redis.utils import HIREDIS_AVAILABLE

    assert HIREDIS_AVAILABLE, "hiredis is a kvmesh dependency: pip install -e ."
    tier = open_redis(redis_url, part_bytes=1000)  # many parts per chunk
    pool = tier._client.connection_pool
    conn = pool.get_connection()
    try:
        from redis._parsers import _HiredisParser

        assert isinstance(conn._parser, _HiredisParser)  # kvmesh's BoundedParser, hiredis's own
    finally:
        pool.release(conn)
    keys, chunks = make_chunks(KB, 3)
    assert tier.put(keys, chunks) == [True] * 3
    for g, c in zip(tier.get(keys), chunks, strict=True):
        assert_same(g, c)


def test_batched_contains_and_get(redis_url, open_redis) -> None:
    tier = open_redis(redis_url)
    keys, chunks = make_chunks(KB, 6)
    assert tier.contains(keys) == [False] * 6
    assert tier.put(keys[::2], chunks[::2]) == [True] * 3
    assert tier.contains(keys) == [True, False] * 3
    got = tier.get(keys)
    for i, (g, c) in enumerate(zip(got, chunks, strict=True)):
        if i % 2:
            assert g is None
        else:
            assert_same(g, c)
    snap = tier.metrics.snapshot()
    assert (snap["hits"], snap["misses"]) == (3, 3)
    assert tier.contains([]) == [] and tier.get([]) == [] and tier.put([], []) == []


def test_a_batch_holds_one_chunk_of_replies_at_a_time(redis_server, redis_url, open_redis) -> None:
    """A batch's chunks are decoded into their slots as each reply arrives: the replies held
    at once are one chunk's parts, not the whole batch's (a pipeline held all of them, 2 MiB
    here; a long prompt from the shared tier, gigabytes). An error reply in the middle of
    the batch (a foreign value) is that key's miss, and the rest of the stream stays in step."""
    import tracemalloc

    tier = open_redis(redis_url, part_bytes=64 << 10)
    keys, chunks = make_chunks(KB_BIG, 8)
    assert tier.put(keys, chunks) == [True] * 8
    redis_server.client().set(keys[3].text, b"not a chunk")
    chunk_bytes = len(chunks[0].data)  # 256 KiB: four parts
    slots = bytearray(9 * chunk_bytes)
    taken = [0]

    def into(nbytes: int) -> memoryview:
        start = taken[0] * chunk_bytes
        taken[0] += 1
        return memoryview(slots)[start : start + nbytes]

    tracemalloc.start()
    try:
        got = tier.get(keys, into=into)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    for i, (g, c) in enumerate(zip(got, chunks, strict=True)):
        if i == 3:
            assert g is None
        else:
            assert_same(g, c)
    assert tier.metrics.snapshot()["corrupt"] == 1
    assert peak < 3 * chunk_bytes, f"{peak} bytes held at once for a batch of {8 * chunk_bytes}"
    # The connection went back to the pool in step: the next batch reads what it asked for.
    assert_same(tier.get(keys[:1])[0], chunks[0])


def test_ttl_is_set(redis_server, redis_url, open_redis) -> None:
    tier = open_redis(redis_url, ttl_s=30, part_bytes=1024)
    keys, chunks = make_chunks(KB, 2)
    assert all(tier.put(keys, chunks))
    client = redis_server.client()
    for k in keys:
        assert 0 < client.pttl(k.text) <= 30_000
    # Without a TTL nothing expires.
    plain = open_redis(redis_url)
    keys2, chunks2 = make_chunks(KB, 1, start=1000)
    assert all(plain.put(keys2, chunks2))
    assert client.ttl(keys2[0].text) == -1


def test_missing_part_is_a_counted_miss(redis_server, redis_url, open_redis) -> None:
    tier = open_redis(redis_url, part_bytes=1024)  # a 4 KiB chunk: four parts
    keys, chunks = make_chunks(KB, 2)
    assert all(tier.put(keys, chunks))
    client = redis_server.client()
    assert client.hdel(keys[0].text, "2") == 1
    got = tier.get(keys)
    assert got[0] is None
    assert_same(got[1], chunks[1])
    assert tier.metrics.snapshot()["corrupt"] == 1
    assert client.exists(keys[0].text) == 0  # dropped, so the next lookup is a clean miss
    assert tier.contains(keys) == [False, True]


def test_chunk_without_header_is_a_write_in_progress_not_corruption(
    redis_server, redis_url, open_redis
) -> None:
    """Parts are written before the header: a reader in between sees a plain miss and
    leaves the writer's parts alone. ``contains`` says so too: a write cut off before its
    header (a timeout, a killed server) must not be found by every lookup and then fail
    every load of it (a soak saw one request come back 5,865 times over such a chunk)."""
    tier = open_redis(redis_url, part_bytes=1024)
    keys, chunks = make_chunks(KB, 1)
    assert all(tier.put(keys, chunks))
    client = redis_server.client()
    header = client.hget(keys[0].text, "h")
    client.hdel(keys[0].text, "h")
    assert tier.contains(keys) == [False]
    assert tier.get(keys) == [None]
    assert tier.metrics.snapshot()["corrupt"] == 0
    assert client.hlen(keys[0].text) > 0  # not deleted
    client.hset(keys[0].text, "h", header)  # the writer finishes
    assert tier.contains(keys) == [True]
    assert_same(tier.get(keys)[0], chunks[0])
    client.hdel(keys[0].text, "h")  # cut off again: the next store writes it whole
    assert all(tier.put(keys, chunks)) and tier.contains(keys) == [True]
    assert_same(tier.get(keys)[0], chunks[0])


@pytest.mark.parametrize("field", ["0", "h"])
def test_flipped_byte_is_a_miss(redis_server, redis_url, open_redis, field) -> None:
    tier = open_redis(redis_url, part_bytes=1024)
    keys, chunks = make_chunks(KB, 1)
    assert all(tier.put(keys, chunks))
    client = redis_server.client()
    value = bytearray(client.hget(keys[0].text, field))
    value[len(value) // 2] ^= 0x01
    client.hset(keys[0].text, field, bytes(value))
    assert tier.get(keys) == [None]
    assert tier.metrics.snapshot()["corrupt"] == 1
    assert client.exists(keys[0].text) == 0


def test_foreign_value_under_a_key_is_a_miss(redis_server, redis_url, open_redis) -> None:
    tier = open_redis(redis_url)
    keys, _ = make_chunks(KB, 1)
    redis_server.client().set(keys[0].text, b"not a chunk")
    assert tier.get(keys) == [None]
    assert tier.metrics.snapshot()["corrupt"] == 1


def test_overwrite_replaces_all_parts(redis_server, redis_url, open_redis) -> None:
    raw = open_redis(redis_url, part_bytes=1024)
    keys, chunks = make_chunks(KB, 1)
    assert all(raw.put(keys, chunks))
    client = redis_server.client()
    assert client.hlen(keys[0].text) == 4 + 2
    before, after = recode(raw, keys, "zstd")
    assert 0 < after < before
    n = int(client.hget(keys[0].text, "n"))
    assert n < 4 and client.hlen(keys[0].text) == n + 2  # old trailing parts are gone
    got = raw.get(keys)[0]
    assert_same(got, chunks[0])
    assert got is not None and got.codec == "zstd"
    assert recode(raw, keys, "zstd") == (after, after)  # already zstd: nothing rewritten


def test_clear_removes_only_kvmesh_keys(redis_server, redis_url, open_redis) -> None:
    client = redis_server.client()
    client.set("unrelated", b"keep me")
    client.set("kvm1", b"keep me too")
    tier = open_redis(redis_url)
    keys, chunks = make_chunks(KB, 5)
    assert all(tier.put(keys, chunks))
    assert sorted(tier.keys()) == sorted(k.text for k in keys)
    assert tier.delete(keys[:2]) == 2
    assert tier.delete(keys[:2]) == 0
    assert tier.clear() == 3
    assert list(tier.keys()) == []
    assert client.get("unrelated") == b"keep me"
    assert client.get("kvm1") == b"keep me too"


def test_valkey_scheme(redis_server, redis_url, open_redis) -> None:
    tier = open_redis(redis_url.replace("redis://", "valkey://"))
    keys, chunks = make_chunks(KB, 1)
    assert tier.put(keys, chunks) == [True]
    assert_same(tier.get(keys)[0], chunks[0])


def test_unix_socket_scheme(redis_server_factory, open_redis) -> None:
    server = redis_server_factory(unix_socket=True)
    server.start()
    tier = open_redis(f"unix://{server.unix_socket}")
    keys, chunks = make_chunks(KB, 2)
    assert tier.put(keys, chunks) == [True, True]
    for g, c in zip(tier.get(keys), chunks, strict=True):
        assert_same(g, c)


def test_full_redis_skips_stores_without_tripping(redis_server, redis_url, open_redis) -> None:
    client = redis_server.client()
    tier = open_redis(redis_url)
    keys, chunks = make_chunks(KB_BIG, 2)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", str(used // 2))  # under what it already uses: writes are refused
    client.config_set("maxmemory-policy", "noeviction")
    try:
        assert tier.put(keys, chunks) == [False, False]
        snap = tier.metrics.snapshot()
        assert snap["skipped_stores"] == 2 and snap["stores"] == 0
        assert tier.health() == "up"  # the server answered: a full Redis is not a down Redis
        assert tier.get(keys) == [None, None]
    finally:
        client.config_set("maxmemory", "0")
    assert tier.put(keys, chunks) == [True, True]


def test_threads_share_one_tier(redis_url, open_redis) -> None:
    tier = open_redis(redis_url, part_bytes=1024)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            keys, chunks = make_chunks(KB, 4, start=i * 10_000)
            for _ in range(5):
                assert all(tier.put(keys, chunks))
                for g, c in zip(tier.get(keys), chunks, strict=True):
                    assert_same(g, c)
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert tier.metrics.snapshot()["corrupt"] == 0


def test_unreachable_at_start_recovers_by_itself(redis_server_factory, open_redis) -> None:
    server = redis_server_factory()  # a free port, nothing listening yet
    t0 = time.monotonic()
    tier = open_redis(server.url)
    keys, chunks = make_chunks(KB, 2)
    assert tier.health() == "down"
    assert tier.contains(keys) == [False, False]
    assert tier.get(keys) == [None, None]
    assert tier.put(keys, chunks) == [False, False]
    assert tier.delete(keys) == 0 and tier.clear() == 0 and list(tier.keys()) == []
    assert time.monotonic() - t0 < 3.0  # down answers at once, no timeouts
    snap = tier.metrics.snapshot()
    assert snap["up"] == 0 and snap["skipped_stores"] == 2

    server.start()
    assert eventually(lambda: tier.health() == "up"), "tier did not come back after Redis started"
    assert tier.metrics.snapshot()["up"] == 1
    assert tier.put(keys, chunks) == [True, True]
    for g, c in zip(tier.get(keys), chunks, strict=True):
        assert_same(g, c)


def test_killed_mid_run_degrades_then_recovers(redis_restartable, open_redis) -> None:
    server = redis_restartable
    tier = open_redis(server.url)
    keys, chunks = make_chunks(KB, 3)
    assert all(tier.put(keys, chunks))
    assert all(g is not None for g in tier.get(keys))

    server.kill()
    t0 = time.monotonic()
    assert tier.get(keys) == [None, None, None]  # retries, then the breaker opens
    assert tier.health() == "down"
    assert tier.put(keys, chunks) == [False, False, False]
    assert tier.contains(keys) == [False, False, False]
    assert tier.delete(keys) == 0
    assert time.monotonic() - t0 < 3.0
    snap = tier.metrics.snapshot()
    assert snap["up"] == 0 and snap["errors"] >= 3 and snap["skipped_stores"] == 3

    server.start()  # same port, empty (no persistence)
    assert eventually(lambda: tier.health() == "up"), "tier did not come back after Redis restarted"
    assert tier.get(keys) == [None, None, None]
    assert tier.put(keys, chunks) == [True, True, True]
    for g, c in zip(tier.get(keys), chunks, strict=True):
        assert_same(g, c)
    assert tier.health() == "up"


def test_malformed_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="invalid Redis URL"):
        open_tier("redis://localhost:notaport")


def test_a_full_redis_refuses_stores_counted_said_and_leaves_no_header_behind(
    redis_server_factory, open_redis, caplog
) -> None:
    """A Redis at its ``maxmemory`` with the default ``maxmemory-policy noeviction`` refuses
    each 256 KiB part (OOM) and then takes the small header written after it. The refused
    chunk's header must go: left, every lookup would offer a chunk with holes, and each read
    would count it as corrupt. The refusals are counted with their reason and said once, with
    what to do, while the tier stays up for reads."""
    server = redis_server_factory(extra_args=("--maxmemory", "2mb", "--maxmemory-policy", "noeviction"))
    server.start()
    tier = open_redis(server.url, part_bytes=64 << 10)
    small_keys, small = make_chunks(KB, 2)  # 1 KiB chunks: room for these
    assert tier.put(small_keys, small) == [True, True]
    keys, chunks = make_chunks(KB_BIG, 12)
    with caplog.at_level("WARNING", logger="kvmesh.tiers.redis"):
        stored = [tier.put([k], [c])[0] for k, c in zip(keys, chunks, strict=True)]
    refused = [k for k, ok in zip(keys, stored, strict=True) if not ok]
    assert refused, "the server took every chunk: maxmemory did not bite"
    assert tier.contains(refused) == [False] * len(refused)  # no header left behind
    assert tier.get(refused) == [None] * len(refused)
    snap = tier.metrics.snapshot()
    assert snap["corrupt"] == 0
    assert snap["skipped_by_reason"] == {"full": len(refused)}
    said = [r.getMessage() for r in caplog.records if "refused a store" in r.getMessage()]
    assert len(said) == 1 and "maxmemory-policy allkeys-lru" in said[0], said
    assert tier.health() == "up"
    for want, got in zip(small, tier.get(small_keys), strict=True):
        assert_same(got, want)  # reads go on


def test_a_read_only_replica_refuses_stores_counted_and_said(
    redis_server_factory, open_redis, caplog
) -> None:
    """``remote_url`` naming a replica (real redis-servers, one replicating the other): every
    store is refused READONLY, counted as ``read_only`` and said once with what to do; the
    tier stays up (a replica still answers reads)."""
    primary = redis_server_factory()
    primary.start()
    replica = redis_server_factory(extra_args=("--replicaof", "127.0.0.1", str(primary.port)))
    replica.start()
    tier = open_redis(replica.url)
    keys, chunks = make_chunks(KB, 3)
    with caplog.at_level("WARNING", logger="kvmesh.tiers.redis"):
        assert tier.put(keys, chunks) == [False] * 3
        assert tier.put(keys, chunks) == [False] * 3
    assert tier.metrics.snapshot()["skipped_by_reason"] == {"read_only": 6}
    said = [r.getMessage() for r in caplog.records if "refused a store" in r.getMessage()]
    assert len(said) == 1 and "read-only replica" in said[0] and ".." not in said[0], said
    assert tier.health() == "up"
