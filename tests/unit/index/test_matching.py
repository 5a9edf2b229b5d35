"""The index's lookup at fleet scale: work per prompt block and per holder, not per replica."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvmesh.events import BlockStored, EventBatch
from kvmesh.index import BlockIndex, Medium


class CountingDict(dict[Any, Any]):
    """A dict that counts ``get`` calls (the lookup's probes); a probe, not a fake index."""

    probes = 0

    def get(self, key: Any, default: Any = None) -> Any:
        CountingDict.probes += 1
        return super().get(key, default)


def fleet(replicas: int, holders: tuple[int, ...], tokens: np.ndarray) -> BlockIndex:
    idx = BlockIndex()
    for r in range(replicas):
        idx.add_replica(f"r{r}")
    for r in holders:
        ev = BlockStored(
            tuple(range(1000 * r, 1000 * r + len(tokens) // 16)), None, tuple(tokens.tolist()), 16
        )
        idx.apply(f"r{r}", EventBatch(0.0, (ev,)))
    return idx


def test_holders_found_among_a_thousand_replicas_with_speculation_on_all() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50_000, 512).astype(np.uint32)
    idx = fleet(1000, (7, 993), tokens)
    other = rng.integers(0, 50_000, 512).astype(np.uint32)
    for r in range(1000):  # a request in flight on every replica, none with this prefix
        idx.add_speculative(f"r{r}", other)
    idx.add_speculative("r500", tokens[:256])  # and one that will hold half of it
    got = idx.match(tokens)
    assert {k: m.tokens for k, m in got.items()} == {"r7": 512, "r993": 512, "r500": 256}
    assert got["r500"].ranges == ((0, 256, Medium.GPU),)


def test_lookup_probes_do_not_grow_with_the_fleet() -> None:
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 50_000, 512).astype(np.uint32)
    probes = []
    for n in (10, 1000):
        idx = fleet(n, (1, 2), tokens)
        for r in range(n):
            idx.add_speculative(f"r{r}", rng.integers(0, 50_000, 512).astype(np.uint32))
        counted = CountingDict(idx._spec.keys)
        idx._spec.keys = counted
        CountingDict.probes = 0
        assert set(idx.match(tokens)) == {"r1", "r2"}
        probes.append(CountingDict.probes)
    # One probe per prompt block (32 blocks of 16 tokens), at 10 replicas as at 1,000.
    assert probes == [32, 32]


def test_a_high_replica_id_does_not_make_every_block_wide() -> None:
    """Memory per block follows the spread of its holders' ids, not the fleet size."""
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 50_000, 256).astype(np.uint32)
    idx = fleet(1000, (999,), tokens)
    widths = [entry[0].bit_length() for _, entry in idx._entries()]
    assert len(widths) == 16 and max(widths) <= 8  # one byte: replica 999's own
    assert {k: m.tokens for k, m in idx.match(tokens).items()} == {"r999": 256}
    idx.remove("r999", [999_000], "GPU")  # its first block: the prefix is gone
    assert idx.match(tokens) == {}


def test_a_hot_prefix_speculated_on_every_replica_expires_per_replica() -> None:
    """Masks are kept per key: all 1,000 holders are found, and each leaves when it expires."""
    t = [0.0]
    idx = BlockIndex(clock=lambda: t[0])
    tokens = np.random.default_rng(5).integers(0, 50_000, 256).astype(np.uint32)
    for r in range(1000):
        t[0] = r * 0.001
        idx.add_speculative(f"r{r}", tokens, ttl_s=2.0, block_size=16)
    t[0] = 1.0
    assert len(idx.match(tokens)) == 1000
    t[0] = 2.5  # the first 500 (added before t=0.5) have expired
    got = idx.match(tokens)
    assert len(got) == 499 and "r0" not in got and "r999" in got
    idx.clear_replica("r999")
    assert "r999" not in idx.match(tokens)


def test_a_prefix_stored_by_two_far_apart_replicas_shares_one_mask() -> None:
    """Consecutive blocks with the same holders keep one mask object, not a wide int each."""
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, 50_000, 512).astype(np.uint32)
    idx = fleet(1000, (3, 900), tokens)
    masks = [entry[0] for _, entry in idx._entries()]
    assert len(masks) == 32 and masks[0].bit_length() > 7000  # replicas 3 and 900: a wide int
    assert len({id(m) for m in masks}) == 1
    assert {k: m.tokens for k, m in idx.match(tokens).items()} == {"r3": 512, "r900": 512}
    idx.remove("r900", [900_031], "GPU")  # its last block: one fewer block for r900
    assert {k: m.tokens for k, m in idx.match(tokens).items()} == {"r3": 512, "r900": 496}
