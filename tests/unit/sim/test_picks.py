"""The vectorised scorers pick what the per-replica scorers picked.

``data/picks.json`` holds the replica every request went to under each router policy on
seeded workloads, recorded with the per-replica (dict) scorers before they were vectorised
(commit b039ddc), and recorded again when the simulator moved onto the routing core's
dispatcher (which, as the router always did, adds no speculative entry for a prompt whose
whole blocks the index already has on the picked replica's GPU; the lists were otherwise
equal). The ``cost`` policy's lists were recorded at d06b237, before its prediction stopped
computing every candidate's 14 features as one matrix, and recorded again when a replica's
own fit began to count only as far as its residuals show it differs from the fleet, and
when the work queued on a replica began to be priced at the fit's current coefficients,
and when the pooled fit's weight in a blend began to grow with its own evidence, and
when the fits began to hand out their estimates projected into their box in their
covariance's metric instead of clipped coordinate by coordinate (deliberate changes of its
decisions; the other policies' lists were unchanged). The fleet,
the index and the scorers are all deterministic, so any difference in one decision changes
what follows: equal lists mean equal decisions.
Re-record (only for a deliberate change of policy): ``python tests/unit/sim/test_picks.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvmesh.sim import PROFILES, FleetConfig, Workload, policies
from kvmesh.sim.fleet import Fleet
from kvmesh.sim.workload import generate

DATA = Path(__file__).parent / "data" / "picks.json"
COST = PROFILES["h100-llama8b"]
POLICIES = ("kvmesh", "llm-d", "least-loaded", "round-robin", "prefix", "cost")
FLEETS = {
    "plain": FleetConfig(24, 40),
    "tiers": FleetConfig(24, 40, cpu_blocks=60, shared_blocks=400),
    "wide": FleetConfig(130, 30, cpu_blocks=30, shared_blocks=300),  # masks over 64 bytes
}


def workloads() -> dict[str, Workload]:
    common = dict(tenants=12, users_per_tenant=10, turns=4, system_tokens=2048, turn_tokens=256, seed=3)
    # busy: queues decide most picks; light: the prefix does
    return {"busy": generate(rate_per_s=2000.0, **common), "light": generate(rate_per_s=40.0, **common)}  # type: ignore[arg-type]


def picks(policy: str, fleet: FleetConfig, work: Workload) -> list[int]:
    pol = policies.make(policy, tree_blocks=fleet.gpu_blocks)
    got: list[int] = []
    route = pol.route

    def recording(req: object, now: float) -> int:
        i = route(req, now)  # type: ignore[arg-type]
        got.append(i)
        return i

    pol.route = recording  # type: ignore[method-assign]
    Fleet(fleet, COST, work.block_tokens, pol, seed=1).run(work)
    return got


def cases() -> list[tuple[str, str, str]]:
    return [(w, f, p) for w in ("busy", "light") for f in FLEETS for p in POLICIES]


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[int]]:
    return json.loads(DATA.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def works() -> dict[str, Workload]:
    return workloads()


@pytest.mark.parametrize(("work", "fleet", "policy"), cases())
def test_picks_equal_the_recorded_ones(
    recorded: dict[str, list[int]], works: dict[str, Workload], work: str, fleet: str, policy: str
) -> None:
    want = recorded[f"{work}/{fleet}/{policy}"]
    got = picks(policy, FLEETS[fleet], works[work])
    assert len(got) == len(want)
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    assert first is None, f"decision {first} differs: {got[first]} != {want[first]}"


if __name__ == "__main__":
    ws = workloads()
    out = {f"{w}/{f}/{p}": picks(p, FLEETS[f], ws[w]) for w, f, p in cases()}
    DATA.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {len(out)} pick lists to {DATA}", file=sys.stderr)
