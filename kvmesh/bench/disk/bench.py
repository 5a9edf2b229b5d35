"""``kvmesh bench disk``: what the disk tier's writes do to an SSD, per placement.

Two phases, both replaying requests through a real :class:`~kvmesh.CacheEngine` with a
small CPU tier (so write-back evictions come in bursts):

1. **Simulated device** (the grid). The disk tier lives on a fresh ext4 of the simulated
   drive's size (a loop device over ``/dev/shm``: its FIEMAP extents are that drive's
   addresses); its I/O trace (class, extents, trims) is replayed through ``kvmesh ftl``
   (page-mapped, 7% over-provisioning, reclaim units of ``ru`` bytes; ``hints`` and
   ``segments`` get one reclaim-unit handle per lifetime level, as an FDP drive would).
   Per cell: host bytes written, DLWA (whole run and its second half), simulated write
   latency. ``none`` also gets a no-trim DLWA (a filesystem without online discard).
2. **This machine's disk**, one cell per placement (conversation trace, write-back, 256
   tokens, 90%), interleaved with ``fio`` sequential writes in the same directory: write
   throughput, per-chunk write latency p50/p99 (a put's time over its chunks), cold
   read-back latency of a hit (page cache dropped for that chunk only), and the TTFT that
   read-back implies for a 2,000-token prompt of llama-8b (128 KiB of KV per token).

The KV layout is shrunk (128 B per token, not llama-8b's 128 KiB) so hours of trace fit
in minutes; the ratios that drive flash GC — chunk : reclaim unit : drive — are kept
realistic (a 256-token chunk is 1/30 of a reclaim unit; the drive holds 64 of them).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from kvmesh.bench.common import fio
from kvmesh.bench.runner import print_table, provenance, write_json
from kvmesh.core.keys import KVLayout
from kvmesh.storage import ftl
from kvmesh.storage.replay import (
    GB,
    conversation_requests,
    loop_ext4,
    multi_tenant_requests,
    replay,
    usable_bytes,
)
from kvmesh.storage.trace import compact, load_trace
from kvmesh.tiers.placement import Placement

LAYOUT = KVLayout(2, 2, 8, "float16")  # 128 B per token
RU = 1 << 20
DEVICE = 64 << 20
CPU_BYTES = 4 << 20
PLACEMENTS = ("none", "hints", "segments")


def _requests(trace: str, n: int) -> list[np.ndarray]:
    return conversation_requests(n) if trace == "conversation" else multi_tenant_requests(n)


def _config(root: str, budget: int, chunk: int, mode: str, placement: str) -> dict[str, Any]:
    return {
        "chunk_size": chunk,
        "max_local_cpu_size": CPU_BYTES / GB,
        "local_disk": os.path.join(root, "kv"),
        "max_local_disk_size": budget / GB,
        "write_mode": mode,
        "disk_placement": placement,
        "disk_ru_size": RU,
        "max_pending_writes": 4096,
        "store_wait_s": 2.0,
    }


def _simulate(
    trace_path: str, placement: str, device_pages: int, compacted: bool, trims: bool = True
) -> dict[str, Any]:
    p = Placement(placement if placement != "none" else "none", RU)
    fdp = placement in ("hints", "segments")
    stream_of = {c: p.stream(c) for c in p.class_map} if fdp else None
    tr = load_trace(trace_path, stream_of=stream_of, trims=trims)
    pages = device_pages
    if compacted:
        tr, used = compact(tr)
        pages = max(used, device_pages)
    cfg = ftl.FTLConfig(
        logical_pages=max(pages, tr.max_page),
        overprovisioning=0.07,
        pages_per_block=64,
        blocks_per_ru=RU // (64 * 4096),
        streams=len(p.levels) if fdp else 1,
    )
    res = ftl.simulate(cfg, tr.ops, tr.lpns, tr.npages, tr.streams, tr.arrival_s)
    writes = tr.ops == 0
    host_cum = np.cumsum(np.where(writes, tr.npages, 0))
    half = int(np.searchsorted(host_cum, host_cum[-1] / 2)) if len(host_cum) else 0
    h2 = host_cum[-1] - host_cum[half] if len(host_cum) else 0
    steady = 1 + res.gc_copies_per_request[half + 1 :].sum() / h2 if h2 else 1.0
    s = res.summary(tr.ops)
    return {
        "dlwa": round(res.dlwa, 4),
        "dlwa_steady": round(float(steady), 4),
        "sim_write_p50_ms": round(s["write_p50_ms"], 3),
        "sim_write_p99_ms": round(s["write_p99_ms"], 3),
    }


def _host_bytes(trace_path: str) -> dict[str, int]:
    by_class: dict[str, int] = {}
    with open(trace_path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r.get("op") == "write":
                by_class[r.get("class", "store")] = by_class.get(r.get("class", "store"), 0) + int(
                    r.get("bytes", 0)
                )
    return by_class


def sim_cell(
    trace: str, mode: str, chunk: int, util: float, placement: str, n_req: int, work: str
) -> dict[str, Any]:
    reqs = _requests(trace, n_req)
    with loop_ext4(DEVICE) as mnt:
        root = mnt or tempfile.mkdtemp(dir=work)
        budget = int(util * (usable_bytes(root) if mnt else DEVICE))
        tpath = os.path.join(work, f"trace-{trace}-{mode}-{chunk}-{int(util * 100)}-{placement}.jsonl")
        if os.path.exists(tpath):
            os.unlink(tpath)
        res, _ = replay(reqs, _config(root, budget, chunk, mode, placement), LAYOUT, tpath)
        if not mnt:
            shutil.rmtree(root, ignore_errors=True)
    compacted = mnt is None and placement != "segments"
    row: dict[str, Any] = {
        "trace": trace,
        "write_mode": mode,
        "chunk": chunk,
        "util": util,
        "placement": placement,
    }
    by_class = _host_bytes(tpath)
    row["host_mb"] = round(sum(by_class.values()) / 2**20, 1)
    row["rewrite_mb"] = round(by_class.get("rewrite", 0) / 2**20, 1)
    row["device_fills"] = round(sum(by_class.values()) / DEVICE, 2)
    row.update(_simulate(tpath, placement, DEVICE // 4096, compacted))
    if placement == "none":
        row["dlwa_no_trim"] = _simulate(tpath, placement, DEVICE // 4096, compacted, trims=False)[
            "dlwa_steady"
        ]
    row["hit_ratio"] = round(res.hit_tokens / max(res.prompt_tokens, 1), 3)
    row["skipped"] = int(res.stats["disk"].get("skipped_stores", 0))
    row["lba_source"] = "loop-ext4" if mnt else "fiemap-compacted"
    row["hints_accepted"] = res.placement.get("hints_accepted")
    row["replay_s"] = round(res.seconds, 1)
    return row


def fio_seq(directory: str, bs: int, size_mb: int, sync_each: bool) -> dict[str, float]:
    """fio sequential write in ``directory`` (:mod:`kvmesh.bench.common.fio`): buffered with a
    final fsync (the disk's streaming limit) or with fdatasync after every ``bs`` write (the
    durable-per-chunk limit)."""
    r = fio.run_fio(directory, "write", bs, size_mb << 20, sync="fdatasync" if sync_each else "end")
    return {"mb_s": r.mb_s, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms}


def ttft_load(placement: str, directory: str, tokens: int = 2000) -> tuple[float, float]:
    """``(seconds, write MB/s)``: the cold load of a ``tokens``-token llama-8b prompt's KV
    (32 MiB chunks) from the disk tier — stored write-through (timed: the tier's write
    throughput at the real chunk size), dropped from cpu and from the page cache (per file
    / range), then ``retrieve``, the load path ``bench ttft`` measures."""
    from kvmesh.core.engine import CacheEngine
    from kvmesh.storage.replay import drop_cache

    layout = KVLayout(32, 8, 128, "bfloat16")
    root = tempfile.mkdtemp(prefix=f"kvmesh-ttft-{placement}-", dir=directory)
    cfg = {
        "chunk_size": 256,
        "max_local_cpu_size": 0.5,
        "local_disk": os.path.join(root, "kv"),
        "max_local_disk_size": 1.0,
        "disk_placement": placement,
        "disk_ru_size": 128 << 20,
    }
    toks = np.arange(tokens, dtype=np.uint32) + 11
    try:
        with CacheEngine(cfg, layout=layout, model_id="bench-ttft") as eng:
            w0 = time.perf_counter()
            eng.store_with(toks, lambda s, e, out: None)
            eng.wait_for_writes(120)
            write_s = time.perf_counter() - w0
            written = eng.stats()["disk"].get("bytes_in", 0)
            eng.clear("cpu", force=True)
            disk = eng.lower["disk"]
            for text in list(disk.keys()):  # type: ignore[attr-defined]
                drop_cache(disk, text)
            t0 = time.perf_counter()
            with eng.retrieve_chunks(toks) as got:
                n = got[-1].end if got else 0
            dt = time.perf_counter() - t0
            if n < tokens // 256 * 256:
                return float("nan"), float("nan")
            return dt, written / 2**20 / write_s
    finally:
        shutil.rmtree(root, ignore_errors=True)


def real_cell(
    placement: str, n_req: int, directory: str, read_back: int, ttft_tokens: int = 2000, big: int = 3
) -> dict[str, Any]:
    """One placement on this machine's disk: the replay's small chunks, then ``big`` stores
    (and cold loads) of a ``ttft_tokens``-token llama-8b prompt, their medians."""
    root = tempfile.mkdtemp(prefix=f"kvmesh-bench-disk-{placement}-", dir=directory)
    tpath = os.path.join(root, "trace.jsonl")
    try:
        res, lat = replay(
            _requests("conversation", n_req),
            _config(root, int(0.9 * DEVICE), 256, "back", placement),
            LAYOUT,
            tpath,
            read_back=read_back,
        )
        by_class = _host_bytes(tpath)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    per_chunk = np.array([d / n for _, d, n in res.puts for _ in range(n)]) if res.puts else np.zeros(1)
    put_s = sum(d for _, d, _ in res.puts)
    cold = float(np.median(lat)) if lat else float("nan")
    loads = [ttft_load(placement, directory, ttft_tokens) for _ in range(big)]
    load_s = float(np.median([s for s, _ in loads]))
    big_mb_s = float(np.median([mb for _, mb in loads]))
    return {
        "placement": placement,
        "host_mb": round(sum(by_class.values()) / 2**20, 1),
        "write_mb_s": round(sum(by_class.values()) / 2**20 / put_s, 1) if put_s else 0.0,
        "write_p50_ms": round(float(np.percentile(per_chunk, 50)) * 1e3, 3),
        "write_p99_ms": round(float(np.percentile(per_chunk, 99)) * 1e3, 3),
        "p99_over_p50": round(float(np.percentile(per_chunk, 99) / np.percentile(per_chunk, 50)), 2),
        "readback_p50_ms": round(cold * 1e3, 3),
        "implied_ttft_2000_ms": round(load_s * 1e3, 1),
        "write_mb_s_32mib": round(big_mb_s, 1),
        "hints": res.placement.get("hints_accepted"),
        "_lat": per_chunk.tolist(),
        "_puts": res.puts,
    }


def run(
    quick: bool = False,
    json_path: str | None = None,
    plot_path: str | None = None,
    directory: str | None = None,
    full: bool = False,
    rounds: int | None = None,
    smoke: bool = False,
) -> dict[str, Any]:
    prov = provenance("disk")  # the code this run measures: read now, the tree may move on
    n_conv, n_mt = (50, 1000) if quick else (150, 4000)
    rounds = rounds or (1 if quick else 2)
    work = tempfile.mkdtemp(prefix="kvmesh-bench-disk-")
    cells: list[tuple[str, str, int, float, str]] = []
    utils = (0.5, 0.9) if quick else (0.5, 0.7, 0.9)
    if full:
        cells = [
            (t, m, c, u, p)
            for t in ("conversation", "multi-tenant")
            for m in ("through", "back")
            for c in (128, 256, 512)
            for u in utils
            for p in PLACEMENTS
        ]
    else:
        cells = [("conversation", "back", 256, u, p) for u in utils for p in PLACEMENTS]
        if not quick:
            cells += [("conversation", "through", 256, 0.9, p) for p in PLACEMENTS]
            cells += [("conversation", "back", c, 0.9, p) for c in (128, 512) for p in PLACEMENTS]
            cells += [("multi-tenant", "back", 256, 0.9, p) for p in PLACEMENTS]
    # smoke: every code path once (a test): its numbers mean nothing
    fio_mb, ttft_tokens, read_back = (8, 256, 2) if smoke else (256, 2000, 20 if quick else 100)
    n_real = n_conv // 2
    if smoke:
        n_conv, rounds, cells = 6, 1, [("conversation", "back", 256, 0.9, p) for p in PLACEMENTS]
        n_real = 10  # enough to overflow the 4 MiB cpu tier: the write-back path runs too
    rows = []
    for t, m, c, u, p in cells:
        n = n_conv if t == "conversation" else n_mt
        rows.append(sim_cell(t, m, c, u, p, n, work))
        print(json.dumps(rows[-1]))
    directory = os.path.realpath(directory or os.path.join(os.getcwd(), ".cache"))
    os.makedirs(directory, exist_ok=True)
    real: list[dict[str, Any]] = []
    fio: list[dict[str, Any]] = []
    bs = -(-(256 * LAYOUT.bytes_per_token + 2048) // 4096) * 4096
    for _ in range(rounds):  # limits and placements interleaved, in one run
        limits = {
            "seq": fio_seq(directory, 1 << 20, fio_mb, False),
            "seq_sync_per_chunk": fio_seq(directory, bs, min(fio_mb, 32), True),
        }
        fio.append(limits)
        for p in PLACEMENTS:
            cell = real_cell(p, n_real, directory, read_back, ttft_tokens, big=1 if smoke else 3)
            real.append({**cell, **_vs_fio(cell, limits)})
    shutil.rmtree(work, ignore_errors=True)
    out = _summarise(rows, real, fio)
    print_table(
        rows,
        [
            "trace",
            "write_mode",
            "chunk",
            "util",
            "placement",
            "host_mb",
            "device_fills",
            "dlwa",
            "dlwa_steady",
            "dlwa_no_trim",
            "sim_write_p99_ms",
            "hit_ratio",
        ],
    )
    print_table(
        out["real"],
        [
            "placement",
            "write_mb_s",
            "vs_fio_seq",
            "write_p50_ms",
            "write_p99_ms",
            "p99_over_p50",
            "readback_p50_ms",
            "implied_ttft_2000_ms",
            "write_mb_s_32mib",
            "vs_fio_seq_32mib",
        ],
    )
    if plot_path:
        from kvmesh.bench.disk.plot import plot

        plot(plot_path, rows, real)
    if json_path:
        write_json(json_path, out, prov)
    return out


def _vs_fio(cell: dict[str, Any], limits: dict[str, dict[str, float]]) -> dict[str, float]:
    """A cell's write throughput against the fio runs of its own round (paired: the disk's
    speed drifts between rounds)."""
    seq, sync = limits["seq"]["mb_s"], limits["seq_sync_per_chunk"]["mb_s"]
    return {
        "vs_fio_seq": round(cell["write_mb_s"] / seq, 3),
        "vs_fio_seq_32mib": round(cell["write_mb_s_32mib"] / seq, 3),
        "vs_fio_sync_per_chunk": round(cell["write_mb_s"] / sync, 3),
    }


def _summarise(
    rows: list[dict[str, Any]], real: list[dict[str, Any]], fio: list[dict[str, Any]]
) -> dict[str, Any]:
    fio_mb = float(np.median([f["seq"]["mb_s"] for f in fio]))
    fio_sync = float(np.median([f["seq_sync_per_chunk"]["mb_s"] for f in fio]))
    med: list[dict[str, Any]] = []
    for p in PLACEMENTS:
        rs = [r for r in real if r["placement"] == p]
        m: dict[str, Any] = {
            k: round(float(np.median([r[k] for r in rs])), 3)
            for k in rs[0]
            if not k.startswith("_") and k not in ("placement", "hints")
        }
        m["placement"], m["hints"] = p, rs[0]["hints"]
        med.append(m)  # the vs_fio ratios: medians of each round's ratio to its own fio
    seg90 = [
        r for r in rows if r["placement"] == "segments" and r["util"] == 0.9 and r["trace"] == "conversation"
    ]
    seg_real = next(m for m in med if m["placement"] == "segments")
    targets = {
        "segments_dlwa_90_le_1.1": all(r["dlwa_steady"] <= 1.1 for r in seg90) if seg90 else None,
        "segments_write_ge_0.8x_fio_seq": seg_real["vs_fio_seq_32mib"] >= 0.8,
        "segments_write_ge_0.8x_fio_seq_small_chunks": seg_real["vs_fio_seq"] >= 0.8,
        "segments_p99_le_3x_median": seg_real["p99_over_p50"] <= 3.0,
    }
    runs = [{k: v for k, v in r.items() if not k.startswith("_")} for r in real]
    return {
        "grid": rows,
        "real": med,
        "real_runs": runs,
        "fio": fio,
        "fio_seq_mb_s": fio_mb,
        "fio_sync_per_chunk_mb_s": fio_sync,
        "targets": targets,
        "setup": {
            "layout_bytes_per_token": LAYOUT.bytes_per_token,
            "ru_bytes": RU,
            "device_bytes": DEVICE,
            "cpu_bytes": CPU_BYTES,
            "ftl": "page-mapped, greedy, 7% OP, 64 x 4 KiB pages/block",
        },
    }
