#!/usr/bin/env python3
"""Variants of the block-wise copy path (``b450d3a`` on) for one llama-8b chunk (32 MiB), each
against torch's pinned ``copy_`` of the same bytes, interleaved in one process (medians of
paired ratios). Every variant's bytes are checked against the checkout's own path first; a
variant that is not exact, or raises, is reported and left out of the timing.

- **store**: ``v0`` is ``Transfer.save`` (scattered blocks: the indexed copy), ``v0_run`` the
  same for consecutive blocks (a plain strided copy); ``groups2`` / ``groups4`` gather the
  chunk in layer groups on one stream while a second stream copies each group out.
- **retrieve**: ``v0`` is ``Transfer.load`` (batched: one H2D, one scatter); ``groupsG``
  copies layer group k in on one stream and scatters it on another once it has landed.
- **eight chunks** (2,048 tokens): ``each`` is eight ``Transfer.save`` calls one after another,
  each waiting for its copy (what one saver does today); ``queued`` queues all eight on one
  stream and waits once; ``double`` gathers chunk k+1 into a second staging buffer while
  chunk k is copied out. Against one pinned copy of the same 8 chunks: whether batching a
  request's saves is worth a change to the engine's fill protocol.

Run from a checkout on a GPU machine (one call, ~20 s with 30 pairs)::

    KVMESH_COMMIT=<sha> python3 scripts/gpu_copy_variants.py --json $OUT/variants.json

``--device cpu --pairs 1`` runs the same control flow on CPU (streams are no-ops; the
timings mean nothing there): the test suite does, so a GPU call is never spent on a script
that does not run. Imports only what ``scripts/gpu_check.py`` does (torch, numpy).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's kvmesh

import torch

from kvmesh.bench.gpu import bench as g
from kvmesh.bench.runner import git_commit
from kvmesh.core.memory import MemoryPool, torch_dtype
from kvmesh.integrations.vllm.device import Event, Stream
from kvmesh.integrations.vllm.layouts import KVPages
from kvmesh.integrations.vllm.transfer import Transfer

EIGHT = 8


def measure(device: str, pairs: int) -> dict[str, Any]:
    dev = torch.device(device)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(fn: Callable[[], None]) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    lay, ch, bs = g.LLAMA_8B, g.CHUNK, g.BS
    nbytes = ch * lay.bytes_per_token
    per_chunk = ch // bs
    blocks = 4 * per_chunk  # the pages hold four chunks
    n_layers = lay.num_layers
    dtype = torch_dtype(lay.dtype)
    layers = g.make_pages(
        "LBNHC", n_layers, blocks, lay.num_kv_heads, bs, 2 * lay.head_size, lay.dtype, device
    )
    pool = MemoryPool(EIGHT * nbytes, nbytes)
    if cuda:
        pool.pin()
    slots = [pool.buffer[c * nbytes : (c + 1) * nbytes].view(dtype).view(lay.shape(ch)) for c in range(EIGHT)]
    slot = slots[0]
    page = KVPages(bs)
    xfer = Transfer(page, layers, lay, ch)
    stack = page._stacked(layers)
    assert stack is not None, "the bench's pages are one allocation: they stack"
    scattered = list(range(0, blocks, 4))[:per_chunk]  # every fourth block: the indexed copy
    consecutive = list(range(1, 1 + per_chunk))  # a fresh allocation: a plain strided copy
    other = list(range(1, blocks, 4))[:per_chunk]  # where the retrieve checks write
    ids8 = [list(range(c % 4, blocks, 4))[:per_chunk] for c in range(EIGHT)]
    a, b = Stream(dev), Stream(dev)
    stages = [torch.empty(lay.shape(ch), dtype=dtype, device=dev) for _ in range(2)]
    stage = stages[0]
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    all_dev = torch.empty(EIGHT * nbytes, dtype=torch.uint8, device=dev)

    def groups(n: int) -> list[slice]:
        per = n_layers // n
        return [slice(k * per, (k + 1) * per) for k in range(n)]

    def store_groups(n: int) -> Callable[[], None]:
        parts = groups(n)  # made once: the timed path is bound by the host's time to queue

        def run() -> None:
            done: list[Event] = []
            with a.use():
                for s in parts:
                    page._gather_blocks(stack[s], scattered, stage[s])
                    done.append(a.record())
            with b.use():
                for s, ev in zip(parts, done, strict=True):
                    b.wait(ev)
                    slot[s].copy_(stage[s], non_blocking=True)
                end = b.record()
            end.synchronize()

        return run

    def retrieve_v0(ids: Sequence[int]) -> Callable[[], None]:
        def run() -> None:
            xfer.load([(slot, ids)], layerwise=False)
            xfer.wait_all_layers()
            xfer.finish_loads()

        return run

    def retrieve_groups(n: int, ids: Sequence[int]) -> Callable[[], None]:
        parts = groups(n)

        def run() -> None:
            landed: list[Event] = []
            with b.use():
                for s in parts:
                    stage[s].copy_(slot[s], non_blocking=True)
                    landed.append(b.record())
            with a.use():
                for s, ev in zip(parts, landed, strict=True):
                    a.wait(ev)
                    page._scatter_blocks(stage[s], stack[s], ids)
                end = a.record()
            end.synchronize()

        return run

    def retrieve_variants(ids: Sequence[int]) -> dict[str, Callable[[], None]]:
        return {"v0": retrieve_v0(ids), **{f"groups{n}": retrieve_groups(n, ids) for n in (2, 4, 8)}}

    def eight_each() -> None:
        for c in range(EIGHT):
            xfer.save(ids8[c], slots[c], None)

    def eight_queued() -> None:
        with a.use():
            for c in range(EIGHT):  # one stream: chunk c + 1's gather runs after chunk c's copy
                page._gather_blocks(stack, ids8[c], stage)
                slots[c].copy_(stage, non_blocking=True)
            end = a.record()
        end.synchronize()

    def eight_double() -> None:
        copied: list[Event] = []
        for c in range(EIGHT):
            st = stages[c % 2]
            with a.use():
                if c >= 2:
                    a.wait(copied[c - 2])  # the last copy out of this staging buffer
                page._gather_blocks(stack, ids8[c], st)
                gathered = a.record()
            with b.use():
                b.wait(gathered)
                slots[c].copy_(st, non_blocking=True)
                copied.append(b.record())
        copied[-1].synchronize()

    def limit_d2h() -> None:
        slot.view(torch.uint8).view(-1).copy_(flat_dev, non_blocking=True)

    def limit_h2d() -> None:
        flat_dev.copy_(slot.view(torch.uint8).view(-1), non_blocking=True)

    def limit_eight() -> None:
        pool.buffer.copy_(all_dev, non_blocking=True)

    stores: dict[str, Callable[[], None]] = {
        "v0": lambda: xfer.save(scattered, slot, None),
        "v0_run": lambda: xfer.save(consecutive, slot, None),
        "groups2": store_groups(2),
        "groups4": store_groups(4),
    }
    retrieves = retrieve_variants(scattered)
    eights = {"each": eight_each, "queued": eight_queued, "double": eight_double}
    exact: dict[str, bool | str] = {}

    def check(name: str, fn: Callable[[], bool]) -> bool:
        try:
            exact[name] = fn()
        except Exception:
            exact[name] = traceback.format_exc(limit=4)
        ok = exact[name] is True
        if not ok:
            print(f"{name}: {'not exact' if exact[name] is False else exact[name]}", file=sys.stderr)
        return ok

    # The checks: every variant against the checkout's own path, bit for bit.
    xfer.save(scattered, slot, None)
    ref = slot.cpu().clone()

    def store_exact(fn: Callable[[], None]) -> bool:
        slot.zero_()
        fn()
        sync()
        return g._same_bytes(slot, ref)

    for k in [k for k in stores if not k.startswith("v0")]:  # v0 made the reference
        if not check("store_" + k, functools.partial(store_exact, stores[k])):
            stores.pop(k)

    def retrieve_exact(fn: Callable[[], None]) -> bool:
        for layer in layers:
            layer[other] = 0
        slot.copy_(ref)
        fn()
        sync()
        back = torch.empty(lay.shape(ch), dtype=dtype, device=dev)
        page.gather(layers, other, back)
        return g._same_bytes(back, ref)

    checked = retrieve_variants(other)  # the same variants, writing where the check reads
    for k in list(retrieves):
        if not check("retrieve_" + k, functools.partial(retrieve_exact, checked[k])):
            retrieves.pop(k)
    eight_each()
    refs = [s.cpu().clone() for s in slots]

    def eight_exact(fn: Callable[[], None]) -> bool:
        pool.buffer.zero_()
        fn()
        sync()
        return all(g._same_bytes(s, r) for s, r in zip(slots, refs, strict=True))

    for k in [k for k in eights if k != "each"]:
        if not check("eight_" + k, functools.partial(eight_exact, eights[k])):
            eights.pop(k)

    runs: list[tuple[str, Callable[[], None]]] = [
        ("d2h", limit_d2h),
        *(("store_" + k, fn) for k, fn in stores.items()),
        ("h2d", limit_h2d),
        *(("retrieve_" + k, fn) for k, fn in retrieves.items()),
        ("d2h_eight", limit_eight),
        *(("eight_" + k, fn) for k, fn in eights.items()),
    ]
    for _, fn in runs:  # warm up: kernels, the caching allocator
        timed(fn)
    times: dict[str, list[float]] = {k: [] for k, _ in runs}
    for i in range(pairs):  # interleaved, every other round in reverse order
        for k, fn in runs if i % 2 == 0 else runs[::-1]:
            times[k].append(timed(fn))

    def row(key: str, limit: str) -> dict[str, float]:
        return {
            "ms": statistics.median(times[key]) * 1e3,
            "ratio": statistics.median(x / y for x, y in zip(times[limit], times[key], strict=True)),
        }

    return {
        "commit": git_commit(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "pairs": pairs,
        "chunk_bytes": nbytes,
        "exact": exact,
        "limits_ms": {k: statistics.median(times[k]) * 1e3 for k in ("d2h", "h2d", "d2h_eight")},
        "store": {k: row("store_" + k, "d2h") for k in stores},
        "retrieve": {k: row("retrieve_" + k, "h2d") for k in retrieves},
        "eight": {k: row("eight_" + k, "d2h_eight") for k in eights},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default="cuda", help="cuda (the measurement) or cpu (the control flow only)"
    )
    parser.add_argument("--pairs", type=int, default=30, help="interleaved rounds (default 30)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA: nothing measured (--device cpu runs the control flow)")
        return 0
    out = measure(args.device, args.pairs)
    for part in ("store", "retrieve", "eight"):
        for k, r in out[part].items():
            print(f"{part:8s} {k:8s} {r['ms']:8.3f} ms  ratio {r['ratio']:.3f}")
    print("limits (ms):", {k: round(v, 3) for k, v in out["limits_ms"].items()})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(v is True for v in out["exact"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
