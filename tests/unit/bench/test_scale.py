"""``kvmesh bench scale``'s parts on a small fleet: the index worker and the ingest path."""

from __future__ import annotations

from pathlib import Path

from kvmesh.bench.scale import bench as scale
from kvmesh.bench.scale import ingest as scale_ingest


def test_index_worker_point(tiny_model: Path) -> None:
    # Run as the bench runs it: in a fresh process. Memory is an RSS difference, which reads 0
    # in a process whose allocator already holds freed memory (the test process, after other
    # tests); a fresh worker has none. Still only "positive and not absurd" is asserted.
    out = scale._point(50, 5_000, str(tiny_model), 12)
    assert "error" not in out, out
    assert out["blocks"] >= 5_000 and 0 < out["bytes_per_block"] < 5_000
    for n in ("2k", "32k"):
        d = out[f"decision_{n}"]
        assert 0 < d["cpu_p50_ms"] <= d["cpu_p99_ms"] and d["with_match"] > 0.3
    assert 1_800 < out["decision_2k"]["tokens"] < 2_400 and 28_000 < out["decision_32k"]["tokens"] < 36_000


def test_ingest_delivers_every_event_in_vllm_format_to_the_sink_process() -> None:
    out = scale_ingest.measure(replicas=3, rate=2_000, seconds=0.5, max_blocks=100_000)
    assert out["events"] == 1_000 - 1_000 % scale_ingest.EVENTS_PER_BATCH
    idx = out["index"]
    assert idx["orphans"] == 0 and idx["invalid"] == 0 and idx["replicas"] == 3
    assert idx["stored_blocks"] > 0 and idx["removed_blocks"] > 0
    assert out["lag_p99_ms"] >= out["lag_p50_ms"] >= 0


def test_summary_reads_targets_from_points() -> None:
    pts = [
        {
            "replicas": 1000,
            "blocks": b,
            "bytes_per_block": 390,
            "decision_2k": {"wall_p99_ms": 3.0, "cpu_p99_ms": 2.0},
            "decision_32k": {"wall_p99_ms": 30.0, "cpu_p99_ms": 20.0},
        }
        for b in (100_000, 1_000_000)
    ]
    ing = [{"replicas": 1000, "offered_events_per_s": 10_000, "sustained": True, "lag_p99_ms": 20.0}]
    s = scale._summary(pts, ing)
    assert s["decision_2k_p99_ms_at_1000r_10M_extrapolated"] == 3.0  # flat in blocks
    assert s["targets_met"] == {
        "decision_p99_le_5ms_2k": True,
        "decision_cpu_p99_le_5ms_2k": True,
        "ingest_ge_100k_lag_le_100ms": False,
        "bytes_per_block_le_200": False,
    }
