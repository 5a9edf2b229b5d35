"""``kvmesh bench router``'s cost additions: rows, offered loads from a measured capacity, the
slow-tier group, per-request predictions and the targets. FakeVLLM replicas stand in for
vLLM in the plumbing test (no engine here): it checks the runs, not any figure."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, cast

import pytest

from kvmesh.bench.common import groups
from kvmesh.bench.common.groups import Setup
from kvmesh.bench.router import costcases as cc
from kvmesh.bench.router import setups as rs
from kvmesh.routing.fit import FEATURES


def test_cost_runs_beside_every_setup_and_on_the_slow_tier() -> None:
    assert Setup("kvmesh", "cost", "none") in rs.SETUPS and Setup("kvmesh", "cost", "kvmesh") in rs.SETUPS
    assert {s for s in rs.SETUPS if s.cache == cc.SLOW} == set(cc.SLOW_SETUPS)
    assert (cc.SLOW,) in rs.PHASES and cc.SLOW in groups.GROUPS
    assert "kvmesh:cost+kvmesh-slow" in rs.SETUP_NAMES and "kvmesh:cost" in rs.SETUP_NAMES


def test_each_workload_runs_at_two_loads_with_texts_of_their_own() -> None:
    specs = cc.with_loads(rs.workloads(False))
    assert [s.name for s in specs] == [
        f"{w}@{load}" for w in ("default", "held-out", "trace") for load in cc.LOADS
    ]
    seeds = {rs.run_seed(s, setup, r) for s in specs for setup in rs.SETUPS for r in range(3)}
    assert len(seeds) == len(specs) * len(rs.SETUPS) * 3


def test_loads_follow_the_measured_capacity() -> None:
    specs = cc.with_loads(rs.workloads(False))
    # two replicas in parallel: saturated is twice one-at-a-time, so N½ = 1
    got = {s.name: s for s in cc.resolve(specs, cc.Capacity(one_at_a_time=4.0, saturated=8.0, trace=10.0))}
    assert got["default@light"].concurrency == 1
    assert got["default@heavy"].concurrency == 6  # X(6) = 8 * 6 / 7: 86% of capacity
    assert got["trace@light"].rate == pytest.approx(3.0) and got["trace@heavy"].rate == pytest.approx(8.5)
    faster = {s.name: s for s in cc.resolve(specs, cc.Capacity(4.0, 12.0, 10.0))}
    assert faster["held-out@heavy"].concurrency > got["held-out@heavy"].concurrency


def test_a_light_only_run_needs_no_capacity_and_unknown_loads_are_refused() -> None:
    specs = cc.with_loads(rs.workloads(True), ["light"])
    assert [s.name for s in specs] == ["default@light", "held-out@light", "trace@light"]
    assert [cc.needs_capacity(s) for s in specs] == [False, False, True]  # the trace's rate does
    synthetic = [s for s in specs if not cc.needs_capacity(s)]
    assert [s.concurrency for s in cc.resolve(synthetic, None)] == [1, 1]
    with pytest.raises(ValueError, match="measured capacity"):
        cc.resolve(specs, None)
    with pytest.raises(ValueError, match="unknown load"):
        cc.with_loads(specs, ["medium"])


def _rows(ratios: dict[str, float]) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    rows, runs = [], {}
    for name, (router, policy, cache) in {
        "kvmesh:cost": ("kvmesh", "cost", "kvmesh"),
        "kvmesh:kvmesh": ("kvmesh", "kvmesh", "kvmesh"),
        "vllm-router:round_robin+kvmesh": ("vllm-router", "round_robin", "kvmesh"),
        "kvmesh:kvmesh+kvmesh-slow": ("kvmesh", "kvmesh", cc.SLOW),
        "kvmesh:cost+kvmesh-slow": ("kvmesh", "cost", cc.SLOW),
    }.items():
        p90 = ratios[name]
        rows.append({"router": router, "policy": policy, "cache": cache, "ttft_p90_s": p90})
        runs[name] = [{"ttft_p90_s": p90, "prediction_error_median": 0.2 if policy == "cost" else None}] * 3
    return rows, runs


def test_targets_compare_cost_with_the_best_other_row_and_the_slow_tier() -> None:
    rows, runs = _rows({"kvmesh:cost": 0.3, "kvmesh:kvmesh": 0.5, "vllm-router:round_robin+kvmesh": 0.4,
                        "kvmesh:kvmesh+kvmesh-slow": 1.0, "kvmesh:cost+kvmesh-slow": 0.8})  # fmt: skip
    t = cc.cost_targets(rows, runs)
    best = t["cost_over_best_other_on_kvmesh"]
    assert (
        best["best"] == "vllm-router:round_robin+kvmesh"
        and best["median_paired_ratio"] == 0.75
        and best["met"]
    )
    slow = t["cost_over_kvmesh_on_slow_tier"]
    assert slow["median_paired_ratio"] == 0.8 and not slow["met"]
    assert t["prediction_error_median"] == {"value": 0.2, "target": 0.25, "met": True}


def test_capacity_cost_records_and_a_cost_run_over_fake_replicas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvmesh.router.testing import FakeVLLM, write_test_tokenizer

    monkeypatch.setattr(groups, "reset_prefix_caches", lambda urls: None)
    fakes = [FakeVLLM("a").start(), FakeVLLM("b").start()]
    for f in fakes:
        f.prefill_s_per_word = 0.00005
    tok = write_test_tokenizer(tmp_path / "tok")
    try:
        replicas = cast(Any, [type("R", (), {"url": f.url, "events_endpoint": None})() for f in fakes])
        small = rs.WorkloadSpec("small", "synthetic", False, 1, 2, 1, 2, 20)
        trace = rs.WorkloadSpec("t", "trace", True, 2, conversations=3, rate=50.0)
        cap = cc.measure_capacity(replicas, "none", [small, trace], str(tok), str(tmp_path), print)
        assert cap.one_at_a_time > 0 and cap.saturated > 0 and cap.trace > 0
        # the trace alone: its capacity is measured with the default workload's shape
        alone = cc.measure_capacity(replicas, "none", [trace], str(tok), str(tmp_path), print)
        assert alone.one_at_a_time > 0 and alone.trace > 0
        spec = cc.resolve(cc.with_loads([small]), cap)[1]
        out = rs.run_once(
            Setup("kvmesh", "cost", "none"), spec, replicas, str(tok), str(tmp_path), random.randrange(99)
        )
        # every streamed request (the router warm-ups are not streamed: no TTFT to learn from)
        assert out["errors"] == 0 and len(out["cost_records"]) == rs.num_requests(spec)
        assert all(r["predicted_s"] > 0 and r["observed_s"] > 0 for r in out["cost_records"])
        # each record has what the prediction was made from: its features and when it was sent
        assert all(r["features"]["base"] == 1.0 and r["sent_s"] >= 0 for r in out["cost_records"])
        assert all(set(r["features"]) <= set(FEATURES) for r in out["cost_records"])
    finally:
        for f in fakes:
            f.stop()
