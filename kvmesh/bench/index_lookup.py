"""Router index lookup latency with a large index (default 1M blocks).

Fills a :class:`~kvmesh.index.BlockIndex` with 2,000-token prompts, each stored as 125 GPU
blocks of 16 tokens and 15 CPU blocks of 128 tokens across 8 replicas (what vLLM's events
and kvmesh's tier events look like), then times ``match`` for hits and misses. Reports
wall-clock and thread CPU time: on a loaded 2-core machine the wall tail is other
processes' preemption, the CPU time is the index's own cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvmesh.bench.stats import percentile
from kvmesh.events import BlockStored, EventBatch
from kvmesh.index import BlockIndex


def run(blocks: int = 1_000_000, queries: int = 2000, prompt_tokens: int = 2000) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    idx = BlockIndex(max_blocks=blocks)
    recent: list[np.ndarray] = []
    eh = 0
    n16, n128 = prompt_tokens // 16, prompt_tokens // 128
    t_fill = time.perf_counter()
    while len(idx) < blocks:
        toks = rng.integers(0, 128_000, prompt_tokens)
        recent = [*recent[-1999:], toks]
        rep = f"r{eh % 8}"
        gpu = BlockStored(tuple(range(eh, eh + n16)), None, tuple(toks[: n16 * 16].tolist()), 16)
        cpu = BlockStored(
            tuple(range(eh + n16, eh + n16 + n128)),
            None,
            tuple(toks[: n128 * 128].tolist()),
            128,
            medium="CPU",
        )
        idx.apply(rep, EventBatch(0.0, (gpu, cpu)))
        eh += n16 + n128
    fill_s = time.perf_counter() - t_fill
    out: dict[str, Any] = {"blocks": len(idx), "fill_s": round(fill_s, 2)}
    makers: dict[str, Callable[[int], np.ndarray]] = {
        "hit": lambda i: recent[i % len(recent)],
        "miss": lambda i: rng.integers(0, 128_000, prompt_tokens),
    }
    for name, make in makers.items():
        wall, cpu_t = [], []
        for i in range(queries):
            q = make(i)
            c0, t0 = time.thread_time(), time.perf_counter()
            idx.match(q)
            wall.append(time.perf_counter() - t0)
            cpu_t.append(time.thread_time() - c0)
        w = [x * 1e3 for x in wall[queries // 10 :]]
        c = [x * 1e3 for x in cpu_t[queries // 10 :]]
        out[name] = {
            "wall_p50_ms": round(percentile(w, 50), 3),
            "wall_p99_ms": round(percentile(w, 99), 3),
            "cpu_p50_ms": round(percentile(c, 50), 3),
            "cpu_p99_ms": round(percentile(c, 99), 3),
        }
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
