"""``kvmesh bench stall``'s summary, pure: paired ITL ratios and TTFT ratios by trial."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvmesh.bench.stall.bench import _spec, run, summarize


def _rec(mode: str, source: str, k: int, itl: float, alone: float, ttft: float) -> dict[str, Any]:
    loaded = {"itl_p99_s": itl, "itl_max_s": 2 * itl, "load_ttft_s": ttft, "load_cached_tokens": 1920}
    alone_ = {"itl_p99_s": alone, "itl_max_s": 2 * alone}
    return {"mode": mode, "source": source, "trial": k, "loaded": loaded, "alone": alone_}


def test_ratios_are_paired_by_trial_and_judged_against_their_targets() -> None:
    recs = []
    for k, drift in enumerate([1.0, 3.0, 2.0]):  # the machine drifts; the pairs do not
        recs += [
            _rec("async", "disk", k, 0.011 * drift, 0.010 * drift, 0.10 * drift),
            _rec("sync", "disk", k, 0.500 * drift, 0.010 * drift, 0.10 * drift),
            _rec("all", "disk", k, 0.011 * drift, 0.010 * drift, 0.05 * drift),
        ]
    recs.append({**_rec("sync", "disk", 9, 1, 1, 1), "loaded": {"error": "boom"}})  # a failed trial
    rows = {(r["mode"]): r for r in summarize(recs, ["disk"], ["async", "sync", "all"])}
    assert rows["async"]["itl_ratio_median"] == 1.1 and rows["async"]["itl_met"] is True
    assert rows["sync"]["itl_ratio_median"] == 50.0 and rows["sync"]["itl_met"] is False
    assert rows["async"]["ttft_vs_sync"] == 1.0 and rows["async"]["ttft_met"] is True
    assert rows["async"]["ttft_vs_all"] == 2.0
    assert rows["async"]["load_ttft_ms"] == 200.0 and rows["sync"]["itl_max_ms"] == 2000.0


def test_a_hung_redis_has_no_ttft_target() -> None:
    recs = [_rec("async", "redis_hung", 0, 0.01, 0.01, 2.0), _rec("sync", "redis_hung", 0, 2.0, 0.01, 2.5)]
    (row, _) = summarize(recs, ["redis_hung"])
    assert row["ttft_met"] is None and row["itl_met"] is True


def test_each_source_is_read_against_the_floor_of_its_mode_and_trial() -> None:
    """The floor (``vllm``: the prompt in vLLM's own cache, nothing loaded) of the same mode
    and trial divides each source's ITL p99; the floor has no such ratio of its own."""
    recs = []
    for k, drift in enumerate([1.0, 2.0, 4.0]):
        recs += [
            _rec("async", "vllm", k, 0.030 * drift, 0.010 * drift, 0.05),
            _rec("async", "disk", k, 0.033 * drift, 0.010 * drift, 0.09),
            _rec("tail", "vllm", k, 0.020 * drift, 0.010 * drift, 0.05),
            _rec("tail", "disk", k, 0.040 * drift, 0.010 * drift, 0.09),
        ]
    rows = {(r["source"], r["mode"]): r for r in summarize(recs, ["disk", "vllm"], ["async", "tail"])}
    assert rows[("disk", "async")]["itl_vs_floor"] == 1.1
    assert rows[("disk", "tail")]["itl_vs_floor"] == 2.0
    assert "itl_vs_floor" not in rows[("vllm", "async")]
    assert rows[("vllm", "async")]["itl_ratio_median"] == 3.0


def test_joined_modes_take_each_part_and_proc_is_paired_with_the_mode_without_it() -> None:
    spec = _spec("tail+proc", "m", "/w", "redis://x", 2000, 60)["kvmesh"]
    assert spec["save_unfull_chunk"] is True and spec["disk_read_process"] is True
    assert "async_loads" not in spec  # the default: asynchronous loads
    recs = []
    for k, drift in enumerate([1.0, 2.0, 4.0]):
        recs += [
            _rec("async", "disk", k, 0.03 * drift, 0.01 * drift, 0.10 * drift),
            _rec("proc", "disk", k, 0.03 * drift, 0.01 * drift, 0.08 * drift),
            _rec("tail", "disk", k, 0.03 * drift, 0.01 * drift, 0.05 * drift),
            _rec("tail+proc", "disk", k, 0.03 * drift, 0.01 * drift, 0.06 * drift),
        ]
    rows = {r["mode"]: r for r in summarize(recs, ["disk"], ["async", "proc", "tail", "tail+proc"])}
    assert rows["proc"]["ttft_vs_without_proc"] == 0.8  # against async
    assert rows["tail+proc"]["ttft_vs_without_proc"] == 1.2  # against tail
    assert "ttft_vs_without_proc" not in rows["tail"]


def test_unknown_mode_parts_are_refused() -> None:
    with pytest.raises(ValueError, match="joined by"):
        run(modes=["async", "tail+bogus"], sources=["disk"])


def test_a_run_that_fails_keeps_its_logs_says_where_and_drops_the_chunks(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker that never gets ready (a fake: the real one is a vLLM, fault injection here)
    fails the run; its work directory stays, named on stderr, without the disk tiers' chunks.
    A run that finishes removes it (the smoke run, ``tests/unit/bench/test_smoke.py``)."""
    from kvmesh.bench.stall import bench
    from kvmesh.errors import ProcessError

    class NeverReady:
        def __init__(self, setup: str, spec_path: str, log_path: str, *_: Any) -> None:
            self.setup, self.log_path = setup, log_path
            os.makedirs(os.path.join(os.path.dirname(spec_path), f"disk-{setup}"))  # as a worker's tier
            Path(log_path).write_text("engine core failed\n")

        def answer(self, timeout: float) -> dict[str, Any]:
            return {"ready": False}

        def stop(self) -> None:
            pass

    monkeypatch.setattr(bench, "REPO_ROOT", str(tmp_path))
    monkeypatch.setattr(bench, "Worker", NeverReady)
    (tmp_path / ".cache").mkdir()
    with pytest.raises(ProcessError, match="did not start"):
        run(quick=True, model_dir=str(tiny_model), sources=["disk"], modes=["async"], trials=1)
    (work,) = (tmp_path / ".cache").iterdir()
    assert sorted(p.name for p in work.iterdir()) == ["async.json", "async.log"]
    assert f"the workers' logs are kept in {work}" in capsys.readouterr().err
