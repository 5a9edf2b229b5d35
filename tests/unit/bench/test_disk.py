"""``kvmesh bench disk`` pieces on tiny inputs: workloads, one simulated cell per placement
(real engine, real files, the FTL), the TTFT load path, fio and the plots."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from kvmesh.bench.disk import bench as disk
from kvmesh.bench.disk.plot import plot
from kvmesh.storage.replay import conversation_requests, multi_tenant_requests


def test_workloads_keep_prefix_structure() -> None:
    conv = conversation_requests(5)
    assert all(r.dtype == np.uint32 for r in conv)
    assert np.array_equal(conv[0][:512], conv[1][:512])  # both start with block id 0
    mt = multi_tenant_requests(40)
    assert len(mt) == 40
    firsts = {bytes(r[:1500]) for r in mt}
    assert len(firsts) <= 8  # every conversation starts with one of the tenants' system prompts
    grown = [(a, b) for a in mt for b in mt if len(b) > len(a) and np.array_equal(b[: len(a)], a)]
    assert grown  # a later turn extends an earlier one


@pytest.mark.slow
@pytest.mark.parametrize("placement", disk.PLACEMENTS)
def test_sim_cell(placement: str, tmp_path: Path) -> None:
    row = disk.sim_cell("conversation", "back", 256, 0.9, placement, 8, str(tmp_path))
    assert row["host_mb"] > 0 and row["skipped"] == 0
    assert row["dlwa"] >= 1.0 and row["dlwa_steady"] >= 1.0
    assert row["sim_write_p99_ms"] >= row["sim_write_p50_ms"] > 0
    if placement == "hints":
        assert row["hints_accepted"] is not None
    if placement == "none":
        assert row["dlwa_no_trim"] >= 1.0


@pytest.mark.slow
def test_ttft_load_reads_every_full_chunk(tmp_path: Path) -> None:
    s, mb_s = disk.ttft_load("segments", str(tmp_path), tokens=600)  # 2 llama-8b chunks, 64 MiB
    assert 0 < s < 30 and mb_s > 0


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed (apt-get install fio)")
def test_fio_seq(tmp_path: Path) -> None:
    out = disk.fio_seq(str(tmp_path), 1 << 20, 4, sync_each=False)
    assert out["mb_s"] > 0


def test_plot(tmp_path: Path) -> None:
    rows = [
        {
            "trace": "conversation",
            "write_mode": "back",
            "chunk": 256,
            "util": u,
            "placement": p,
            "dlwa_steady": 1 + u,
            "dlwa_no_trim": 2 + u,
        }
        for u in (0.5, 0.9)
        for p in disk.PLACEMENTS
    ]
    real = [
        {"placement": p, "_lat": [0.001, 0.002, 0.01], "_puts": [(0.0, 0.001, 1), (0.1, 0.002, 2)]}
        for p in disk.PLACEMENTS
    ]
    plot(str(tmp_path / "p.png"), rows, real)
    assert (tmp_path / "p.png").stat().st_size > 10_000
