"""The simulator's policies: the router's own pickers and index, SGLang cache_aware, llm-d."""

from __future__ import annotations

import random

from kvmesh.index import BlockIndex
from kvmesh.routing.picker import Picker
from kvmesh.sim import PROFILES, FleetConfig, SimRequest, Workload, simulate
from kvmesh.sim.bound import bound
from kvmesh.sim.fleet import Fleet
from kvmesh.sim.policies import POLICIES, CacheAware, RouterPolicy, make

COST = PROFILES["h100-llama8b"]


def tenants_work(n_tenants: int = 4, users: int = 6, bt: int = 512) -> Workload:
    pairs = [(u, k) for u in range(users) for k in range(n_tenants)]
    random.Random(0).shuffle(pairs)  # no accidental tenant -> replica rhythm for round-robin
    reqs = []
    for i, (u, k) in enumerate(pairs):
        ids = (*range(1000 * k, 1000 * k + 8), 10**6 + 10 * u + k)
        reqs.append(SimRequest(0.3 * i, ids, len(ids) * bt + 50, 32, f"t{k}u{u}"))
    return Workload("tenants", bt, requests=tuple(reqs))


def test_router_policies_run_the_routers_picker_over_a_block_index_fed_by_events() -> None:
    pol = make("kvmesh", 100)
    assert (
        isinstance(pol, RouterPolicy) and isinstance(pol.picker, Picker) and isinstance(pol.index, BlockIndex)
    )
    fleet = Fleet(FleetConfig(4, 100), COST, 512, pol)
    fleet.run(tenants_work())
    stats = pol.index.stats()
    assert stats["stored_blocks"] > 0 and stats["replicas"] == 4 and stats["orphans"] == 0


def test_kvmesh_follows_the_prefix_where_round_robin_does_not() -> None:
    work = tenants_work()
    km = simulate(work, "kvmesh", FleetConfig(4, 100), COST)
    rr = simulate(work, "round-robin", FleetConfig(4, 100), COST)
    assert km["hit_ratio"] > rr["hit_ratio"] + 0.2
    assert km["hit_ratio"] >= 0.95 * bound(work, COST)["hit_ratio_max"]


def test_every_policy_serves_every_request() -> None:
    work = tenants_work(3, 3)
    for name in POLICIES:
        out = simulate(work, name, FleetConfig(3, 50, cpu_blocks=50, shared_blocks=200), COST)
        assert out["requests"] == work.num_requests, name


def test_cache_aware_keeps_a_prefix_on_its_replica_until_the_load_is_unbalanced() -> None:
    pol = CacheAware(tree_blocks=100, balance_abs=2, balance_rel=1.5)
    fleet = Fleet(FleetConfig(3, 100), COST, 512, pol)
    req = SimRequest(0.0, (1, 2, 3, 4), 4 * 512, 8)
    first = pol.route(req, 0.0)
    assert [pol.route(req, 0.0) for _ in range(2)] == [first, first]  # prefix match > threshold
    # now 3 in flight on `first` and 0 elsewhere: max - min > 2 and max > 1.5 x min
    assert pol.route(req, 0.0) != first
    assert fleet.replicas  # bound
