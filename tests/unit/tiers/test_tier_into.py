"""Tier.get(into=...): raw payloads land in the caller's preallocated buffer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh import CacheEngine, KVLayout
from kvmesh.core.keys import KeyBuilder
from kvmesh.tiers.base import ChunkData, TierOptions, open_tier

LAYOUT = KVLayout(2, 2, 8, "float32")


def chunk_data(seed: int) -> tuple[list[ChunkData], np.ndarray]:
    kb = KeyBuilder("m", LAYOUT, 16)
    toks = np.arange(seed, seed + 32, dtype=np.uint32)
    keys = kb.keys_for_array(toks)
    rng = np.random.default_rng(seed)
    payloads = [rng.integers(0, 255, 16 * LAYOUT.bytes_per_token, dtype=np.uint8) for _ in keys]
    return [
        ChunkData(k, LAYOUT, toks[i * 16 : (i + 1) * 16], p.data)
        for i, (k, p) in enumerate(zip(keys, payloads, strict=True))
    ], np.concatenate(payloads)


@pytest.mark.parametrize("scheme", ["file", "fs"])
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_get_reads_raw_payloads_into_the_callers_buffer(tmp_path: Path, scheme: str, codec: str) -> None:
    tier = open_tier(f"{scheme}://{tmp_path}/t", TierOptions(name="t", codec=codec, chunk_size=16))
    chunks, _ = chunk_data(1)
    tier.put([c.key for c in chunks], chunks)
    dest = np.full(2 * 16 * LAYOUT.bytes_per_token, 7, dtype=np.uint8)
    slots = iter([dest[: len(dest) // 2].data, dest[len(dest) // 2 :].data])
    got = tier.get([c.key for c in chunks], into=lambda n: next(slots))
    for c, g in zip(chunks, got, strict=True):
        assert g is not None and bytes(g.data) == bytes(c.data)
        # raw chunks are read in place; zstd ones are decoded into fresh memory
        assert np.shares_memory(np.frombuffer(g.data, dtype=np.uint8), dest) == (codec == "raw")
    tier.close()


def test_engine_promotes_a_disk_hit_by_reading_into_its_pool(tmp_path: Path) -> None:
    engine = CacheEngine(
        {"chunk_size": 16, "max_local_cpu_size": 0.001, "local_disk": str(tmp_path / "d")},
        layout=LAYOUT,
        model_id="m",
    )
    toks = list(range(64))
    kv = torch.randn(LAYOUT.shape(64))
    engine.store(toks, kv)
    engine.wait_for_writes(10)
    engine.clear("cpu")
    with engine.retrieve_chunks(toks) as chunks:
        assert [c.tier for c in chunks] == ["disk"] * 4
        pool = engine.cpu.pool.array
        assert all(np.shares_memory(c.kv.numpy(), pool) for c in chunks)
    n, out = engine.retrieve(toks)
    assert n == 64 and torch.equal(out, kv)
    assert engine.locate(toks)[0][2] == "cpu"
    engine.close()
