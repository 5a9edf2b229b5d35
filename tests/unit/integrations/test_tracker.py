"""EventTracker: vLLM KV events for what kvmesh holds, against a real CacheEngine (CPU
pool and a real disk tier in a temp dir)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvmesh import CacheEngine, KVLayout
from kvmesh.events import BlockStored as Stored
from kvmesh.events import EventBatch
from kvmesh.index import BlockIndex
from kvmesh.integrations.vllm.tracker import EventTracker
from kvmesh.router.rebuild import events_of

BS = 16
CS = 32  # two vLLM blocks per chunk
LAYOUT = KVLayout(2, 2, 8, torch.float32)
CHUNK_BYTES = CS * LAYOUT.bytes_per_token


def _engine(slots: int = 8, **cfg: object) -> CacheEngine:
    gb = slots * CHUNK_BYTES / 2**30
    return CacheEngine({"chunk_size": CS, "max_local_cpu_size": gb, **cfg}, layout=LAYOUT, model_id="ev")


@pytest.fixture
def engine() -> Iterator[CacheEngine]:
    e = _engine()
    yield e
    e.close()


def _store(engine: CacheEngine, tracker: EventTracker, tokens: np.ndarray, hashes: list[int]) -> None:
    engine.store(tokens, torch.randn(LAYOUT.shape(len(tokens))))
    tracker.stored(tokens, engine.keys.keys_for_array(tokens), 0, hashes)


def _tokens(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.uint32)


def test_stored_chunks_are_announced_with_vllms_hashes(engine: CacheEngine) -> None:
    tr = EventTracker(engine, BS)
    toks = _tokens(100, 2 * CS)
    _store(engine, tr, toks, [11, 12, 13, 14])
    assert tr.take() == [
        BlockStored(
            block_hashes=[11, 12], parent_block_hash=None, token_ids=toks[:CS].tolist(), block_size=BS,
            lora_id=None, medium="CPU", lora_name=None,
        ),
        BlockStored(
            block_hashes=[13, 14], parent_block_hash=12, token_ids=toks[CS:].tolist(), block_size=BS,
            lora_id=None, medium="CPU", lora_name=None,
        ),
    ]  # fmt: skip
    assert tr.take() == []  # taken once
    tr.close()


def test_chunks_without_all_their_hashes_are_not_announced(engine: CacheEngine) -> None:
    tr = EventTracker(engine, BS)
    toks = _tokens(200, 2 * CS)
    _store(engine, tr, toks, [1, 2, 3])  # the second chunk lacks its last block hash
    assert [e.block_hashes for e in tr.take()] == [[1, 2]]
    _store(engine, tr, _tokens(300, CS), [])  # vLLM without prefix caching: no hashes at all
    assert tr.take() == []
    tr.close()


def test_a_later_chunk_index_uses_its_own_hashes_and_parent(engine: CacheEngine) -> None:
    tr = EventTracker(engine, BS)
    toks = _tokens(400, 2 * CS)
    engine.store(toks, torch.randn(LAYOUT.shape(len(toks))))
    keys = engine.keys.keys_for_array(toks)
    tr.stored(toks, keys[1:], 1, [5, 6, 7, 8])
    (ev,) = tr.take()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [7, 8] and ev.parent_block_hash == 6 and ev.token_ids == toks[CS:].tolist()
    tr.close()


def test_an_evicted_announced_chunk_is_removed_and_others_are_silent() -> None:
    engine = _engine(slots=2)
    try:
        tr = EventTracker(engine, BS)
        a, b = _tokens(0, CS), _tokens(1000, CS)
        _store(engine, tr, a, [1, 2])
        engine.store(b, torch.randn(LAYOUT.shape(CS)))  # stored, never announced
        tr.take()
        engine.store(_tokens(2000, CS), torch.randn(LAYOUT.shape(CS)))  # evicts a (LRU)
        engine.store(_tokens(3000, CS), torch.randn(LAYOUT.shape(CS)))  # evicts b
        assert engine.lookup(a) == 0 and engine.lookup(b) == 0
        assert tr.take() == [BlockRemoved(block_hashes=[1, 2], medium="CPU")]
        tr.close()
    finally:
        engine.close()


def test_resync_after_a_clear_removes_what_is_gone(engine: CacheEngine) -> None:
    tr = EventTracker(engine, BS)
    _store(engine, tr, _tokens(0, CS), [1, 2])
    tr.take()
    engine.clear("cpu")  # a clear bypasses the eviction hook
    assert tr.take() == []
    tr.resync()
    assert tr.take() == [BlockRemoved(block_hashes=[1, 2], medium="CPU")]
    tr.resync()  # nothing left to announce twice
    assert tr.take() == []
    tr.close()


def test_take_drops_duplicates(engine: CacheEngine) -> None:
    tr = EventTracker(engine, BS)
    toks = _tokens(0, CS)
    _store(engine, tr, toks, [1, 2])
    tr.stored(toks, engine.keys.keys_for_array(toks), 0, [1, 2])  # the same chunk again
    assert len(tr.take()) == 1
    tr.close()


def test_disabled_tracker_announces_nothing_and_hooks_nothing(engine: CacheEngine) -> None:
    hook = engine.cpu.on_evict
    tr = EventTracker(engine, BS, enabled=False)
    _store(engine, tr, _tokens(0, CS), [1, 2])
    tr.resync()
    assert tr.take() == [] and engine.cpu.on_evict is hook and tr._thread is None
    tr.close()


def test_announced_map_is_bounded_by_the_pool() -> None:
    engine = _engine(slots=2)
    try:
        tr = EventTracker(engine, BS)
        for i in range(10):
            _store(engine, tr, _tokens(i * 100, CS), [2 * i, 2 * i + 1])
        assert len(tr._announced) <= 2 * engine.cpu.pool.num_slots
        tr.close()
    finally:
        engine.close()


def test_a_write_that_lands_on_disk_is_announced_with_medium_disk(tmp_path: Path) -> None:
    engine = _engine(local_disk=str(tmp_path / "disk"))
    try:
        tr = EventTracker(engine, BS)
        assert tr._thread is not None  # a lower tier: the confirmation thread runs
        _store(engine, tr, _tokens(0, CS), [1, 2])
        assert engine.wait_for_writes(10)
        media: list[str] = []
        deadline = time.monotonic() + 10
        while "DISK" not in media and time.monotonic() < deadline:
            media += [e.medium for e in tr.take() if isinstance(e, BlockStored) and e.medium]
            time.sleep(0.02)
        assert media[0] == "CPU" and "DISK" in media
        tr.close()
        assert not tr._thread.is_alive()
    finally:
        engine.close()


def test_a_hybrid_models_events_name_the_full_attention_group(engine: CacheEngine) -> None:
    # kvmesh's swa model: group 1 is full attention (group 0 a sliding window); a router
    # indexes only full-attention stores (kvmesh/index/block_index.py), so they say so.
    tr = EventTracker(engine, BS, group=1)
    toks = _tokens(0, CS)
    _store(engine, tr, toks, [1, 2])
    (ev,) = tr.take()
    assert (ev.group_idx, ev.kv_cache_spec_kind, ev.medium) == (1, "full_attention", "CPU")
    held = events_of(tr.held(0, 10))  # what a restarted router reads back
    assert [(e.group_idx, e.kv_cache_spec_kind) for e in held] == [(1, "full_attention")]
    idx = BlockIndex()
    swa = {"group_idx": 0, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 64}
    idx.apply("r", EventBatch(0.0, (Stored((7, 8), None, tuple(toks.tolist()), BS, **swa),)))  # type: ignore[arg-type]
    idx.apply("r", EventBatch(0.0, tuple(held)))
    assert idx.match(toks.tolist())["r"].tokens == CS  # kvmesh's chunk counts, the window's does not
    engine.clear("cpu")
    tr.resync()
    assert tr.take() == [BlockRemoved(block_hashes=[1, 2], medium="CPU", group_idx=1)]
    tr.close()
