"""Router index lookup latency with a large index (default 1M blocks), as wall-clock time
while events keep arriving.

Fills a :class:`~kvmesh.index.BlockIndex` with 2,000-token prompts, each stored as 125 GPU
blocks of 16 tokens and 15 CPU blocks of 128 tokens across 8 replicas (what vLLM's events
and kvmesh's tier events look like). Then an ingestion thread applies new prompts' events
(``ingest_rate`` batches a second, each one prompt's 140 blocks, evicting the oldest as the
index is full) while this thread times ``match`` for hits and misses: wall-clock
``perf_counter`` around each call, so time the lookup waits for the ingesting thread (the
index's lock, the interpreter lock) counts, as it does in the router, whose event
subscribers run beside its request handlers. Thread CPU time is reported beside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvmesh.bench.runner import percentile
from kvmesh.events import BlockStored, EventBatch
from kvmesh.index import BlockIndex


class _Prompts:
    """Events of random 2,000-token prompts; every prompt gets block hashes of its own."""

    def __init__(self, prompt_tokens: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n16, self.n128 = prompt_tokens // 16, prompt_tokens // 128
        self.prompt_tokens = prompt_tokens
        self.next_hash = 0
        self.count = 0

    def make(self) -> tuple[np.ndarray, str, EventBatch]:
        toks = self.rng.integers(0, 128_000, self.prompt_tokens)
        eh, n16, n128 = self.next_hash, self.n16, self.n128
        gpu = BlockStored(tuple(range(eh, eh + n16)), None, tuple(toks[: n16 * 16].tolist()), 16)
        cpu = BlockStored(tuple(range(eh + n16, eh + n16 + n128)), None, tuple(toks[: n128 * 128].tolist()),
                          128, medium="CPU")  # fmt: skip
        self.next_hash += n16 + n128
        self.count += 1
        return toks, f"r{self.count % 8}", EventBatch(0.0, (gpu, cpu))


def _timed(idx: BlockIndex, make: Callable[[int], np.ndarray], queries: int) -> dict[str, float]:
    wall, cpu_t = [], []
    for i in range(queries):
        q = make(i)
        c0, t0 = time.thread_time(), time.perf_counter()
        idx.match(q)
        wall.append(time.perf_counter() - t0)
        cpu_t.append(time.thread_time() - c0)
    w = [x * 1e3 for x in wall[queries // 10 :]]
    c = [x * 1e3 for x in cpu_t[queries // 10 :]]
    return {
        "wall_p50_ms": round(percentile(w, 50), 3),
        "wall_p99_ms": round(percentile(w, 99), 3),
        "wall_max_ms": round(max(w), 3),
        "cpu_p50_ms": round(percentile(c, 50), 3),
        "cpu_p99_ms": round(percentile(c, 99), 3),
    }


def run(
    blocks: int = 1_000_000, queries: int = 2000, prompt_tokens: int = 2000, ingest_rate: float = 200.0
) -> dict[str, Any]:
    """Fill, then time lookups under ingestion (``ingest_rate`` prompts' events a second;
    0: none, the index idle). Returns per kind (``hit``, ``miss``) wall and CPU p50/p99."""
    gen = _Prompts(prompt_tokens, seed=0)
    idx = BlockIndex(max_blocks=blocks)
    recent: list[np.ndarray] = []
    t_fill = time.perf_counter()
    while len(idx) < blocks:
        toks, rep, batch = gen.make()
        recent = [*recent[-1999:], toks]
        idx.apply(rep, batch)
    out: dict[str, Any] = {"blocks": len(idx), "fill_s": round(time.perf_counter() - t_fill, 2),
                           "ingest_rate_per_s": ingest_rate}  # fmt: skip
    # Hits on prompts the ingestion will not evict during the run (the newest of the fill).
    hits = list(recent)
    miss_rng = np.random.default_rng(1)
    stop = threading.Event()
    applied = [0]

    def ingest() -> None:
        period = 1.0 / ingest_rate
        nxt = time.perf_counter()
        while not stop.is_set():
            _, rep, batch = gen.make()
            idx.apply(rep, batch)
            applied[0] += 1
            nxt += period
            stop.wait(max(0.0, nxt - time.perf_counter()))

    thread = threading.Thread(target=ingest, name="index-ingest", daemon=True) if ingest_rate > 0 else None
    t0 = time.perf_counter()
    if thread:
        thread.start()
    try:
        makers: dict[str, Callable[[int], np.ndarray]] = {
            "hit": lambda i: hits[-1 - (i % len(hits))],
            "miss": lambda i: miss_rng.integers(0, 128_000, prompt_tokens),
        }
        for name, make in makers.items():
            out[name] = _timed(idx, make, queries)
    finally:
        stop.set()
        if thread:
            thread.join(5)
    elapsed = time.perf_counter() - t0
    out["ingested_batches"] = applied[0]
    out["ingested_per_s"] = round(applied[0] / elapsed, 1) if elapsed else 0.0
    out["blocks_after"] = len(idx)
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
