"""Block traces: FIEMAP of real files, records -> FTL rows, dense renumbering."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvmesh.storage.trace import OP_TRIM, OP_WRITE, compact, fiemap_path, records_to_trace


def test_fiemap_of_a_real_file(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_bytes(os.urandom(3 << 20))
    ext = fiemap_path(str(f))
    if ext is None:
        pytest.skip("this filesystem has no FIEMAP")
    assert sum(length for _, length in ext) >= 3 << 20
    assert all(phys % 4096 == 0 for phys, _ in ext)
    assert fiemap_path(str(tmp_path / "missing")) is None


def test_records_to_trace_pages_streams_and_trims() -> None:
    recs = [
        {"op": "write", "class": "tail", "start": 10.0, "extents": [[8192, 8192], [1 << 20, 100]]},
        {"op": "fsync", "start": 10.1},
        {"op": "delete", "start": 10.5, "extents": [[8192, 8192]]},
        {"op": "read", "start": 11.0, "extents": [[8192, 8192]]},
        {"op": "write", "class": "pinned", "extents": None},
    ]
    t = records_to_trace(recs, stream_of={"tail": 2})
    assert t.ops.tolist() == [OP_WRITE, OP_WRITE, OP_TRIM]
    assert t.lpns.tolist() == [2, 256, 2] and t.npages.tolist() == [2, 1, 2]
    assert t.streams.tolist() == [2, 2, 0]
    assert t.arrival_s.tolist() == pytest.approx([0.0, 0.0, 0.5])
    assert t.host_bytes_written() == 3 * 4096
    assert len(records_to_trace(recs, trims=False).ops) == 2
    assert len(records_to_trace(recs, reads=True).ops) == 4


def test_compact_keeps_reuse_and_drops_gaps() -> None:
    recs = [
        {"op": "write", "extents": [[10 << 30, 8192]]},
        {"op": "write", "extents": [[20 << 30, 4096]]},
        {"op": "write", "extents": [[10 << 30, 4096]]},  # rewrite of the first's first page
    ]
    t, pages = compact(records_to_trace(recs))
    assert pages == 3
    assert t.lpns.tolist() == [0, 2, 0] and t.npages.tolist() == [2, 1, 1]
    assert np.all(t.lpns + t.npages <= pages)


def test_ftl_cli_replays_a_segments_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvmesh.cli import main
    from tests.unit.tiers.test_segments import chunks, put, tier

    trace = tmp_path / "t.jsonl"
    t = tier(tmp_path / "d", slots=8, trace=trace)
    for s in range(12):  # 1.5 device fills: segments are reclaimed and trimmed
        put(t, chunks(15, s, ("tail", "store", "pinned")[s % 3]))
    t.close()
    out = tmp_path / "o.json"
    args = ["ftl", "replay", str(trace), "--fdp", "--device-bytes", str(16 << 20), "--blocks-per-ru", "1"]
    assert main([*args, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["dlwa"] == pytest.approx(1.0, abs=0.05)  # whole-unit trims: the drive barely copies
    assert res["host_pages"] > 0 and "write_p99_ms" in res
    assert main(["ftl", "validate"]) == 0  # 2^18 pages: 1,000+ blocks, the closed form holds
    assert "closed form" in capsys.readouterr().out
