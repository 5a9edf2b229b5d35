"""``kvmesh sim``: validation against the measured bench router run, and a run end to end."""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh.cli import main

# The bench router run the vllm-cpu-tiny profile was fitted to (a later run is not it).
MEASURED = Path(__file__).resolve().parents[3] / "docs" / "bench" / "sim-calibration-router.json"


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
    trace = tmp_path / "t.jsonl"
    lines = []
    for i in range(120):
        tenant = i % 5
        ids = [tenant * 100 + b for b in range(6)] + [10_000 + i]
        lines.append(
            json.dumps({"timestamp": i * 150, "input_length": 512 * 7, "output_length": 20, "hash_ids": ids})
        )
    trace.write_text("\n".join(lines) + "\n")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["sim", "run", "--trace", str(trace), "--replicas", "4", "--policies", "kvmesh,round-robin,oracle"]
    argv += ["--gpu-blocks", "20", "--no-progress", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert {(r["policy"], r["fleet"]) for r in report["results"]} >= {
        ("kvmesh", "kvmesh"),
        ("round-robin", "plain"),
    }
    t = report["targets"]["4"]
    assert t["hit_vs_oracle"] > 0.9 and "ttft_p99_vs_best_other_on_plain" in t
    assert png.stat().st_size > 10_000
