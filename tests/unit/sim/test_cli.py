"""``kvmesh sim``: validation against the measured bench router run, and a run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.cli import main
from tests.unit.sim.traces import write_trace

# The bench router run the vllm-cpu-tiny profile was fitted to (a later run is not it).
MEASURED = Path(__file__).resolve().parents[3] / "docs" / "history" / "sim-calibration-router.json"


def test_validate_matches_the_measured_two_replica_run(tmp_path: Path, tiny_model: Path) -> None:
    assert MEASURED.exists(), f"{MEASURED} (the calibration bench router run) is part of the repository"
    out = tmp_path / "v.json"
    rc = main(["sim", "validate", "--model", str(tiny_model), "--repeats", "7", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {r["setup"] for r in rows} == {"kvmesh:kvmesh", "kvmesh:round-robin", "vllm-router:round_robin"}
    for r in rows:
        assert abs(r["hit_diff"]) <= 0.05, r
        assert 0.75 <= r["ttft_p90_ratio"] <= 1.25, r
    assert rc == 0


def test_run_writes_results_targets_and_a_plot(tmp_path: Path) -> None:
    reqs = [(i * 150, 512 * 7, 20, [i % 5 * 100 + b for b in range(6)] + [10_000 + i]) for i in range(120)]
    trace = write_trace(tmp_path / "t.jsonl", reqs)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["sim", "run", "--trace", str(trace), "--replicas", "4", "--policies"]
    argv += ["kvmesh,round-robin,least-loaded,infinite-cache", "--gpu-blocks", "20", "--cpu-blocks", "10"]
    argv += ["--no-progress", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["provenance"]["commit"] and report["provenance"]["suite"] == "sim run"
    assert "commit" not in report  # only the runner's provenance, never a label of its own
    rows = {(r["policy"], r["fleet"]): r for r in report["results"]}
    assert set(rows) >= {("kvmesh", "kvmesh"), ("kvmesh", "plain"), ("round-robin", "plain")}
    # The shared tier is half the trace's working set (5 tenants x 6 blocks + 120 own ones),
    # and both sizes are in the JSON.
    assert report["config"]["unique_blocks"] == 150 and report["config"]["shared_blocks"] == 75
    t = report["targets"]["4"]
    # Like for like: each fleet's kvmesh row against the best other policy on that same fleet.
    for fleet in ("plain", "kvmesh"):
        vs = t[f"ttft_p99_vs_best_other_on_{fleet}"]
        assert vs["kvmesh_ttft_p99_s"] == rows[("kvmesh", fleet)]["ttft_p99_s"]
        assert vs["best"] in ("round-robin", "least-loaded")
        assert vs["best_ttft_p99_s"] == min(
            rows[(p, fleet)]["ttft_p99_s"] for p in ("round-robin", "least-loaded")
        )
        hit = t[f"hit_vs_bound_on_{fleet}"]
        assert hit["kvmesh"] == rows[("kvmesh", fleet)]["hit_ratio"] <= hit["bound"]
    # No policy beats the bound: its ceiling is (840 - 150) blocks of 512 over the prompts.
    b = report["bounds"]["4"]
    assert (
        b["hit_ratio_max"] == round((840 - 150) * 512 / (120 * 512 * 7), 4)
        and report["bound_violations"] == {}
    )
    assert all(r["hit_ratio"] <= b["hit_ratio_max"] for r in report["results"])
    assert png.stat().st_size > 10_000


def test_speed_records_its_provenance_and_takes_no_hand_typed_commit(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["sim", "speed", "--commit", "abc1234"])


@pytest.mark.parametrize("bad", ["0", "0.5", "nan", "1,x", "1,,2", "-1", "1e9"])
def test_run_refuses_a_bad_slowdowns_list(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["sim", "run", "--slowdowns", bad, "--limit", "10"])
    assert exc.value.code == 2 and "slowdown" in capsys.readouterr().err


def test_run_on_a_mixed_fleet_records_its_slowdowns(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [(i * 200, 2048, 8, [i % 3, 100 + i]) for i in range(30)])
    out = tmp_path / "m.json"
    argv = ["sim", "run", "--trace", str(trace), "--replicas", "2", "--policies", "cost,round-robin"]
    argv += ["--fleets", "plain", "--slowdowns", "1,2", "--no-progress", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["config"]["slowdowns"] == [1.0, 2.0]
    assert {r["policy"] for r in report["results"]} == {"cost", "round-robin"}


_PLACEMENTS = """
import sys
from kvmesh.sim import policies
from kvmesh.sim.cost import PROFILES
from kvmesh.sim.fleet import Fleet, FleetConfig
from kvmesh.sim.workload import load_trace
work = load_trace(sys.argv[1])
for name in ("kvmesh", "llm-d", "cost"):
    pol = policies.make(name, tree_blocks=6)
    records = Fleet(FleetConfig(16, 6), PROFILES["vllm-cpu-tiny"], work.block_tokens, pol).run(work)
    print(name, [r.replica for r in records])
"""


def test_prompts_shorter_than_a_block_are_placed_alike_in_every_process(tmp_path: Path) -> None:
    """A prompt shorter than a block has no block to key its ties by. It was keyed by
    ``hash(session)``: None's hash is its address in Python 3.11 (a str's changes with
    PYTHONHASHSEED), so every process broke those ties its own way, and the Mooncake
    long-context trace (1,107 such prompts of 3,993) gave other figures in every run. Two processes
    with different hash seeds must place every request alike (with the old key, on 16 idle
    replicas, they agreed by chance one time in 16)."""
    import os
    import subprocess
    import sys

    reqs = [(i * 500, 100 + i, 8, []) if i % 2 else (i * 500, 512 * 2, 8, [i, 1000 + i]) for i in range(40)]
    trace = write_trace(tmp_path / "t.jsonl", reqs)
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", _PLACEMENTS, str(trace)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        outs.append(run.stdout)
    assert outs[0] == outs[1] and outs[0].count("[") == 3
