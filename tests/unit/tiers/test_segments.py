"""SegmentTier (disk_placement=segments) against a real file: round trips, per-level
segments, whole-segment reclaim (drop / hot / pinned), trims in the trace, restarts,
corruption, and the engine driving it."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.core.engine import CacheEngine
from kvmesh.core.keys import KeyBuilder, KVLayout
from kvmesh.errors import ConfigError, TierUnavailableError
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import ChunkData, TierOptions, open_tier
from kvmesh.tiers.placement import Placement
from kvmesh.tiers.segments import ALIGN, FILE_NAME, SegmentTier

LAYOUT = KVLayout(2, 2, 64, "float32")  # 2 KiB per token
CHUNK = 32  # 64 KiB chunks (68 KiB records): 15 fill a 1 MiB segment
RU = 1 << 20
KB = KeyBuilder("m", LAYOUT, chunk_size=CHUNK)


def chunks(n: int, seed: int = 0, lifetime: str = "") -> list[ChunkData]:
    tokens = np.arange(seed * 1_000_000, seed * 1_000_000 + n * CHUNK, dtype=np.uint32)
    rng = np.random.default_rng(seed)
    out = []
    for i, key in enumerate(KB.keys(tokens)):
        kv = rng.standard_normal(CHUNK * LAYOUT.bytes_per_token // 4).astype(np.float32)
        out.append(
            ChunkData(
                key, LAYOUT, tokens[i * CHUNK : (i + 1) * CHUNK], bytearray(kv.tobytes()), lifetime=lifetime
            )
        )
    return out


def tier(path: Path, slots: int = 8, trace: Path | None = None, reclaim: str = "hot") -> SegmentTier:
    o = TierOptions(
        name="disk",
        capacity_bytes=slots * RU,
        chunk_size=CHUNK,
        metrics=TierMetrics("disk"),
        io_trace=str(trace) if trace else None,
        placement="segments",
        ru_size=RU,
    )
    return SegmentTier(str(path), o, Placement("segments", RU), reclaim=reclaim)


def put(t: SegmentTier, cs: list[ChunkData]) -> list[bool]:
    return t.put([c.key for c in cs], cs)


def same(got: ChunkData | None, want: ChunkData) -> bool:
    return got is not None and bytes(got.data) == bytes(want.data) and np.array_equal(got.tokens, want.tokens)


def test_round_trip_and_restart(tmp_path: Path) -> None:
    t = tier(tmp_path)
    cs = chunks(20)
    assert all(put(t, cs))
    assert all(same(g, c) for g, c in zip(t.get([c.key for c in cs]), cs, strict=True))
    assert os.path.getsize(tmp_path / FILE_NAME) == 8 * RU
    t.close()
    with pytest.raises(TierUnavailableError):
        t.get([cs[0].key])
    t2 = tier(tmp_path)
    assert t2.contains([c.key for c in cs]) == [True] * 20
    assert all(same(g, c) for g, c in zip(t2.get([c.key for c in cs]), cs, strict=True))
    t2.close()


def test_levels_get_their_own_segments(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    t = tier(tmp_path / "d", trace=trace)
    short, long_ = chunks(3, 1, "tail"), chunks(3, 2, "pinned")
    for a, b in zip(short, long_, strict=True):  # interleaved on the wire
        assert put(t, [a]) == [True] and put(t, [b]) == [True]
    t.close()
    recs = [json.loads(x) for x in trace.read_text().splitlines()]
    seg_of = {r["key"]: r["extents"][0][0] // RU for r in recs if r["op"] == "write" and "key" in r}
    assert len({seg_of[c.key.text] for c in short}) == 1
    assert len({seg_of[c.key.text] for c in long_}) == 1
    assert seg_of[short[0].key.text] != seg_of[long_[0].key.text]
    assert all(r["extents"][0][0] % ALIGN == 0 for r in recs if r["op"] == "write")
    assert {r["class"] for r in recs if r["op"] == "write"} == {"tail", "pinned", "meta"}


def test_reclaim_drops_cold_keeps_hot_and_pinned_and_trims(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    t = tier(tmp_path / "d", slots=8, trace=trace)
    first = chunks(15, 1)  # exactly one segment's worth
    assert all(put(t, first))
    t.pin([first[0].key])
    assert same(t.get([first[1].key])[0], first[1])  # read since written: hot
    for s in range(2, 12):  # push well past capacity: the first segment is reclaimed
        assert all(put(t, chunks(15, s)))
    have = t.contains([c.key for c in first])
    assert have[0] and have[1], "pinned and hot chunks are rewritten, not dropped"
    assert not any(have[2:]), "cold chunks of a reclaimed segment are dropped"
    assert same(t.get([first[0].key])[0], first[0]) and same(t.get([first[1].key])[0], first[1])
    assert t.metrics.snapshot()["rewrites"] >= 2
    t.close()
    recs = [json.loads(x) for x in trace.read_text().splitlines()]
    trims = [r for r in recs if r["op"] == "trim"]
    assert trims and all(r["extents"][0][1] == RU and r["extents"][0][0] % RU == 0 for r in trims)
    assert any(r.get("class") == "rewrite" for r in recs)


def test_reclaim_drop_policy_drops_hot_chunks(tmp_path: Path) -> None:
    t = tier(tmp_path, slots=8, reclaim="drop")
    first = chunks(15, 1)
    put(t, first)
    t.get([first[1].key])
    for s in range(2, 12):
        put(t, chunks(15, s))
    assert not any(t.contains([c.key for c in first]))
    t.close()


def test_delete_of_a_whole_segment_trims_it_at_once(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    t = tier(tmp_path / "d", trace=trace)
    a, b = chunks(15, 1), chunks(15, 2)
    put(t, a)
    put(t, b)  # closes a's segment
    assert t.delete([c.key for c in a]) == 15
    t.close()
    recs = [json.loads(x) for x in trace.read_text().splitlines()]
    assert [r["op"] for r in recs].count("trim") == 1
    t2 = tier(tmp_path / "d")
    assert not any(t2.contains([c.key for c in a])) and all(t2.contains([c.key for c in b]))
    t2.close()


def test_corrupt_payload_is_a_miss_and_dropped(tmp_path: Path) -> None:
    t = tier(tmp_path)
    cs = chunks(2)
    put(t, cs)
    ent = t._entries[cs[0].key.text]
    with open(tmp_path / FILE_NAME, "r+b") as f:
        f.seek(ent.off + ent.length - 100)
        f.write(b"\xff" * 50)
    assert t.get([cs[0].key]) == [None]
    assert t.contains([cs[0].key]) == [False]
    assert same(t.get([cs[1].key])[0], cs[1])
    assert t.metrics.snapshot()["corrupt"] == 1
    t.close()


def test_torn_last_record_is_dropped_at_restart(tmp_path: Path) -> None:
    t = tier(tmp_path)
    cs = chunks(3)
    put(t, cs)
    ent = t._entries[cs[2].key.text]
    t.close()
    with open(tmp_path / FILE_NAME, "r+b") as f:  # as if the crash hit inside its payload
        f.seek(ent.off + ent.length - 4096)
        f.write(bytes(4096))
    t2 = tier(tmp_path)
    assert t2.contains([c.key for c in cs]) == [True, True, False]
    t2.close()


def test_smaller_budget_at_restart_drops_slots_past_the_end(tmp_path: Path) -> None:
    t = tier(tmp_path, slots=12)
    for s in range(11):
        put(t, chunks(15, s))
    t.close()
    t2 = tier(tmp_path, slots=7)
    assert os.path.getsize(tmp_path / FILE_NAME) == 7 * RU
    n = sum(sum(t2.contains([c.key for c in chunks(15, s)])) for s in range(11))
    assert 0 < n <= 7 * 15
    t2.close()


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_local_disk_size"):
        SegmentTier(str(tmp_path), TierOptions(placement="segments", ru_size=RU), Placement("segments", RU))
    with pytest.raises(ConfigError, match="segments needs"):
        tier(tmp_path, slots=3)
    with pytest.raises(ConfigError, match="disk_ru_size"):
        Placement("segments", 12345)


def test_open_tier_and_engine_with_segments(tmp_path: Path) -> None:
    o = TierOptions(capacity_bytes=8 * RU, placement="segments", ru_size=RU, chunk_size=CHUNK)
    assert isinstance(open_tier(f"file://{tmp_path / 'x'}", o), SegmentTier)
    cfg = {
        "chunk_size": CHUNK,
        "max_local_cpu_size": 4 * CHUNK * LAYOUT.bytes_per_token / 1024**3,
        "local_disk": str(tmp_path / "e"),
        "max_local_disk_size": 16 * RU / 1024**3,
        "disk_placement": "segments",
        "disk_ru_size": RU,
        "write_mode": "back",
        "disk_io_trace": str(tmp_path / "t.jsonl"),
    }
    tokens = np.arange(12 * CHUNK, dtype=np.uint32)
    kv = torch.randn(LAYOUT.shape(len(tokens)), dtype=torch.float32)
    with CacheEngine(cfg, layout=LAYOUT, model_id="m") as eng:
        assert isinstance(eng.lower["disk"], SegmentTier)
        eng.store(tokens, kv)
        assert eng.wait_for_writes(10)
        n, got = eng.retrieve(tokens)
        assert n == len(tokens) and torch.equal(got, kv)
    recs = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert {r["class"] for r in recs if r["op"] == "write"} >= {"evict", "meta"}


def test_a_cache_of_only_hot_chunks_still_takes_writes(tmp_path: Path) -> None:
    t = tier(tmp_path, slots=7)
    old = [c for s in range(7) for c in chunks(15, s)]
    put(t, old)
    t.get([c.key for c in old])  # everything hot
    assert all(put(t, chunks(30, 50)))
    t.close()


def test_writeback_starts_per_record_before_the_batch_fdatasync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each record's pages are handed to the device as it is written (sync_file_range), and the
    batch is made durable by one fdatasync after all of them; a refused start changes nothing."""
    import kvmesh.tiers.segments as segments

    t = tier(tmp_path)
    calls: list[tuple[str, int, int]] = []
    real_sync = os.fdatasync

    def started(fd: int, off: int, length: int) -> bool:
        calls.append(("start", off, length))
        return False  # as where the call is missing: the fdatasync still does it all

    def synced(fd: int) -> None:
        calls.append(("sync", 0, 0))
        real_sync(fd)

    monkeypatch.setattr(segments, "start_writeback", started)
    monkeypatch.setattr(segments.os, "fdatasync", synced)
    cs = chunks(5)
    assert all(put(t, cs))
    assert [c[0] for c in calls] == ["start"] * 5 + ["sync"]
    starts = sorted((off, length) for _, off, length in calls[:5])
    assert all(length % ALIGN == 0 and length > CHUNK * LAYOUT.bytes_per_token for _, length in starts)
    assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(starts))  # no overlap
    assert all(same(g, c) for g, c in zip(t.get([c.key for c in cs]), cs, strict=True))
    t.close()


def test_start_writeback_on_a_real_file(tmp_path: Path) -> None:
    from kvmesh.tiers.segment_format import start_writeback

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"x" * (1 << 20), 0)
        assert start_writeback(fd, 0, 1 << 20) is True  # Linux has sync_file_range
        assert start_writeback(-1, 0, 4096) is False  # a refused call is False, not an exception
        assert os.pread(fd, 4, (1 << 20) - 4) == b"xxxx"
    finally:
        os.close(fd)
