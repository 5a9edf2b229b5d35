"""Pure parts of ``kvmesh bench router``: the targets, paired ratios and the default
workload's shape (no vLLM, no router processes)."""

from __future__ import annotations

from typing import Any, cast

from kvmesh.bench.common import groups
from kvmesh.bench.common.groups import Setup, aggregate
from kvmesh.bench.router import bench as router
from kvmesh.bench.router.bench import overhead_targets, paired_ratio, workload_targets


def _row(rt: str, policy: str, cache: str, p90: float) -> dict[str, object]:
    return {"router": rt, "policy": policy, "cache": cache, "hit_rate": 0.5, "ttft_p50_s": p90 / 2,
            "ttft_p90_s": p90, "requests_per_s": 1.0}  # fmt: skip


def test_paired_ratio_is_the_median_of_per_repeat_ratios() -> None:
    ours = [{"p": 1.0}, {"p": 2.0}, {"p": 3.0}]
    theirs = [{"p": 2.0}, {"p": 2.0}, {"p": 2.0}]
    # per repeat 0.5, 1.0, 1.5: the median pairs repeat i with repeat i, not medians with medians
    assert paired_ratio(ours, theirs, "p") == 1.0
    assert paired_ratio([{"p": 1.0}, {"p": 4.0}], [{"p": 4.0}, {"p": 1.0}], "p") == 2.125
    assert paired_ratio(ours, [{"p": None}], "p") is None
    assert paired_ratio([], theirs, "p") is None


def test_targets_pick_the_best_peer_of_any_replica_kind_and_of_plain_replicas() -> None:
    rows = [
        _row("vllm-router", "round_robin", "none", 4.0),
        _row("vllm-router", "cache_aware", "none", 2.0),
        _row("vllm-router", "kv_aware", "lmcache", 3.0),
        _row("vllm-router", "consistent_hash", "kvmesh", 1.0),  # best of any kind: kvmesh replicas
        {"router": "vllm-router", "policy": "random", "cache": "none", "error": "boom"},
        _row("kvmesh", "round-robin", "kvmesh", 0.1),  # not the kvmesh policy: ignored
        _row("kvmesh", "kvmesh", "kvmesh", 0.7),
        _row("kvmesh", "kvmesh", "none", 1.9),
    ]
    runs = {
        "kvmesh:kvmesh": [{"ttft_p90_s": 0.6}, {"ttft_p90_s": 0.8}],
        "vllm-router:consistent_hash+kvmesh": [{"ttft_p90_s": 1.0}, {"ttft_p90_s": 1.0}],
        "kvmesh:kvmesh+plain": [{"ttft_p90_s": 1.8}, {"ttft_p90_s": 2.0}],
        "vllm-router:cache_aware": [{"ttft_p90_s": 2.0}, {"ttft_p90_s": 2.0}],
    }
    t = workload_targets(rows, runs)
    over = t["kvmesh_over_best_vllm_router"]
    assert over["best"] == "vllm-router:consistent_hash+kvmesh"
    assert (over["ratio_of_medians"], over["median_paired_ratio"], over["met"]) == (0.7, 0.7, True)
    plain = t["kvmesh_router_plain_over_best_vllm_router_plain"]
    assert plain["best"] == "vllm-router:cache_aware"
    assert (plain["median_paired_ratio"], plain["target"], plain["met"]) == (0.95, 0.9, False)


def test_native_rows_keep_one_row_per_router_and_policy() -> None:
    rows = [_row("vllm-router", "kv_aware", "none", 1.0), _row("vllm-router", "kv_aware", "kvmesh", 1.0),
            _row("vllm-router", "kv_aware", "lmcache", 1.0), _row("kvmesh", "kvmesh", "none", 1.0),
            _row("kvmesh", "kvmesh", "kvmesh", 1.0)]  # fmt: skip
    kept = [(r["router"], r["cache"]) for r in router.native_rows(rows)]
    assert kept == [("vllm-router", "none"), ("kvmesh", "kvmesh")]


def test_targets_are_none_when_a_side_is_missing() -> None:
    t = workload_targets([_row("kvmesh", "kvmesh", "kvmesh", 0.7)], {})
    assert set(t.values()) == {None}


def test_overhead_target_takes_the_worst_shape_per_size() -> None:
    measured = {2000: {"shapes": {"a": {"added_ms_p50": 0.4}, "b": {"added_ms_p50": 2.5}}},
                32000: {"shapes": {"a": {"added_ms_p50": 4.0}}}}  # fmt: skip
    t = overhead_targets(measured)
    assert t["overhead_p50_2000"] == {"ms": 2.5, "target_ms": 2.0, "met": False}
    assert t["overhead_p50_32000"] == {"ms": 4.0, "target_ms": 5.0, "met": True}
    assert overhead_targets({})["overhead_p50_2000"] is None


def test_index_target_is_wall_clock() -> None:
    lookup = {"hit": {"cpu_p99_ms": 0.5, "wall_p99_ms": 1.4}, "miss": {"cpu_p99_ms": 0.3, "wall_p99_ms": 0.3}}
    assert router.index_target(lookup) == {"wall_p99_ms": 1.4, "target_ms": 1.0, "met": False}
    assert router.index_target(None) is None


def test_default_workload_params_keep_cache_pressure() -> None:
    # a tenant prefix is ~4 tokens per word; 2 replicas hold 2 x 40 x 128 tokens
    for quick in (True, False):
        p = router.params(quick)
        assert p.tenants * p.prefix_words * 4 > 2 * router.NUM_BLOCKS * 128
        assert p.arrival == "sessions"
    full = router.params(False)
    assert (full.tenants, full.users, full.turns, full.concurrency) == (12, 2, 3, 4)
    assert router.params(True).repeats == 1
    assert router.params(False, "turns", 600).prefix_words == 600


def test_aggregate_takes_medians_and_counts_failed_requests() -> None:
    setup = Setup("vllm-router", "kv_aware", "none")
    runs = [
        {"hit_rate": 0.2, "ttft_p50_s": 1.0, "ttft_p90_s": 3.0, "requests_per_s": 1.0, "errors": 0},
        {"hit_rate": 0.4, "ttft_p50_s": 2.0, "ttft_p90_s": 5.0, "requests_per_s": 3.0, "errors": 1},
        {"hit_rate": 0.3, "ttft_p50_s": 3.0, "ttft_p90_s": 4.0, "requests_per_s": 2.0, "errors": 0},
    ]
    row = aggregate(setup, runs)
    assert row == {"router": "vllm-router", "policy": "kv_aware", "cache": "none", "hit_rate": 0.3,
                   "ttft_p50_s": 2.0, "ttft_p90_s": 4.0, "requests_per_s": 2.0, "errors": 1}  # fmt: skip


def test_idle_miss_floor_splits_lone_first_turns_over_both_replicas() -> None:
    from kvmesh.router.testing import FakeVLLM

    fakes = [FakeVLLM("a").start(), FakeVLLM("b").start()]
    try:
        for f in fakes:
            f.delay_s = 0.03
        lines: list[str] = []
        floor = groups.measure_idle_miss(cast(Any, fakes), router.params(True), "kvmesh", lines.append)
        assert floor >= 0.03
        counts = [sum(path == "/v1/chat/completions" for path, _, _ in f.requests) for f in fakes]
        assert counts == [groups.IDLE_MISSES // 2] * 2
    finally:
        for f in fakes:
            f.stop()
