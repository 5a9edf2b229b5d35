"""The ``held`` page a restarted router asks each engine for, from the connector's real
EventTracker over a real CacheEngine (CPU pool and a disk tier): chunks announced with
vLLM's block hashes, the tiers they landed in, bounded pages, evicted chunks left out."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from kvmesh import CacheConfig, CacheEngine, KVLayout
from kvmesh.admin.server import AdminServer
from kvmesh.events.codec import EventBatch
from kvmesh.index import BlockIndex
from kvmesh.integrations.vllm.tracker import EventTracker
from kvmesh.router.rebuild import events_of

LAYOUT = KVLayout(1, 1, 8, torch.float32)
CS, BS = 16, 8
TOKEN = "held-token"


def test_held_pages_what_the_tiers_hold(tmp_path: Path) -> None:
    cfg = {
        "chunk_size": CS,
        "max_local_cpu_size": 16 * CS * LAYOUT.bytes_per_token / 1024**3,
        "local_disk": str(tmp_path / "disk"),
        "max_local_disk_size": 0,
    }
    engine = CacheEngine(CacheConfig.from_dict(cfg), layout=LAYOUT, model_id="m")
    tracker = EventTracker(engine, BS)
    try:
        prompts = [np.arange(p * 1000, p * 1000 + 2 * CS, dtype=np.uint32) for p in range(3)]
        for p, toks in enumerate(prompts):
            engine.store(toks, torch.zeros(LAYOUT.shape(len(toks))))
            keys = engine.keys.keys(toks)
            hashes = list(range(p * 100, p * 100 + len(toks) // BS))
            tracker.stored(toks, keys, 0, hashes)
        assert engine.wait_for_writes(10)
        deadline = time.monotonic() + 10
        page = tracker.held(0, 100)
        while sum(e["medium"] == "DISK" for e in page["events"]) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
            page = tracker.held(0, 100)
        media = [e["medium"] for e in page["events"]]
        assert media.count("DISK") == 6 and media.count("CPU") == 6, page["events"]
        assert page["next"] is None and page["total"] == 6
        engine.clear("cpu", prompts[0])  # what a tier no longer holds is not offered
        media = [(e["block_hashes"][0], e["medium"]) for e in tracker.held(0, 100)["events"]]
        assert (0, "CPU") not in media and (2, "CPU") not in media and (0, "DISK") in media
        first = tracker.held(0, 2)
        assert len({tuple(e["block_hashes"]) for e in first["events"]}) == 2 and first["next"] == 2

        with AdminServer(engine, token=TOKEN, held=tracker.held) as admin:
            resp = httpx.post(
                admin.url + "/kvmesh/admin/v1/held",
                json={"limit": 100},
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=10,
            )
            assert resp.status_code == 200
            index = BlockIndex()
            index.apply("r", EventBatch(0.0, tuple(events_of(resp.json()))))
            for toks in prompts:
                assert "r" in index.match(toks), "every held prefix is credited after the rebuild"
    finally:
        tracker.close()
        engine.close(timeout=10)


def test_held_chunks_of_an_adapter_rebuild_under_its_name(tmp_path: Path) -> None:
    """A restarted router credits an adapter's chunks to that adapter only, not the base model."""
    cfg = {"chunk_size": CS, "max_local_cpu_size": 16 * CS * LAYOUT.bytes_per_token / 1024**3}
    engine = CacheEngine(CacheConfig.from_dict(cfg), layout=LAYOUT, model_id="m")
    tracker = EventTracker(engine, BS)
    try:
        toks = np.arange(5000, 5000 + 2 * CS, dtype=np.uint32)
        view = engine.for_adapter("fp-sql")
        view.store(toks, torch.zeros(LAYOUT.shape(len(toks))))
        tracker.stored(toks, view.keys.keys(toks), 0, list(range(len(toks) // BS)), ("sql", 3))
        page = tracker.held(0, 100)
        assert {(e["lora_name"], e["lora_id"]) for e in page["events"]} == {("sql", 3)}
        index = BlockIndex()
        index.apply("r", EventBatch(0.0, tuple(events_of(page))))
        assert "r" in index.match(toks, lora_name="sql")
        assert "r" not in index.match(toks) and "r" not in index.match(toks, lora_name="chat")
    finally:
        tracker.close()
        engine.close(timeout=10)
