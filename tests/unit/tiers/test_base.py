"""The tier seam: declared features (no sniffing), the shared recode, counted pins, the
policy registry, and the operation deadline."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvmesh.core.keys import KeyBuilder, KVLayout
from kvmesh.core.memory import MemoryPool
from kvmesh.core.policy import PinCounts, make_policy
from kvmesh.errors import ConfigError
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import (
    ChunkData,
    Feature,
    Tier,
    TierBase,
    TierOptions,
    as_advisable,
    as_pinnable,
    as_recodable,
    open_tier,
    recode,
)
from kvmesh.tiers.cpu import CPUTier
from kvmesh.tiers.deadline import deadline, expired, time_left
from kvmesh.tiers.disk import DiskTier
from kvmesh.tiers.fs import FsTier
from kvmesh.tiers.redis import RedisTier
from kvmesh.tiers.testing import MemoryTier, reset_memory_stores

LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_size=8, dtype="float16")


def test_every_tier_declares_its_features(tmp_path: Path) -> None:
    cpu = CPUTier(MemoryPool(1 << 16, 1 << 12))
    disk = DiskTier(str(tmp_path / "d"))
    fs = FsTier(str(tmp_path / "fs"), TierOptions())
    mem = MemoryTier("x", TierOptions())
    try:
        assert isinstance(cpu, TierBase)  # the cpu tier answers the common protocol too
        for tier in (disk, fs, mem):
            assert isinstance(tier, Tier)
        assert cpu.features == Feature.PIN
        assert disk.features == Feature.PIN | Feature.RECODE | Feature.ADVISE
        assert fs.features == RedisTier.features == Feature.RECODE
        assert mem.features == Feature.NONE
        assert as_pinnable(cpu) is cpu and as_pinnable(disk) is disk
        assert as_pinnable(fs) is None and as_pinnable(mem) is None
        assert as_recodable(disk) is disk and as_recodable(fs) is fs and as_recodable(mem) is None
        assert as_advisable(disk) is disk and as_advisable(fs) is None and as_advisable(cpu) is None
    finally:
        disk.close()
        cpu.close()
        reset_memory_stores()


@pytest.mark.parametrize("scheme", ["file", "fs"])
def test_one_recode_for_every_recodable_tier(tmp_path: Path, scheme: str) -> None:
    tier = open_tier(f"{scheme}://{tmp_path}", TierOptions(metrics=TierMetrics("t")))
    recodable = as_recodable(tier)
    assert recodable is not None
    toks = np.zeros(32, dtype=np.uint32)  # zeros: zstd shrinks them
    keys = KeyBuilder("m", LAYOUT, 16).keys_for_array(toks)
    data = bytearray(16 * LAYOUT.bytes_per_token)
    assert tier.put(keys, [ChunkData(k, LAYOUT, toks[:16], data) for k in keys]) == [True, True]
    before, after = recode(recodable, keys, "zstd")
    assert after < before
    assert recode(recodable, keys, "zstd") == (after, after)  # already zstd: nothing rewritten
    got = tier.get(keys)
    assert all(g is not None and g.codec == "zstd" and bytes(g.data) == bytes(data) for g in got)
    with pytest.raises(ConfigError):
        recode(recodable, keys, "no-such-codec")
    tier.close()


def test_pin_counts_are_symmetric() -> None:
    pins = PinCounts()
    assert pins.pin("a") is True and pins.pin("a") is False
    assert pins.unpin("a") is False and "a" in pins
    assert pins.unpin("a") is True and "a" not in pins
    assert pins.unpin("a") is False  # an unpin without a pin changes nothing
    assert pins.count("a") == 0 and list(pins) == []


def test_policy_names_are_checked() -> None:
    assert len(make_policy("lru")) == 0
    with pytest.raises(ConfigError, match="eviction_policy 'mru' is unknown; valid values: fifo, lru"):
        make_policy("mru")


def test_deadline_nests_to_the_earliest_and_is_per_thread() -> None:
    assert time_left() is None and not expired()
    with deadline(10.0):
        outer = time_left()
        assert outer is not None and 9.0 < outer <= 10.0
        with deadline(0.05):
            inner = time_left()
            assert inner is not None and inner <= 0.05
            seen: list[float | None] = []
            t = threading.Thread(target=lambda: seen.append(time_left()))
            t.start()
            t.join()
            assert seen == [None]  # another thread has no deadline of ours
            time.sleep(0.06)
            assert expired()
        with deadline(100.0):  # a later end never extends the outer one
            left = time_left()
            assert left is not None and left <= 10.0
        with deadline(None):
            assert time_left() is not None
    assert time_left() is None
