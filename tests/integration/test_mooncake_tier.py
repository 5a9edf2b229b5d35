"""Mooncake Store tier against a real ``mooncake_master`` (from the
``mooncake-transfer-engine-non-cuda`` wheel) over TCP, with its HTTP metadata server;
the master killed mid-run."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.harness.stores import MooncakeMaster as Master
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import ChunkData, TierOptions, open_tier
from kvmesh.tiers.testing import random_chunks

LAYOUT = KVLayout(2, 2, 16, "bfloat16")


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    m = Master(tmp_path)
    try:
        m.start()
        yield m
    finally:
        m.kill()


def _chunks(n: int, tokens: int = 32) -> tuple[list[ChunkKey], list[ChunkData]]:
    return random_chunks(n, LAYOUT, tokens)


@pytest.mark.slow
def test_mooncake_round_trip_and_master_killed_mid_run(master: Master) -> None:
    tier = open_tier(
        master.url, TierOptions(name="remote", metrics=TierMetrics("remote"), probe_interval_s=0.2)
    )
    try:
        keys, chunks = _chunks(6)
        assert tier.contains(keys) == [False] * 6
        assert tier.get(keys) == [None] * 6
        assert tier.put(keys[:4], chunks[:4]) == [True] * 4
        assert tier.put(keys[:1], chunks[:1]) == [True]  # already there: stored
        assert tier.contains(keys) == [True] * 4 + [False] * 2
        got = tier.get(keys)
        for g, c in zip(got[:4], chunks[:4], strict=True):
            assert g is not None and bytes(g.data) == bytes(c.data)
        assert got[4:] == [None, None]
        assert tier.delete(keys[:1]) == 1
        assert tier.contains(keys[:1]) == [False]
        assert tier.health() == "up"

        errors: list[BaseException] = []
        stop = threading.Event()

        def hammer() -> None:
            while not stop.is_set():
                try:
                    tier.get(keys)
                    tier.put(keys[4:], chunks[4:])
                except BaseException as exc:
                    errors.append(exc)

        worker = threading.Thread(target=hammer)
        worker.start()
        time.sleep(0.3)
        master.kill()  # mid-run
        time.sleep(2.0)
        stop.set()
        worker.join(60)
        assert not worker.is_alive(), "a call hung after the master died"
        assert not errors, errors[:3]
        t0 = time.monotonic()
        tier.get(keys)
        tier.contains(keys)
        tier.put(keys[4:], chunks[4:])
        assert time.monotonic() - t0 < 30
    finally:
        tier.close()
