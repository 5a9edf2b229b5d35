"""A real redis-server behind the harness's latency proxy (kvmesh.harness.slowproxy) as the
shared tier: the proxy slows the link, not redis, as a store 50 ms away would be.

The engine measures the slowed tier on its first loads, then reports its chunks as not
loadable when computing them is faster (skip_slow_loads), and stops asking it at all when
every chunk from it costs more than computing one; the same store reached directly is
loaded as before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
import torch

from kvmesh import CacheEngine, KVLayout
from kvmesh.harness.services import RedisServer
from kvmesh.harness.slowproxy import SlowProxy

LAYOUT = KVLayout(2, 2, 8, torch.float32)
CS = 16


@pytest.fixture
def slow(redis_url: str, redis_server: RedisServer) -> Iterator[SlowProxy]:
    with SlowProxy(redis_server.port, latency_s=0.02, bandwidth_bps=50e6).start() as proxy:
        yield proxy


def test_the_proxy_adds_its_latency_and_keeps_the_bytes(redis_server: RedisServer, slow: SlowProxy) -> None:
    direct = redis.Redis(port=redis_server.port)
    via = redis.Redis(port=slow.port)
    value = bytes(range(256)) * 4096  # 1 MiB
    direct.set("k", value)
    t0 = time.perf_counter()
    assert via.get("k") == value
    took = time.perf_counter() - t0
    assert took >= 0.04 + len(value) / 50e6  # there and back, and 1 MiB at 50 MB/s
    t0 = time.perf_counter()
    assert direct.get("k") == value
    assert time.perf_counter() - t0 < took / 2


def _engine(url: str, tokens_per_s: float | None) -> CacheEngine:
    cfg = {"chunk_size": CS, "max_local_cpu_size": 0.001, "remote_url": url, "promote_on_hit": False}
    return CacheEngine({**cfg, "prefill_tokens_per_s": tokens_per_s}, layout=LAYOUT, model_id="m")


def test_loads_from_a_slow_shared_tier_are_left_to_recompute(
    redis_url: str, redis_server: RedisServer, slow: SlowProxy
) -> None:
    tokens = list(range(1, 8 * CS + 1))
    with _engine(redis_url, None) as writer:
        writer.store(tokens, torch.zeros(LAYOUT.shape(len(tokens))))
        assert writer.wait_for_writes(10)
    # 128 tokens at 100k tokens/s: 1.3 ms to compute, against >= 40 ms (a round trip) per load
    far = f"redis://127.0.0.1:{slow.port}"
    with _engine(far, 100_000.0) as reader, _engine(redis_url, 1.0) as near:
        assert reader.lookup(tokens) == len(tokens)  # not measured yet: loaded as before
        for n in (1, 2, 4, 8):
            with reader.retrieve_chunks(tokens[: n * CS]) as chunks:
                assert chunks[-1].end == n * CS
        figures = reader.cost_figures()
        remote = figures["tiers"]["remote"]
        assert remote["loads"] == 4 and remote["load_seconds"] >= 4 * 0.04  # one round trip each
        assert reader.lookup(tokens) == 0  # computing it is faster: nothing offered
        figures = reader.cost_figures()
        assert figures["lookups_without_slow_tiers"] + figures["skipped_loads"] >= 1
        # the same store, directly and with compute 100,000x slower: all offered
        for n in (1, 2, 4, 8):
            with near.retrieve_chunks(tokens[: n * CS]):
                pass
        assert near.lookup(tokens) == len(tokens)
