"""``cost`` in the simulator: the router's cost picker on simulated time, the connector's rule
in the fleet, the slow-tier fleet and the cost targets."""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh.cli import main
from kvmesh.routing.cost import CostPicker
from kvmesh.sim import PROFILES, FleetConfig, simulate
from kvmesh.sim.costpolicy import CostPolicy, cost_targets, slow_tier
from kvmesh.sim.fleet import Fleet
from kvmesh.sim.policies import make
from tests.unit.sim.test_policies import tenants_work
from tests.unit.sim.traces import write_trace

COST = PROFILES["h100-llama8b"]


def test_cost_drives_the_routers_cost_picker_and_learns_on_simulated_time() -> None:
    pol = make("cost", 100)
    assert isinstance(pol, CostPolicy) and isinstance(pol.picker, CostPicker)
    fleet = Fleet(FleetConfig(4, 100, cpu_blocks=200, shared_blocks=1000), COST, 512, pol)
    records = fleet.run(tenants_work())
    model = pol.picker.model
    assert sum(f.observations for f in model.fits.values()) == len(records)
    ledgers = [d["ledger"] for d in model.describe().values()]
    assert all(led["pending"] == 0 and led["in_flight"] == 0 for led in ledgers)
    assert pol.summary()["ttft_prediction_median_abs_error"] < 0.25
    # kvmesh replicas report their figures: the shared tier's rate is known before any load
    remote = model.describe()["r0"]["media"]["REMOTE"]
    assert abs(remote["load_tokens_per_s"] * COST.shared_load_s - 1) < 0.05


def test_cost_follows_the_prefix_and_serves_every_request() -> None:
    work = tenants_work()
    cost = simulate(work, "cost", FleetConfig(4, 100), COST)
    rr = simulate(work, "round-robin", FleetConfig(4, 100), COST)
    assert cost["requests"] == work.num_requests
    assert cost["hit_ratio"] > rr["hit_ratio"] + 0.2


def test_a_replica_recomputes_a_short_prefix_from_a_slow_shared_tier_and_loads_a_long_one() -> None:
    slow = slow_tier(COST)
    assert slow.worth_loading(0, 0, 512) == (0, 0, 0)  # 50 ms to load vs ~21 ms to compute
    assert slow.worth_loading(0, 0, 16_384) == (0, 0, 16_384)  # 0.26 s vs 0.68 s
    assert slow.worth_loading(1024, 0, 512) == (1024, 0, 0)  # the CPU part still loads
    assert COST.worth_loading(0, 0, 512) == (0, 0, 512)  # no latency: loading always wins here


def test_cost_targets_compare_with_llm_d_per_fleet() -> None:
    rows = [
        {"policy": "cost", "replicas": 16, "fleet": "kvmesh", "ttft_p50_s": 0.4, "ttft_p99_s": 2.0},
        {"policy": "llm-d", "replicas": 16, "fleet": "kvmesh", "ttft_p50_s": 1.0, "ttft_p99_s": 2.0},
        {"policy": "cost", "replicas": 16, "fleet": "plain", "ttft_p50_s": 0.4, "ttft_p99_s": 2.0},
    ]
    got = cost_targets(rows)
    assert got == {
        "16": {
            "kvmesh": {
                "ttft_p50_vs_llm_d": {"ratio": 0.4, "le_0_8": True},
                "ttft_p99_vs_llm_d": {"ratio": 1.0, "le_0_8": False},
            }
        }
    }


def test_sim_run_has_the_slow_tier_fleet_and_the_cost_targets(tmp_path: Path) -> None:
    reqs = [(i * 100, 512 * 5, 20, [(i % 4) * 100 + b for b in range(4)] + [10_000 + i]) for i in range(80)]
    trace = write_trace(tmp_path / "t.jsonl", reqs)
    out = tmp_path / "r.json"
    argv = ["sim", "run", "--trace", str(trace), "--replicas", "4", "--policies", "cost,llm-d"]
    argv += ["--fleets", "plain,kvmesh,slow-tier", "--gpu-blocks", "20", "--no-progress", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert {r["fleet"] for r in report["results"]} == {"plain", "kvmesh", "slow-tier"}
    assert set(report["cost_targets"]["4"]) == {"plain", "kvmesh", "slow-tier"}
