"""Lifetime classes, the class -> level map, and F_SET_RW_HINT on a real file."""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from kvmesh.core.keys import KeyBuilder, KVLayout
from kvmesh.errors import ConfigError
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import ChunkData, TierOptions
from kvmesh.tiers.disk import DiskTier
from kvmesh.tiers.placement import F_GET_RW_HINT, LEVELS, LIFETIME_CLASSES, Placement


def test_levels_and_streams() -> None:
    p = Placement("segments", 1 << 20)
    assert p.level("tail") == "short" and p.level("pinned") == "extreme" and p.level("") == "medium"
    assert len({p.stream(c) for c in LIFETIME_CLASSES}) == len(p.levels)
    assert p.stream("tail") < p.stream("rewrite") < p.stream("pinned")
    q = Placement("segments", 1 << 20, {"evict": "short"})
    assert q.stream("evict") == q.stream("tail")


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("bogus",), "disk_placement"),
        (("hints", 1000), "disk_ru_size"),
        (("hints", 1 << 20, {"evict": "soon"}), "disk_placement_map"),
        (("hints", 1 << 20, {"nope": "short"}), "lifetime class"),
    ],
)
def test_bad_config_names_the_key(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Placement(*args)  # type: ignore[arg-type]


def test_hints_are_applied_and_reported(tmp_path: Path) -> None:
    p = Placement("hints")
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        ok = p.apply(fd, "tail")
        st = p.status(str(tmp_path))
        if ok:  # the kernel took it: reading it back gives RWH_WRITE_LIFE_SHORT
            assert struct.unpack("=Q", fcntl.fcntl(fd, F_GET_RW_HINT, bytes(8)))[0] == LEVELS["short"]
            assert st["hints_accepted"] == 1 and st["hints_refused"] == 0
        else:
            assert st["hints_refused"] == 1 and st["hint_error"]
    finally:
        os.close(fd)
    assert Placement("none").apply(0, "tail") is False


def test_disk_tier_tags_files_and_traces_extents(tmp_path: Path) -> None:
    layout = KVLayout(2, 2, 8, "float32")
    kb = KeyBuilder("m", layout, chunk_size=16)
    tokens = np.arange(32, dtype=np.uint32)
    keys = kb.keys(tokens)
    cs = [
        ChunkData(
            k, layout, tokens[i * 16 : (i + 1) * 16], bytearray(16 * layout.bytes_per_token), lifetime=cls
        )
        for i, (k, cls) in enumerate(zip(keys, ("tail", "pinned"), strict=True))
    ]
    trace = tmp_path / "t.jsonl"
    o = TierOptions(name="disk", metrics=TierMetrics("disk"), placement="hints", io_trace=str(trace))
    t = DiskTier(str(tmp_path / "d"), o)
    assert t.put(keys, cs) == [True, True]
    hints = t.placement.status()
    assert hints["hints_accepted"] + hints["hints_refused"] == 2
    t.delete([keys[0]])
    t.close()
    import json

    recs = [json.loads(x) for x in trace.read_text().splitlines()]
    writes = [r for r in recs if r["op"] == "write"]
    assert [r["class"] for r in writes] == ["tail", "pinned"]
    dels = [r for r in recs if r["op"] == "delete"]
    if writes[0]["extents"] is not None:  # FIEMAP works on this filesystem
        assert sum(e[1] for e in writes[0]["extents"]) >= writes[0]["bytes"]
        assert dels[0]["extents"] == writes[0]["extents"]


def test_engine_tags_store_tail_and_pinned(tmp_path: Path) -> None:
    import json

    import torch

    from kvmesh.core.engine import CacheEngine

    layout = KVLayout(2, 2, 8, "float32")
    trace = tmp_path / "t.jsonl"
    cfg = {
        "chunk_size": 16,
        "max_local_cpu_size": 0.01,
        "local_disk": str(tmp_path / "d"),
        "save_unfull_chunk": True,
        "disk_io_trace": str(trace),
        "disk_placement": "hints",
    }
    tokens = np.arange(40, dtype=np.uint32)  # 2 full chunks and a partial tail
    with CacheEngine(cfg, layout=layout, model_id="m") as eng:
        eng.store(tokens, torch.zeros(layout.shape(40)))
        assert eng.wait_for_writes(10)
        eng.clear("disk")
        eng.move(tokens[:16], "disk")
    classes = [json.loads(x).get("class") for x in trace.read_text().splitlines()]
    assert [c for c in classes if c] == ["store", "store", "tail", "pinned"]
