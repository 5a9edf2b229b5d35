"""``kvmesh bench tiers``: what the fleet key costs the disk and Redis tiers.

The same chunks are put and got through three tiers that differ only in their chunk
format: no key (xxh3 checksums: the drop-in default), a keyed MAC (``fleet_key_file``), and
AEAD (``encrypt_at_rest``). The three are interleaved (disk: chunk by chunk; Redis: batch
by batch) in an order that rotates every round, and each round's ratio of an
authenticated time to the unauthenticated one is taken within the round, so the machine's
drift cancels; rows report the medians. Targets (issue #23): keyed MAC >= 0.95x and AEAD
>= 0.8x the unauthenticated throughput. Disk reads run with the page cache dropped where
this machine allows it, as the disk rows of the main table do.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from kvmesh.bench.runner import paired_ratios
from kvmesh.bench.tiers.bench import BenchMiss, Slots, Workload
from kvmesh.core.fleetkey import FleetKey
from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.core.serde import ChunkFormat
from kvmesh.harness.services import drop_page_cache
from kvmesh.tiers.base import ChunkData, Tier, TierOptions, open_tier

MODES = ("none", "mac", "aead")
TARGETS = {"mac": 0.95, "aead": 0.8}


def formats(layout: KVLayout) -> dict[str, ChunkFormat]:
    key = FleetKey([FleetKey.generate().encode()])
    return {
        "none": ChunkFormat(None, layout=layout),
        "mac": ChunkFormat(key, layout=layout),
        "aead": ChunkFormat(key, encrypt=True, layout=layout),
    }


def _rows(tier: str, nbytes: int, times: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    rows = []
    for op, by_mode in times.items():
        for mode in MODES:
            ratios = paired_ratios(by_mode["none"], by_mode[mode])  # unauth time / this time
            ratio = round(statistics.median(ratios), 3) if ratios else None
            target = TARGETS.get(mode)
            rows.append(
                {
                    "tier": tier,
                    "op": op,
                    "auth": mode,
                    "gbps": round(statistics.median(nbytes / t / 1e9 for t in by_mode[mode]), 3),
                    "ratio": ratio,
                    "target": target,
                    "meets": None if target is None or ratio is None else ratio >= target,
                    "repeats": len(ratios),
                }
            )
    return rows


def _checked(ok: bool, what: str) -> None:
    if not ok:
        raise BenchMiss(f"{what}: the timing would measure a skip")


def _one_round(
    tier: str,
    tiers: dict[str, Tier],
    work: dict[str, tuple[list[ChunkKey], list[ChunkData]]],
    order: tuple[str, ...],
    batches: list[list[int]],
    dest: Slots,
    drop: bool,
) -> dict[str, dict[str, float]]:
    """Seconds per op and mode: every batch put in ``order``, then (cache dropped) got."""
    spent = {op: dict.fromkeys(MODES, 0.0) for op in ("store", "retrieve")}
    for idx in batches:
        for m in order:
            keys, chunks = work[m]
            t0 = time.perf_counter()
            ok = tiers[m].put([keys[i] for i in idx], [chunks[i] for i in idx])
            spent["store"][m] += time.perf_counter() - t0
            _checked(all(ok), f"{tier} {m}: put")
    if drop:
        os.sync()
        drop_page_cache()
    for idx in batches:
        for m in order:
            keys = work[m][0]
            t0 = time.perf_counter()
            got = tiers[m].get([keys[i] for i in idx], into=dest.into)
            spent["retrieve"][m] += time.perf_counter() - t0
            _checked(all(g is not None for g in got), f"{tier} {m}: get")
    return spent


def bench_auth(
    tier: str,
    w: Workload,
    repeats: int,
    open_mode: Callable[[str, ChunkFormat], Tier],
    per_chunk: bool,
    drop: bool,
) -> list[dict[str, Any]]:
    """Rows for ``tier``: ``open_mode(mode, format)`` opens its tier in each mode; ``w`` is
    the main table's workload (its chunks; reads land in preallocated slots, as there)."""
    fmts = formats(w.layout)
    tiers = {m: open_mode(m, fmts[m]) for m in MODES}
    dest = Slots(w)
    batches = [[i] for i in range(w.n)] if per_chunk else [list(range(w.n))]
    times: dict[str, dict[str, list[float]]] = {op: {m: [] for m in MODES} for op in ("store", "retrieve")}
    try:
        for r in range(repeats + 1):
            order = MODES[r % 3 :] + MODES[: r % 3]
            work = {m: w.chunks(w.tokens()) for m in order}
            spent = _one_round(tier, tiers, work, order, batches, dest, drop)
            for m in order:
                tiers[m].delete(work[m][0])
            if r:  # round 0 is the warm-up
                for op, by_mode in spent.items():
                    for m, seconds in by_mode.items():
                        times[op][m].append(seconds)
    finally:
        for t in tiers.values():
            t.close()
    return _rows(tier, w.nbytes, times)


def bench_disk_auth(w: Workload, repeats: int, directory: str, chunk: int) -> list[dict[str, Any]]:
    def open_mode(mode: str, fmt: ChunkFormat) -> Tier:
        opts = TierOptions(name=f"disk-{mode}", chunk_size=chunk, chunk_format=fmt)
        return open_tier("file://" + os.path.join(directory, f"auth-{mode}"), opts)

    return bench_auth("disk", w, repeats, open_mode, per_chunk=True, drop=True)


def bench_redis_auth(w: Workload, repeats: int, url: str, chunk: int, part: int) -> list[dict[str, Any]]:
    def open_mode(mode: str, fmt: ChunkFormat) -> Tier:
        opts = TierOptions(name=f"redis-{mode}", chunk_size=chunk, part_bytes=part, chunk_format=fmt)
        return open_tier(url, opts)

    return bench_auth("redis", w, repeats, open_mode, per_chunk=False, drop=False)
