"""The soak's verdict on recorded timelines: a run that keeps every promise passes, and each
broken promise fails it on its own (a skipped fault, a memory bound exceeded, a refusal
outside the router's restart, a window without answers, a fault never recovered from, a
prompt pool that fits the replicas' own caches)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvmesh.bench.runner import provenance
from kvmesh.bench.soak.bench import rss_report
from kvmesh.bench.soak.load import FaultEvent, Record
from kvmesh.bench.soak.report import report
from kvmesh.bench.soak.verdict import Bounds, checks, explain, verdict_ok

MIB = 1 << 20
BOUNDS = Bounds(window_s=10.0, recovery_within_s=10.0, clean_window_s=5.0)
FAULTS = ("redis_kill", "disk_full", "router_restart")
POOL = {"chunks": 105, "replicas": 2, "vllm_cache_chunks": 32, "cpu_tier_chunks": 16, "disk_tier_chunks": 24}
WARM = {"replica0": 2500 * MIB, "replica1": 2500 * MIB, "router": 150 * MIB, "redis": 40 * MIB}


def _answers(
    lo: float, hi: float, per_s: int = 4, cached: int = 90, outcome: str = "correct"
) -> list[Record]:
    n = int((hi - lo) * per_s)
    return [Record("p", lo + k / per_s - 0.2, lo + k / per_s, outcome, 100, cached) for k in range(n)]  # type: ignore[arg-type]


def _timeline() -> tuple[list[Record], list[FaultEvent]]:
    """120 s at 4 answers/s: Redis killed at 20-25 s (the hit rate dips, then comes back),
    the disk filled at 40-45 s, the router restarted at 70-78 s (refusals while it is down)."""
    events = [
        FaultEvent("redis_kill", 20.0, 25.0, "redis SIGKILLed"),
        FaultEvent("disk_full", 40.0, 45.0, "tmpfs filled"),
        FaultEvent("router_restart", 70.0, 78.0, "router restarted"),
    ]
    records = _answers(0, 25) + _answers(25, 28, cached=20) + _answers(28, 70)
    records += _answers(70.5, 77.5, per_s=2, outcome="router_down") + _answers(78, 120)
    return records, events


def _report(
    records: list[Record],
    events: list[FaultEvent],
    peak: dict[str, int] | None = None,
    pool: dict[str, Any] | None = None,
    faults: tuple[str, ...] = FAULTS,
) -> dict[str, Any]:
    settings = {"faults": list(faults)}
    return report(records, events, (WARM, peak or WARM, []), 120.0, settings, pool or POOL, BOUNDS)


def _failed(out: dict[str, Any]) -> set[str]:
    return {c["name"] for c in out["verdict"]["checks"] if not c["ok"]}


def test_a_run_that_keeps_every_promise_passes() -> None:
    out = _report(*_timeline())
    assert _failed(out) == set() and out["verdict"]["ok"] and verdict_ok(out)
    assert out["router_down"] > 0 and out["error"] == 0  # refused while the router restarted
    # from 26.5 s: 6 cold answers of 20 in 5 s, hit rate 0.69 >= 0.9 x the 0.9 before (0.81)
    # less two standard errors of a rate over 20 answers (0.13); from 26.0 s, 8 cold: 0.62
    assert [f["recovery_s"] for f in out["faults"]] == [pytest.approx(1.5), 0.0, 0.0]
    assert out["windows"]["least"] == 10  # a quarter of the 40 answers a window had before
    assert [r["t"] for r in out["windows"]["rows"] if r["exempt"]] == [70.0]  # the router was down
    assert out["memory"]["router"] == {"warm_mb": 150.0, "peak_mb": 150.0, "bound_mb": 278.0}


def test_a_skipped_fault_fails_the_verdict() -> None:
    records, events = _timeline()
    events[1] = replace(events[1], note="fault failed: ProcessError: no tmpfs", injected=False)
    out = _report(records, events)
    assert _failed(out) == {"faults_injected"} and not verdict_ok(out)
    # ... and so does a fault asked for that never ran
    assert _failed(_report(records, events[:1] + events[2:])) == {"faults_injected"}


def test_a_memory_bound_exceeded_fails_the_verdict() -> None:
    out = _report(*_timeline(), peak={**WARM, "replica1": WARM["replica1"] + 385 * MIB})
    assert _failed(out) == {"memory"} and not verdict_ok(out)
    assert "replica1: peak 2885 MiB > bound 2884 MiB" in out["verdict"]["checks"][-2]["detail"]
    # a process never measured warm has no bound, and fails too
    assert _failed(_report(*_timeline(), peak={**WARM, "extra": MIB})) == {"memory"}


def test_a_refusal_outside_the_router_restart_is_an_error() -> None:
    records, events = _timeline()
    records += _answers(50, 51, outcome="router_down")
    out = _report(records, events)
    assert out["error"] == 4 and _failed(out) == {"error"}
    assert explain(records, events, 2.0)[-1].detail.startswith("router_down outside router_restart")
    # a broken stream is explained by a replica's death, not by Redis's
    broken = explain(_answers(21, 22, outcome="broken_stream"), events, 2.0)
    assert {r.outcome for r in broken} == {"error"}


def test_a_window_without_enough_correct_answers_fails() -> None:
    records, events = _timeline()
    records = [r for r in records if not 50 <= r.end < 60 or r.end < 50.5]  # 2 answers in 50-60 s
    assert _failed(_report(records, events)) == {"correct_per_window"}


def test_a_fault_never_recovered_from_fails() -> None:
    records, events = _timeline()
    cold = [
        replace(r, cached_tokens=30) if 25 <= r.end < 120 and r.outcome == "correct" else r for r in records
    ]
    out = _report(cold, events)
    assert "recovery" in _failed(out)
    assert "redis_kill: never" in next(
        c["detail"] for c in out["verdict"]["checks"] if c["name"] == "recovery"
    )
    # slower than the stated window fails as well: the hit rate comes back 12 s after the fault
    late = [replace(r, cached_tokens=30) if 25 <= r.end < 37 else r for r in records]
    assert _failed(_report(late, events)) == {"recovery"}


def test_a_pool_that_fits_the_replicas_own_caches_fails() -> None:
    assert _failed(_report(*_timeline(), pool={**POOL, "chunks": 96})) == {"pool_overflows"}


def test_the_json_judges_itself_again(tmp_path: Path) -> None:
    """The verdict is computed from the report alone: a JSON written earlier can be checked."""
    records, events = _timeline()
    path = tmp_path / "soak.json"
    out = report(
        records,
        events,
        (WARM, WARM, []),
        120.0,
        {"faults": list(FAULTS)},
        POOL,
        BOUNDS,
        str(path),
        None,
        provenance("soak"),
    )
    again = json.loads(path.read_text())
    assert [c.ok for c in checks(again)] == [c["ok"] for c in out["verdict"]["checks"]]
    assert again["provenance"]["suite"] == "soak"


def test_warm_is_the_peak_under_load_before_the_first_fault() -> None:
    samples = [
        (0.0, {"r": 100}),
        (5.0, {"r": 150}),
        (9.9, {"r": 140}),
        (10.0, {"r": 400}),
        (20.0, {"r": 130, "x": 5}),
    ]
    warm, peak, series = rss_report(samples, first_fault=10.0)
    assert warm == {"r": 150} and peak == {"r": 400, "x": 5} and len(series) == 5
    # a process first seen after the first fault has no warm RSS, so no bound: it fails
    out = _report(*_timeline(), peak={**WARM, "x": 5 * MIB})
    assert "x: peak 5 MiB, never measured warm" in out["verdict"]["checks"][-2]["detail"]
