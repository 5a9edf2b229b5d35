"""The index lookup benchmark measures under concurrent ingestion, in wall-clock time."""

from __future__ import annotations

from kvmesh.bench.router.index_lookup import run


def test_lookups_are_timed_while_events_are_ingested() -> None:
    out = run(blocks=20_000, queries=200, ingest_rate=100.0)
    assert out["blocks"] >= 20_000 and out["ingested_batches"] > 0
    for kind in ("hit", "miss"):
        d = out[kind]
        assert 0 < d["wall_p50_ms"] <= d["wall_p99_ms"] <= d["wall_max_ms"]
    assert out["blocks_after"] <= 20_000 + 140  # full index: ingestion evicts


def test_idle_index_ingests_nothing() -> None:
    assert run(blocks=5_000, queries=50, ingest_rate=0)["ingested_batches"] == 0
