#!/usr/bin/env python3
"""A cold disk read beside a Python-heavy "step" loop, read by the disk tier in its own
process (its eight I/O threads, the GIL shared with the step) or by its reader process
(``disk_read_process``, kvmesh.tiers.diskproc), interleaved, every other trial in reverse
order. Out of vLLM: the step thread stands for vLLM-CPU's forward loop on core 0, the reads
run on core 1 (where the vLLM worker puts kvmesh's threads); ``--spinner`` adds a process
busy-polling on core 1, as vLLM's engine core does. Prints the medians: the read's time and
the steps' time while it runs (docs/datapath.md quotes a run).

    python scripts/io_process_experiment.py [--trials 24] [--spinner]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvmesh.core import serde
from kvmesh.core.keys import KeyBuilder, KVLayout
from kvmesh.integrations.vllm.asyncload import GIL_SHARE
from kvmesh.tiers.base import ChunkData, TierOptions
from kvmesh.tiers.disk import DiskTier

LAYOUT = KVLayout(6, 2, 64, "float32")  # the bench model's: 768 KiB per 128-token chunk
CHUNK = 128
N = 15  # 1,920 tokens: a 2,000-token prompt's whole chunks
SLOT = LAYOUT.bytes_per_token * CHUNK
SPIN = (  # a busy-polling process on core 1
    "import os\nos.sched_setaffinity(0, {1})\n"
    "while True:\n    [0 for _ in range(1000)]\n    os.sched_yield()\n"
)


def fake_step() -> None:
    """~4 ms of dict churn and small numpy ops (busy Python, like a step's glue)."""
    d = {}
    for i in range(15000):
        d[i] = (i, str(i))
    a = np.ones(64)
    for _ in range(600):
        a = a * 1.0001 + 1


def on_core(core: int, fn: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        os.sched_setaffinity(0, {core})
        fn()

    return threading.Thread(target=run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--spinner", action="store_true", help="a process busy-polling on core 1")
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs two cores")
    os.sched_setaffinity(0, {0})
    keys_b = KeyBuilder("exp", LAYOUT, CHUNK)
    toks = np.arange(N * CHUNK + 80, dtype=np.int64) + 17
    keys = keys_b.keys(toks)[:N]
    rng = np.random.default_rng(0)
    tiers: dict[str, DiskTier] = {}
    root = tempfile.mkdtemp(prefix="kvm-ioexp-", dir="/var/tmp")
    fmt = serde.ChunkFormat(None, False, LAYOUT)

    def open_both() -> None:  # on core 1, so the tiers' I/O threads start there
        for name, proc in (("inproc", False), ("child", True)):
            opts = TierOptions(name=name, chunk_size=CHUNK, chunk_format=fmt, read_process=proc)
            tiers[name] = DiskTier(os.path.join(root, name), opts)

    t = on_core(1, open_both)
    t.start()
    t.join()
    reader = tiers["child"]._reader
    assert reader is not None and reader.wait_ready(), "the reader process did not start"
    for tier in tiers.values():
        data = [rng.standard_normal(LAYOUT.bytes_per_token * CHUNK // 4).astype(np.float32) for _ in keys]
        chunks = [
            ChunkData(k, LAYOUT, toks[i * CHUNK : (i + 1) * CHUNK].astype(np.uint32), d.tobytes())
            for i, (k, d) in enumerate(zip(keys, data, strict=True))
        ]
        assert all(tier.put(keys, chunks))
    pool = np.zeros(2 * N * SLOT, dtype=np.uint8)  # preallocated, faulted in
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if args.spinner else None
    res: dict[str, list[tuple[float, float]]] = {"inproc": [], "child": []}
    alone: list[float] = []
    try:
        for trial in range(args.trials):
            for name in ("inproc", "child") if trial % 2 == 0 else ("child", "inproc"):
                tier = tiers[name]
                for k in keys:
                    tier.drop_page_cache(k.text)
                time.sleep(0.05)
                for _ in range(10):
                    t0 = time.perf_counter()
                    fake_step()
                    alone.append(time.perf_counter() - t0)
                span: dict[str, float] = {}

                slots = itertools.count()

                def into(n: int, slots: itertools.count[int] = slots) -> memoryview:  # pool slots
                    i = next(slots) % (2 * N)
                    return memoryview(pool)[i * SLOT : i * SLOT + n]

                def read(
                    tier: DiskTier = tier,
                    span: dict[str, float] = span,
                    into: Callable[[int], memoryview] = into,
                ) -> None:
                    span["start"] = time.perf_counter()
                    with GIL_SHARE:  # as the worker's readers run
                        got = tier.get(keys, into=into)
                    span["end"] = time.perf_counter()
                    assert all(g is not None for g in got)

                th = on_core(1, read)
                steps: list[tuple[float, float]] = []
                th.start()
                while th.is_alive():
                    t0 = time.perf_counter()
                    fake_step()
                    steps.append((t0, time.perf_counter()))
                th.join()
                during = [e - s for s, e in steps if e > span["start"] and s < span["end"]]
                if trial and during:  # trial 0 warms up
                    res[name].append((span["end"] - span["start"], statistics.median(during)))
        assert reader.served > 0 and reader.alive, "the child read nothing"
    finally:
        if spinner is not None:
            spinner.kill()
        for tier in tiers.values():
            tier.clear(force=True)
            tier.close()
    print(f"step alone: median {1e3 * statistics.median(alone):.2f} ms")
    for name, rows in res.items():
        reads = sorted(r for r, _ in rows)
        print(
            f"{name:7s} read median {1e3 * statistics.median(reads):.1f} ms, "
            f"p90 {1e3 * reads[int(0.9 * len(reads))]:.1f} ms; "
            f"steps during it: median {1e3 * statistics.median(s for _, s in rows):.2f} ms"
        )


if __name__ == "__main__":
    main()
