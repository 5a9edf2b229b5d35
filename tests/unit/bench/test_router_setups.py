"""The method of ``kvmesh bench router``: which setups run (the controls), the workloads
(default vs held out), seeds, interleaving order, and a whole round against fake replicas."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, cast

import pytest

from kvmesh.bench.common import groups
from kvmesh.bench.common.groups import Setup
from kvmesh.bench.common.peers import vllm_router_command
from kvmesh.bench.router import setups as rs


def test_every_vllm_router_policy_runs_over_plain_and_kvmesh_replicas() -> None:
    policies = {"random", "round_robin", "power_of_two", "cache_aware", "kv_aware", "consistent_hash",
                "sticky_least_loaded"}  # fmt: skip
    for cache in ("none", "kvmesh"):
        assert {s.policy for s in rs.SETUPS if s.router == "vllm-router" and s.cache == cache} == policies
    # the controls: the kvmesh router over plain replicas, and both routers over LMCache's
    assert Setup("kvmesh", "kvmesh", "none") in rs.SETUPS
    assert {s.policy for s in rs.SETUPS if s.cache == "lmcache"} >= {"kv_aware", "consistent_hash"}
    assert len(set(rs.SETUP_NAMES)) == len(rs.SETUPS)
    assert "kvmesh:kvmesh+plain" in rs.SETUP_NAMES and "vllm-router:kv_aware+kvmesh" in rs.SETUP_NAMES
    assert {g for phase in rs.PHASES for g in phase} == set(groups.GROUPS)


def test_session_policies_build_a_command_without_kv_events() -> None:
    for policy in ("consistent_hash", "sticky_least_loaded", "power_of_two", "random"):
        args = vllm_router_command("vr", 1, ["http://a", "http://b"], policy)
        assert args[args.index("--policy") + 1] == policy and "--kv-event-source" not in args


def test_select_setups_keeps_run_order_and_rejects_unknown() -> None:
    assert rs.select_setups(None) == list(rs.SETUPS)
    picked = rs.select_setups(["kvmesh:kvmesh", "vllm-router:round_robin"])
    assert [s.name for s in picked] == ["vllm-router:round_robin", "kvmesh:kvmesh"]
    with pytest.raises(ValueError, match=r"unknown setup.*valid: vllm-router:random"):
        rs.select_setups(["nope"])


def test_every_run_gets_its_own_seed_across_workloads_setups_and_repeats() -> None:
    specs = rs.workloads(False)
    seeds = [rs.run_seed(w, s, r) for w in specs for s in rs.SETUPS for r in range(5)]
    assert len(set(seeds)) == len(seeds)
    assert not set(seeds) & {groups.floor_seed(c) for c in groups.GROUPS}


def test_run_order_alternates_so_each_setup_runs_early_as_often_as_late() -> None:
    setups = list(rs.SETUPS[:4])
    assert rs.run_order(setups, 0, 0) == setups
    assert rs.run_order(setups, 0, 1) == setups[::-1]
    assert rs.run_order(setups, 1, 0) == setups[::-1]
    positions: Counter[tuple[Setup, int]] = Counter()
    for repeat in range(2):
        for wi in range(3):
            for pos, s in enumerate(rs.run_order(setups, repeat, wi)):
                positions[(s, pos)] += 1
    # over 2 repeats x 3 workloads (6 rounds, an even number) every setup holds each
    # position as often as the mirrored one
    for s in setups:
        for pos in range(len(setups)):
            assert positions[(s, pos)] == positions[(s, len(setups) - 1 - pos)]


def test_held_out_workloads_differ_in_shape_from_the_default() -> None:
    default, held, trace = rs.workloads(False)
    assert not default.held_out and held.held_out and trace.held_out
    assert held.seed_base != default.seed_base
    assert (held.tenants, held.users) != (default.tenants, default.users)
    assert held.arrival == "turns" and default.arrival == "sessions" and held.zipf and not default.zipf
    assert trace.kind == "trace"
    w = rs.build_workload(held, 7001)
    lengths = {len(c.system.split()) for c in w.conversations}
    assert len(lengths) > 1 and min(lengths) >= held.prefix_words  # per-tenant prompt lengths
    assert w.num_requests == rs.num_requests(held)


def test_a_round_over_fake_replicas_runs_every_workload(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FakeVLLM replicas stand in for vLLM (no engine here; they have no prefix cache to
    reset): checks the plumbing of one kvmesh-router run per workload, not any figure."""
    from kvmesh.router.testing import FakeVLLM, write_test_tokenizer

    monkeypatch.setattr(groups, "reset_prefix_caches", lambda urls: None)

    fakes = [FakeVLLM("a").start(), FakeVLLM("b").start()]
    tok = write_test_tokenizer(tmp_path / "tok")
    try:
        setup = Setup("kvmesh", "round-robin", "none")
        small = rs.WorkloadSpec("small", "synthetic", False, 1, 2, 1, 2, 20)
        trace = rs.WorkloadSpec("t", "trace", True, 2, conversations=3, rate=50.0)
        for spec in (small, trace):
            replicas = cast(Any, [type("R", (), {"url": f.url, "events_endpoint": None})() for f in fakes])
            out = rs.run_once(setup, spec, replicas, str(tok), str(tmp_path), seed=random.randrange(99))
            assert out["errors"] == 0 and out["requests"] == rs.num_requests(spec)
    finally:
        for f in fakes:
            f.stop()


def test_run_all_probes_capacity_only_in_phases_that_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A subset of setups leaves LMCache's phase empty: it must neither probe a capacity nor
    fail for want of one (it raised before), while the phase that runs gets its loads."""
    import contextlib

    from kvmesh.bench.router import costcases as cc

    probed: list[str] = []
    ran: list[tuple[str, str, int]] = []
    monkeypatch.setattr(rs, "_group", lambda cache, *a: contextlib.nullcontext([]))
    monkeypatch.setattr(groups, "idle_floors", lambda alive, params, log: {})

    def probe(replicas: Any, cache: str, *a: Any) -> cc.Capacity:
        probed.append(cache)
        return cc.Capacity(4.0, 8.0, 10.0)

    def once(setup: Setup, spec: Any, *a: Any) -> dict[str, Any]:
        ran.append((setup.name, spec.name, spec.concurrency))
        return {"hit_rate": 0.5, "ttft_p90_s": 0.1, "errors": 0}

    monkeypatch.setattr(rs, "measure_capacity", probe)
    monkeypatch.setattr(rs, "run_once", once)
    chosen = rs.select_setups(["kvmesh:cost", "kvmesh:kvmesh"])
    specs = cc.with_loads([s for s in rs.workloads(True) if s.name == "default"])
    runs, failed, _, capacity = rs.run_all(chosen, specs, 1, 40, "m", "w", lambda msg: None)
    assert all(len(r) == 1 for w in runs.values() for r in w.values())
    assert not failed and probed == ["kvmesh"] and list(capacity) == ["none+kvmesh"]
    assert sorted({(s, w, c) for s, w, c in ran}) == sorted(
        (s.name, w, c) for s in chosen for w, c in (("default@light", 1), ("default@heavy", 6))
    )
