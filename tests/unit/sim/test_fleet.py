"""The fleet simulator's caches, tiers, queues and metrics, on hand-made workloads."""

from __future__ import annotations

import itertools

from kvmesh.sim import PROFILES, FleetConfig, SimRequest, Workload, simulate
from kvmesh.sim.bound import bound, violations
from kvmesh.sim.fleet import Fleet
from kvmesh.sim.policies import make

COST = PROFILES["h100-llama8b"]


def open_loop(*reqs: tuple[float, tuple[int, ...]], bt: int = 512) -> Workload:
    return Workload(
        "t",
        bt,
        requests=tuple(
            SimRequest(t, ids, len(ids) * bt + 100, 16, f"s{i}") for i, (t, ids) in enumerate(reqs)
        ),
    )


def test_a_repeated_prompt_hits_the_gpu_cache_and_gets_its_first_token_sooner() -> None:
    work = open_loop((0.0, (1, 2, 3, 4)), (10.0, (1, 2, 3, 4)))
    fleet = Fleet(FleetConfig(1, 100), COST, 512, make("round-robin", 100))
    first, second = sorted(fleet.run(work), key=lambda r: r.arrival_s)
    assert first.hit == (0, 0, 0, 0) and second.hit == (4 * 512, 0, 0, 0)
    assert second.ttft_s < first.ttft_s / 5


def test_lru_eviction_then_the_cpu_tier_serves_what_the_gpu_lost() -> None:
    work = open_loop((0.0, (1, 2)), (5.0, (3, 4)), (10.0, (1, 2)))
    plain = Fleet(FleetConfig(1, 2), COST, 512, make("round-robin", 2)).run(work)
    assert sorted(plain, key=lambda r: r.arrival_s)[2].hit == (0, 0, 0, 0)
    tiered = Fleet(FleetConfig(1, 2, cpu_blocks=10), COST, 512, make("round-robin", 2)).run(work)
    assert sorted(tiered, key=lambda r: r.arrival_s)[2].hit == (0, 2 * 512, 0, 0)


def test_the_shared_tier_serves_every_replica() -> None:
    work = open_loop((0.0, (1, 2, 3)), (5.0, (1, 2, 3)))
    recs = sorted(
        Fleet(FleetConfig(2, 10, shared_blocks=100), COST, 512, make("round-robin", 10)).run(work),
        key=lambda r: r.arrival_s,
    )
    assert recs[0].replica != recs[1].replica and recs[1].hit == (0, 0, 0, 3 * 512)


def test_one_replica_queues_prefills_in_arrival_order() -> None:
    work = open_loop(*[(0.0, (100 + i, 200 + i)) for i in range(4)])
    recs = sorted(
        Fleet(FleetConfig(1, 100), COST, 512, make("round-robin", 100)).run(work), key=lambda r: r.ttft_s
    )
    ttfts = [r.ttft_s for r in recs]
    one = COST.prefill_s(2 * 512 + 100, 0, 0, 0, 0)
    assert abs(ttfts[0] - one) < 1e-9 and all(b > a + 0.5 * one for a, b in itertools.pairwise(ttfts))


def test_closed_loop_sessions_send_the_next_turn_after_the_previous_one() -> None:
    turns = tuple(SimRequest(0.0, (1, 2, 3)[: k + 1], (k + 1) * 512 + 10, 8, "a") for k in range(3))
    work = Workload("c", 512, sessions=(turns, turns), concurrency=1)
    recs = Fleet(FleetConfig(1, 100), COST, 512, make("round-robin", 100)).run(work)
    assert len(recs) == 6
    for prev, nxt in itertools.pairwise(recs):
        assert nxt.arrival_s >= prev.done_s - 1e-9


def test_summary_and_the_infinite_cache() -> None:
    work = open_loop(*[(float(i), (1, 2, 3, 10 + i)) for i in range(20)])
    inf = simulate(work, "infinite-cache", FleetConfig(4, 2), COST)
    rr = simulate(work, "round-robin", FleetConfig(4, 2), COST)
    assert inf["requests"] == rr["requests"] == 20
    # every request after the first reuses 3 of its 4 blocks: the infinite cache has all of it,
    # which is the bound's ceiling here (requests a second apart: no prefill overlaps another)
    assert inf["hit_ratio"] == round(19 * 3 * 512 / sum(4 * 512 + 100 for _ in range(20)), 4)
    assert inf["hit_ratio"] == bound(work, COST)["hit_ratio_max"]
    assert rr["hit_ratio"] < inf["hit_ratio"]
    assert inf["imbalance_requests"] >= 1.0 and inf["ttft_p99_s"] >= inf["ttft_p50_s"]


def test_the_infinite_cache_is_no_ceiling_and_the_bound_is() -> None:
    """Two requests for one prefix 1 ms apart: infinite-cache places the second on the idle
    replica while the first is still computing the prefix, so it reuses nothing; kvmesh queues
    it behind the first and reuses all of it. The bound holds for both."""
    work = open_loop((0.0, (1, 2, 3, 4, 5, 6, 7, 8)), (0.001, (1, 2, 3, 4, 5, 6, 7, 8)))
    inf = simulate(work, "infinite-cache", FleetConfig(2, 100), COST)
    km = simulate(work, "kvmesh", FleetConfig(2, 100), COST)
    assert inf["hit_ratio"] == 0.0 < km["hit_ratio"]
    b = bound(work, COST)
    assert km["hit_ratio"] == b["hit_ratio_max"] and b["unique_blocks"] == 8
    assert violations([{**inf, "fleet": "plain"}, {**km, "fleet": "plain"}], b) == []
    # the floor of the second request's TTFT: all 8 blocks reusable, 100 tokens computed
    assert b["ttft_p50_s_min"] == round(COST.overhead_s + 100 / COST.prefill_tps, 4)


def test_a_mixed_fleets_slower_replica_prefills_at_its_own_rate() -> None:
    """slowdowns (1, 2): every other replica takes twice as long for the same prefill, and the
    cost policy's model is told each replica's own rate, as a real replica's meters would."""
    work = open_loop((0.0, (1, 2, 3)), (10.0, (4, 5, 6)))
    config = FleetConfig(2, 100, slowdowns=(1.0, 2.0))
    assert config.slowdown(0) == 1.0 and config.slowdown(3) == 2.0 and config.capacity() == 1.5
    recs = {r.replica: r for r in Fleet(config, COST, 512, make("round-robin", 100)).run(work)}
    one = COST.prefill_s(3 * 512 + 100, 0, 0, 0, 0)
    assert abs(recs[0].ttft_s - one) < 1e-9 and abs(recs[1].ttft_s - 2 * one) < 1e-9

    policy = make("cost", 100)
    Fleet(FleetConfig(2, 100, cpu_blocks=10, slowdowns=(1.0, 2.0)), COST, 512, policy)
    fits = policy.picker.model.fits  # type: ignore[union-attr]
    rate = {n: float(f.rls.theta[1]) for n, f in fits.items()}  # COMPUTE: seconds per 1k tokens
    assert 1.9 < rate["r1"] / rate["r0"] < 2.1  # a report is fused with the prior, not copied
