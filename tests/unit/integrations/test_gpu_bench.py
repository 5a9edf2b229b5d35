"""``kvmesh bench gpu`` / scripts/gpu_check.py on this machine: their page tensors are
vLLM's layouts, their checks run (on CPU tensors), and without CUDA they skip cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvmesh.bench.gpu import bench as gpu
from kvmesh.cli import main
from tests.unit.integrations.vllm_pages import DTYPES, vllm_layers

ROOT = Path(__file__).resolve().parents[3]


def test_layout_orders_are_vllms() -> None:
    assert {m.name: m.value for m in KVCacheLayout} == gpu.LAYOUT_ORDERS


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
@pytest.mark.parametrize("mla", [False, True])
def test_bench_pages_have_vllms_shapes_and_strides(layout: KVCacheLayout, mla: bool) -> None:
    heads, c = (1, 24) if mla else (2, 16)
    ours = gpu.make_pages(layout.name, 3, 5, heads, 16, c, "bfloat16", "cpu")
    theirs = vllm_layers(3, 5, 16, heads, c if mla else c // 2, DTYPES["bfloat16"], layout, mla=mla)
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert b.data_ptr() - theirs[0].data_ptr() == a.data_ptr() - ours[0].data_ptr()


def test_round_trip_checks_pass_on_cpu_tensors() -> None:
    results = gpu.check_round_trips(device="cpu")
    assert len(results) == 6 * 5 + 1 and all(r["exact"] for r in results)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA skip")
def test_bench_gpu_skips_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--quick", "--json", str(out)]) == 0
    assert "skipped: no CUDA device" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["skipped"] == "no CUDA device" and data["provenance"]["suite"] == "gpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA skip")
def test_gpu_check_script_imports_no_vllm() -> None:
    code = (
        "import runpy, sys; sys.argv = ['gpu_check.py', '--quick']\n"
        "try:\n runpy.run_path('scripts/gpu_check.py', run_name='__main__')\n"
        "except SystemExit as e: rc = e.code\n"
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')], 'vllm imported'\n"
        "assert rc == 0, rc\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "skipped: no CUDA device" in done.stdout


def _on_a_bare_gpu_machine(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``scripts/<script>`` with only torch, numpy, xxhash and msgpack importable (pydantic,
    zstandard, msgspec, blake3, yaml, numba and vLLM made unimportable), as on the GPU
    machines."""
    code = (
        "import sys, importlib.abc, runpy\n"
        "BLOCK = {'pydantic', 'zstandard', 'msgspec', 'blake3', 'vllm', 'yaml', 'numba', 'llvmlite'}\n"
        "class B(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in BLOCK:\n"
        "            raise ImportError(name + ' is not on a bare GPU machine')\n"
        "sys.meta_path.insert(0, B())\n"
        f"sys.argv = {[script, *args]!r}\n"
        f"runpy.run_path('scripts/{script}', run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )


def test_gpu_check_runs_on_a_bare_gpu_machine_without_cuda() -> None:
    """scripts/gpu_check.py on a bare GPU machine's imports: runs to completion, says no CUDA."""
    done = _on_a_bare_gpu_machine("gpu_check.py")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped: no CUDA device" in done.stdout


def test_gpu_copy_variants_runs_its_control_flow_on_cpu(tmp_path: Path) -> None:
    """scripts/gpu_copy_variants.py (the next GPU call's comparison of copy variants) on a
    bare GPU machine's imports, ``--device cpu``: every variant is checked bit for bit
    against the checkout's own path and found exact, and each is timed (the streams are
    no-ops here, so the figures mean nothing; a variant that is not exact exits 1)."""
    out = tmp_path / "variants.json"
    done = _on_a_bare_gpu_machine(
        "gpu_copy_variants.py", "--device", "cpu", "--pairs", "1", "--json", str(out)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["exact"] and all(v is True for v in data["exact"].values()), data["exact"]
    assert set(data["store"]) == {"v0", "v0_run", "groups2", "groups4"}
    assert set(data["retrieve"]) == {"v0", "groups2", "groups4", "groups8"}
    assert set(data["eight"]) == {"each", "queued", "double"}
    assert all(r["ms"] > 0 for part in ("store", "retrieve", "eight") for r in data[part].values())


def test_concurrent_savers_are_exact_on_cpu_tensors() -> None:
    """The savers' part on CPU tensors (the CUDA streams are no-ops): four threads saving
    different chunks of the same pages at once leave every slot exact."""
    out = gpu.check_concurrent_savers(device="cpu")
    assert out == {"savers": 4, "chunks": 12, "exact": 12, "errors": [], "ok": True}


def test_a_part_that_raises_is_reported_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's control flow with CUDA made to look present and each part stubbed (no GPU
    here): a part that raises is a missed target with its traceback in the output and the
    JSON, and the parts after it still run and are recorded."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in")

    def broken() -> dict[str, object]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu, "check_round_trips", lambda: [{"case": "kv-x", "exact": True}])
    monkeypatch.setattr(gpu, "check_pinning", broken)
    monkeypatch.setattr(gpu, "check_concurrent_savers", lambda: {"ok": True})
    monkeypatch.setattr(gpu, "bandwidth", lambda reps: {"store_ratio": 0.9, "retrieve_ratio": 0.85})
    overlap = {"tokens": 2000, "slowdown": 0.01, "save_s": 0.005}
    monkeypatch.setattr(gpu, "overlap", lambda reps: overlap)
    out = tmp_path / "gpu.json"
    assert gpu.run(quick=True, json_path=str(out)) == 1
    text = capsys.readouterr().out
    assert "pinning: FAILED" in text and "illegal memory access" in text
    assert "target pinned_in_pieces_error_cleared: MISSED" in text
    data = json.loads(out.read_text())
    assert "illegal memory access" in data["pinning"]["error"]
    assert data["targets"] == {
        "round_trips_exact": True,
        "pinned_in_pieces_error_cleared": False,
        "concurrent_savers_exact": True,
        "store_ratio>=0.8": True,
        "retrieve_ratio>=0.8": True,
        "slowdown<=5%": True,
    }
    assert data["overlap"] == overlap
