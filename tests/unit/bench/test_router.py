"""Pure parts of ``kvmesh bench router`` (no vLLM, no router processes)."""

from __future__ import annotations

import pytest

from kvmesh.bench import groups, router
from kvmesh.bench.groups import Setup, aggregate
from kvmesh.bench.router import SETUP_NAMES, SETUPS, compute_targets, run_seed


def _row(rt: str, policy: str, cache: str, hit: float, p90: float) -> dict[str, object]:
    return {"router": rt, "policy": policy, "cache": cache, "hit_rate": hit, "ttft_p50_s": p90 / 2,
            "ttft_p90_s": p90, "requests_per_s": 1.0}  # fmt: skip


def test_setups_cover_the_brief_in_group_order() -> None:
    assert [(s.router, s.policy, s.cache) for s in SETUPS] == [
        ("vllm-router", "round_robin", "none"),
        ("vllm-router", "cache_aware", "none"),
        ("vllm-router", "kv_aware", "none"),
        ("vllm-router", "kv_aware", "lmcache"),
        ("kvmesh", "round-robin", "kvmesh"),
        ("kvmesh", "kvmesh", "kvmesh"),
    ]
    assert len(set(SETUP_NAMES)) == len(SETUPS)
    caches = [s.cache for s in SETUPS]
    assert caches == sorted(caches, key=groups.GROUPS.index)  # each group's setups run together


def test_select_setups_keeps_run_order_and_rejects_unknown() -> None:
    assert router.select_setups(None) == list(SETUPS)
    picked = router.select_setups(["kvmesh:kvmesh", "vllm-router:round_robin"])
    assert [s.name for s in picked] == ["vllm-router:round_robin", "kvmesh:kvmesh"]
    with pytest.raises(ValueError, match=r"unknown setup.*valid: vllm-router:round_robin"):
        router.select_setups(["nope"])


def test_every_run_gets_its_own_seed() -> None:
    seeds = {run_seed(s, r) for s in SETUPS for r in range(5)}
    assert len(seeds) == len(SETUPS) * 5


def test_quick_keeps_cache_pressure() -> None:
    # a tenant prefix is ~4 tokens per word; 2 replicas hold 2 x 40 x 128 tokens
    for quick in (True, False):
        p = router.params(quick)
        assert p.tenants * p.prefix_words * 4 > 2 * router.NUM_BLOCKS * 128
        assert p.arrival == "sessions"
    full = router.params(False)
    assert (full.tenants, full.users, full.turns, full.concurrency) == (12, 2, 3, 4)
    assert router.params(True).repeats == 1
    assert router.params(False, "turns", 600).prefix_words == 600
    assert router.params(False, "turns", 600).arrival == "turns"


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


def test_aggregate_of_runs_without_a_success_is_an_error() -> None:
    row = aggregate(SETUPS[0], [{"ttft_p50_s": None, "errors": 3, "error": "HTTP 503: busy"}])
    assert row == {
        "router": "vllm-router",
        "policy": "round_robin",
        "cache": "none",
        "error": "HTTP 503: busy",
    }


def test_targets_compare_kvmesh_with_the_best_vllm_router_setup() -> None:
    results = [
        _row("vllm-router", "round_robin", "none", 0.1, 4.0),
        _row("vllm-router", "kv_aware", "none", 0.5, 2.0),
        _row("vllm-router", "kv_aware", "lmcache", 0.6, 3.0),
        {"router": "vllm-router", "policy": "cache_aware", "cache": "none", "error": "boom"},
        _row("kvmesh", "round-robin", "kvmesh", 0.9, 0.1),  # not the kvmesh policy: ignored
        _row("kvmesh", "kvmesh", "kvmesh", 0.7, 1.5),
    ]
    t = compute_targets(results, overhead_ms=1.2, index_p99_ms=1.5)
    assert t == {
        "ttft_p90_kvmesh_over_best_vllm_router": 0.75,
        "ttft_p90_ratio_le_0_8": True,
        "hit_rate_kvmesh_ge_best_vllm_router": True,
        "overhead_le_2ms": True,
        "index_p99_le_1ms": False,
    }


def test_targets_are_none_when_a_side_is_missing() -> None:
    t = compute_targets([_row("kvmesh", "kvmesh", "kvmesh", 0.7, 1.5)], None, None)
    assert set(t.values()) == {None}


def test_overhead_and_index_summaries() -> None:
    shapes = {"a": {"added_ms_median": 0.4}, "b": {"added_ms_median": 1.1}}
    assert router.overhead_from({"shapes": shapes}) == 1.1
    lookup = {"hit": {"cpu_p99_ms": 0.5, "wall_p99_ms": 4.0}, "miss": {"cpu_p99_ms": 0.3, "wall_p99_ms": 0.3}}
    assert router.index_p99_from(lookup) == 0.5


def test_idle_miss_floor_splits_lone_first_turns_over_both_replicas() -> None:
    from typing import Any, cast

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
        assert lines and "idle-miss TTFT" in lines[0]
    finally:
        for f in fakes:
            f.stop()


def test_idle_miss_prompts_differ_by_group_and_from_every_run() -> None:
    seeds = {groups.floor_seed(c) for c in groups.GROUPS}
    assert len(seeds) == len(groups.GROUPS)
    assert not seeds & {run_seed(s, r) for s in SETUPS for r in range(10)}
