"""Sim workloads: the trace format, tiling, load scaling, the generator, bench router's shape."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from kvmesh.sim.workload import bench_router, generate, load_trace, tile, time_scale_for


def test_trace_keeps_full_blocks_only_and_sorts_by_arrival(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 2000, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 0, "input_length": 512, "output_length": 7, "hash_ids": [1]},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = load_trace(p)
    assert [r.arrival_s for r in w.requests] == [0.0, 2.0]
    assert w.requests[1].blocks == (1, 2) and w.requests[1].tokens == 1100  # the partial third is not cached
    t = tile(w, 3, time_scale=0.5)
    assert t.num_requests == 6 and t.requests[-1].arrival_s == 1.0
    assert len({r.blocks[0] for r in t.requests}) == 3  # each copy has its own ids
    assert abs(time_scale_for(w, 2, 0.5, 1e-3) - (1612 * 1e-3) / (0.5 * 2 * 2.0)) < 1e-12


def test_generator_shares_system_prompts_and_grows_turns() -> None:
    w = generate(
        tenants=2, users_per_tenant=3, turns=3, system_tokens=1024, turn_tokens=256, block_tokens=256
    )
    assert w.num_requests == 18
    by_user: dict[str, list[tuple[int, ...]]] = {}
    for r in sorted(w.requests, key=lambda r: r.arrival_s):
        by_user.setdefault(r.session or "", []).append(r.blocks)
    for turns in by_user.values():
        assert all(b[: len(a)] == a for a, b in itertools.pairwise(turns))  # each extends the last
    firsts = {t[0][:4] for t in by_user.values()}
    assert len(firsts) <= 2  # 4 system blocks: one chain per tenant


def test_bench_router_workload_shape() -> None:
    w = bench_router(str(Path(".cache/models/tiny")))
    assert w.concurrency == 4 and len(w.sessions) == 24 and w.num_requests == 72
    first = w.sessions[0]
    assert all(b.blocks[: len(a.blocks)] == a.blocks for a, b in itertools.pairwise(first))
    assert 900 < first[0].tokens < 1300
