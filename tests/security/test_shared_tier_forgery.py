"""Finding 2 (issue #23): anyone who can write to a shared tier plants KV that replicas serve.

A hostile writer (a pod that reaches the store; kvmesh's own tier code, without the fleet
key or with another key) plants well-formed chunks, KV of its choosing under the chunk keys
of a victim's prompt, in a real directory (``fs://``), a real ``redis-server``, a
``moto_server`` bucket (S3) and a ``mooncake_master`` (Mooncake Store). A fresh replica
holding the fleet key must never serve them: a miss, counted in ``unauthenticated``.
Replicas holding the key share exactly, and a rotation (a second key listed) still reads
what the old key wrote.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvmesh import CacheEngine
from kvmesh.core.fleetkey import FleetKey
from kvmesh.tiers.base import ChunkData, Tier
from tests.security.chunks import CHUNK, LAYOUT, kv_for, prompt, raw_bytes

pytestmark = pytest.mark.slow


def plant(tier: Tier, engine: CacheEngine, tokens: list[int], kv: torch.Tensor) -> None:
    """Write ``kv`` under the victim's chunk keys of ``tokens``, with the right tokens."""
    keys = engine.keys.keys(tokens)
    arr = np.asarray(tokens, dtype=np.uint32)
    cut = [(i * CHUNK, (i + 1) * CHUNK) for i in range(len(keys))]
    chunks = [
        ChunkData(k, LAYOUT, arr[s:e], raw_bytes(kv[:, :, s:e])) for k, (s, e) in zip(keys, cut, strict=True)
    ]
    assert tier.put(keys, chunks) == [True] * len(keys)


def test_forged_chunks_are_misses_and_counted(
    shared_store: str,
    key_file: Callable[..., str],
    make_engine: Callable[..., CacheEngine],
    attacker: Callable[..., Tier],
) -> None:
    fleet = key_file(FleetKey.generate())
    for n, forger_key in enumerate([None, key_file(FleetKey.generate())]):  # no key; another key
        forger = attacker(shared_store, forger_key)
        tokens = prompt(2 * CHUNK, seed=10 + n)
        victim = make_engine(shared_store, key=fleet)
        plant(forger, victim, tokens, kv_for(2 * CHUNK, seed=666))
        got, _ = victim.retrieve(tokens)
        assert got == 0, "a chunk written without the fleet key was served"
        assert victim.lookup(tokens) == 0
        assert victim.stats()["remote"]["unauthenticated"] >= 1
        assert victim.stats()["remote"]["hits"] == 0
        # The victim computes the prefix itself and stores it: a replica with the key reads
        # back that, never the forgery (Mooncake keeps the first object of a key: a forged
        # second chunk the victim never read still blocks its real one until read, a miss).
        honest = kv_for(2 * CHUNK, seed=n)
        victim.store(tokens, honest)
        assert victim.wait_for_writes(20)
        peer = make_engine(shared_store, key=fleet)
        got, out = peer.retrieve(tokens)
        assert got >= CHUNK and torch.equal(out[:, :, :got], honest[:, :, :got])


def test_a_lookup_that_reads_the_shared_tier_never_offers_forged_chunks(
    shared_store: str,
    key_file: Callable[..., str],
    make_engine: Callable[..., CacheEngine],
    attacker: Callable[..., Tier],
) -> None:
    """The vLLM connector's asynchronous lookups read the shared tier's chunks instead of
    asking whether it holds them (``lookup_held(fetch=True)``): a forged chunk read there is
    a miss, counted, and nothing is offered, pinned or left in the cpu pool."""
    fleet = key_file(FleetKey.generate())
    tokens = prompt(2 * CHUNK, seed=30)
    victim = make_engine(shared_store, key=fleet)
    plant(attacker(shared_store, None), victim, tokens, kv_for(2 * CHUNK, seed=666))
    assert victim.lookup_held(tokens, pin=True, fetch=True) == (0, False)
    assert victim.stats()["remote"]["unauthenticated"] >= 1
    assert victim.stats()["cpu"]["pinned"] == 0
    assert not any(victim.cpu.contains(victim.keys.keys(tokens)))


def test_replicas_with_the_key_share_exactly_and_rotation_reads_old_chunks(
    shared_store: str, key_file: Callable[..., str], make_engine: Callable[..., CacheEngine]
) -> None:
    old, new = FleetKey.generate(), FleetKey.generate()
    tokens, kv = prompt(3 * CHUNK, seed=1), kv_for(3 * CHUNK, seed=1)
    writer = make_engine(shared_store, key=key_file(old))
    writer.store(tokens, kv)
    assert writer.wait_for_writes(20)

    reader = make_engine(shared_store, key=key_file(old))
    got, out = reader.retrieve(tokens)
    assert got == 3 * CHUNK and torch.equal(out[:, :, :got], kv)  # bit-exact
    assert reader.stats()["remote"].get("unauthenticated", 0) == 0

    # Rotation step 2: the new key signs, the old one still verifies.
    rotated = make_engine(shared_store, key=key_file(new, old))
    got, out = rotated.retrieve(tokens)
    assert got == 3 * CHUNK and torch.equal(out[:, :, :got], kv)
    later, later_kv = prompt(2 * CHUNK, seed=2), kv_for(2 * CHUNK, seed=2)
    rotated.store(later, later_kv)
    assert rotated.wait_for_writes(20)
    # Step 1 (new key listed second) reads what the new key signs; the old key alone cannot.
    step1 = make_engine(shared_store, key=key_file(old, new))
    got, out = step1.retrieve(later)
    assert got == 2 * CHUNK and torch.equal(out[:, :, :got], later_kv)
    stale = make_engine(shared_store, key=key_file(old))
    assert stale.retrieve(later)[0] == 0
    assert stale.stats()["remote"]["unauthenticated"] >= 1
