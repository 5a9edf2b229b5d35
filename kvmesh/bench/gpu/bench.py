"""``kvmesh bench gpu`` (and scripts/gpu_check.py): the connector's host-device path on a GPU.

Five parts, all on CUDA, none needing vLLM (torch, numpy, xxhash and kvmesh only). Each runs
on its own: a part that raises is reported (with its traceback, in the output and the JSON)
and the others still run; the JSON is rewritten after every part.

1. **Round trips**: every page-layout adapter (K/V pages in each ``KVCacheLayout`` stride
   order, MLA latent pages, vLLM-CPU's packed page) in bf16/fp16/fp32/fp8: the chunk
   gathered on the GPU must be byte-identical to the one the same adapter gathers from a
   CPU copy of the pages (the CPU adapters are checked against vLLM's own layouts in
   tests/unit/integrations), scattering it into fresh pages must read back the same, and
   the full ``Transfer`` save (gather + D2H into a pinned pool slot) and load (H2D +
   scatter, layer-wise and batched) must reproduce it.
2. **Pinning**: the pool's ``cudaHostRegister`` in slot-aligned pieces against the real
   runtime, and a refused registration leaving no sticky CUDA error.
3. **Concurrent savers**: four saver threads, each with its own stream and staging, saving
   different chunks at once; every slot exact.
4. **Bandwidth**: store (gather + D2H) and retrieve (H2D + scatter) of a llama-8b-shaped
   chunk (32 layers x 8 KV heads x 128, bf16, 256 tokens = 32 MiB) against torch's own
   pinned ``copy_`` of the same bytes, interleaved in the same run; target >= 0.8x. Also the
   host time to queue a 2,048-token load.
5. **Overlap**: a matmul loop on the compute stream, alone and while the saver gathers and
   copies 2,000 tokens' blocks on the save stream; target: <= 5% slower (median of paired
   ratios).

Page tensors are built here the way vLLM's ``create_kv_cache_views`` builds them (a stride
permutation over logical ``[L, B, H, N, C]``); a unit test checks that the strides match.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kvmesh.core.keys import KVLayout
from kvmesh.core.memory import MemoryPool, torch_dtype
from kvmesh.integrations.vllm.layouts import CpuPackedPages, KVPages, LatentPages, PageLayout
from kvmesh.integrations.vllm.transfer import Transfer

# vllm/v1/kv_cache_layout.py::KVCacheLayout values (test_gpu_bench.py checks they agree).
LAYOUT_ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
BS = 16
LLAMA_8B = KVLayout(32, 8, 128, "bfloat16")
CHUNK = 256
DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn"]


def make_pages(
    order: str, layers: int, blocks: int, heads: int, n: int, c: int, dtype: str, device: str, seed: int = 0
) -> list[torch.Tensor]:
    """Per-layer logical ``[B, H, N, C]`` views of one random allocation laid out in
    ``order`` (physical axis order over logical ``[L, B, H, N, C]``)."""
    perm = LAYOUT_ORDERS[order]
    logical = (layers, blocks, heads, n, c)
    itemsize = torch.empty(0, dtype=torch_dtype(dtype)).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (layers * blocks * heads * n * c * itemsize,), dtype=torch.uint8, generator=gen
    )
    phys = raw.to(device).view(torch_dtype(dtype)).view([logical[i] for i in perm])
    view = phys.permute([perm.index(i) for i in range(5)])
    return [view[i] for i in range(layers)]


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu()))


def _cases() -> list[tuple[str, str, str, Callable[[], PageLayout], int, int, int]]:
    """(name, order, dtype, adapter, heads, head_size, planes)"""
    out: list[tuple[str, str, str, Callable[[], PageLayout], int, int, int]] = []
    for order in LAYOUT_ORDERS:
        for dt in DTYPES:
            out.append((f"kv-{order}-{dt}", order, dt, lambda: KVPages(BS), 4, 64, 2))
        out.append((f"mla-{order}-bfloat16", order, "bfloat16", lambda: LatentPages(BS), 1, 576, 1))
    out.append(("cpu-LBHNC-float32", "LBHNC", "float32", lambda: CpuPackedPages(BS), 4, 64, 2))
    return out


def check_round_trips(device: str = "cuda") -> list[dict[str, Any]]:
    """Part 1: every adapter on ``device`` against the same adapter on CPU, exactly."""
    results: list[dict[str, Any]] = []
    for i, case in enumerate(_cases()):
        try:
            ok = _round_trip(i, *case[1:], device=device)
        except Exception as e:  # one failing case must not hide the others' results
            results.append({"case": case[0], "exact": False, "error": _error(e)})
        else:
            results.append({"case": case[0], "exact": ok})
    return results


def _round_trip(
    i: int, order: str, dt: str, make: Callable[[], PageLayout], heads: int, d: int, planes: int, device: str
) -> bool:
    """One adapter case on ``device``: its gather equals the CPU adapter's, byte for byte,
    and so do a scatter read back and a save/load through a (pinned) pool slot."""
    tokens = 5 * BS + 7  # a partial last block
    layers = 4
    dev = make_pages(order, layers, 24, heads, BS, planes * d, dt, device, seed=i)
    cpu = make_pages(order, layers, 24, heads, BS, planes * d, dt, "cpu", seed=i)
    ids = torch.randperm(24, generator=torch.Generator().manual_seed(i))[: -(-tokens // BS)].tolist()
    shape = (layers, planes, tokens, heads, d)
    want = torch.empty(shape, dtype=torch_dtype(dt))
    make().gather(cpu, ids, want)
    got = torch.empty(shape, dtype=torch_dtype(dt), device=device)
    page = make()
    page.gather(dev, ids, got)
    ok = _same_bytes(got, want)
    fresh = make_pages(order, layers, 24, heads, BS, planes * d, dt, device, seed=1000 + i)
    page.scatter(got, fresh, ids)
    again = torch.empty_like(got)
    page.gather(fresh, ids, again)
    ok = ok and _same_bytes(again, want)
    return ok and _transfer_round_trip(page, dev, ids, want, KVLayout(layers, heads, d, dt, kv_planes=planes))


def _transfer_round_trip(
    page: PageLayout, layers: list[torch.Tensor], ids: list[int], want: torch.Tensor, layout: KVLayout
) -> bool:
    """Save through a pinned pool slot, load into other blocks layer-wise, gather back."""
    tokens = want.shape[2]
    nbytes = tokens * layout.bytes_per_token
    pool = MemoryPool(nbytes, nbytes)
    if layers[0].is_cuda:
        pool.pin()
    slot = pool.buffer[:nbytes].view(torch_dtype(layout.dtype)).view(layout.shape(tokens))
    xfer = Transfer(page, layers, layout, tokens)
    xfer.save(ids, slot, xfer.after_forward())
    ok = _same_bytes(slot, want)
    others = [b for b in range(layers[0].shape[0]) if b not in ids][: len(ids)]
    for layerwise in (True, False):
        dst = others if layerwise else others[::-1]
        xfer.load([(slot, dst)], layerwise=layerwise)
        for li in range(len(layers)):
            xfer.wait_layer(li)
        xfer.finish_loads()
        back = torch.empty(want.shape, dtype=want.dtype, device=layers[0].device)
        page.gather(layers, dst, back)
        if layers[0].is_cuda:
            torch.cuda.synchronize()
        ok = ok and _same_bytes(back, want)
    return ok


def check_pinning(device: str = "cuda") -> dict[str, Any]:
    """The pool's page-locking against the real CUDA runtime (the one torch loaded, found by
    :func:`kvmesh.core.cudart.cuda_runtime`): a buffer registered in several slot-aligned
    pieces (a 4 MiB piece standing in for the 64 GiB one) takes an asynchronous D2H exactly;
    registering it again is refused, and that refusal leaves no last error behind (the next
    kernel runs). Then the same refusal through torch's own binding, which cannot clear it:
    what the next kernel says then is recorded (the failure the clearing prevents)."""
    from kvmesh.core.cudart import cuda_runtime
    from kvmesh.core.memory import register_host, unregister_host

    slot, slots, piece = 1 << 20, 10, 4 << 20
    buf = torch.empty(slots * slot, dtype=torch.uint8)
    src = torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8, device=device)
    cudart = cuda_runtime()
    if cudart is None:
        raise RuntimeError("no libcudart among this process's libraries: the pool would be allocated pinned")
    pieces = register_host(cudart, buf.data_ptr(), buf.numel(), slot, piece=piece)
    for k in range(slots):  # slot by slot, as the pool copies: no copy crosses two pieces
        buf[k * slot : (k + 1) * slot].copy_(src[k * slot : (k + 1) * slot], non_blocking=True)
    torch.cuda.synchronize()
    copied = _same_bytes(buf, src)
    try:  # one copy across pieces: why the pieces end on slot boundaries
        buf.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        across = "ran"
    except RuntimeError as e:
        across = str(e).splitlines()[0]
        cudart.cudaGetLastError()
    again = register_host(cudart, buf.data_ptr(), buf.numel(), slot, piece=piece)
    kernel_after = _kernel_error(src)
    # torch's binding: the refusal's code comes back, the thread's last error stays set.
    code = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0))  # type: ignore[no-untyped-call]
    unclear = _kernel_error(src)
    cudart.cudaGetLastError()  # whatever that left, for the parts after this one
    unregister_host(cudart, pieces)
    # Pools made, pinned and dropped one after another (as tests and restarts do): each is
    # unregistered as its memory goes, so the next one at the same addresses registers and
    # copies, and so does a plain pageable tensor there.
    reused = exact = 0
    for k in range(24):
        pool = MemoryPool((k % 6 + 1) << 20, 1 << 20)  # one piece: the whole pool copies at once
        pool.pin()
        reused += pool.registered
        n = pool.buffer.numel()
        pool.buffer.copy_(src[:n], non_blocking=True)
        torch.cuda.synchronize()
        exact += _same_bytes(pool.buffer, src[:n])
        del pool
    pageable = torch.zeros(6 << 20, dtype=torch.uint8).to(device)
    return {
        "pools_registered": f"{reused}/24",
        "pools_exact": f"{exact}/24",
        "pageable_copy_after": bool(int(pageable.sum().item()) == 0),
        "runtime": cudart.path,
        "registered_in_pieces": len(pieces),
        "copy_across_pieces": across,
        "async_copy_exact": copied,
        "second_register_refused": not again,
        "kernel_after_refusal": kernel_after or "ran",
        "torch_binding_refusal_code": code,
        "kernel_after_uncleared_refusal": unclear or "ran",
        "ok": bool(pieces and copied and not again and kernel_after is None and reused == exact == 24),
    }


def _kernel_error(t: torch.Tensor) -> str | None:
    """Run one small kernel; the error it raises (a stale last error surfaces here), if any."""
    try:
        (t + 1).sum().item()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def check_concurrent_savers(device: str = "cuda", savers: int = 4, chunks: int = 12) -> dict[str, Any]:
    """Several saver threads, each on its own stream and staging buffer, saving different
    chunks of the same pages at once into one pinned pool: every slot must equal the CPU
    adapter's gather of its blocks."""
    lay = KVLayout(8, 4, 64, "bfloat16")
    tokens = 4 * BS
    blocks = chunks * tokens // BS
    dev = make_pages(
        "LBNHC", lay.num_layers, blocks, lay.num_kv_heads, BS, 2 * lay.head_size, lay.dtype, device
    )
    cpu = make_pages(
        "LBNHC", lay.num_layers, blocks, lay.num_kv_heads, BS, 2 * lay.head_size, lay.dtype, "cpu"
    )
    nbytes = tokens * lay.bytes_per_token
    pool = MemoryPool(chunks * nbytes, nbytes)
    if device == "cuda":
        pool.pin()
    xfer = Transfer(KVPages(BS), dev, lay, tokens)
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(7)).tolist()
    ids = [order[c * tokens // BS : (c + 1) * tokens // BS] for c in range(chunks)]
    slots = [
        pool.buffer[c * nbytes : (c + 1) * nbytes].view(torch_dtype(lay.dtype)).view(lay.shape(tokens))
        for c in range(chunks)
    ]
    after = xfer.after_forward()
    errors: list[str] = []

    def saver(k: int) -> None:
        try:
            for c in range(k, chunks, savers):
                xfer.save(ids[c], slots[c], after)
        except Exception as e:
            errors.append(_error(e))

    threads = [threading.Thread(target=saver, args=(k,)) for k in range(savers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    exact = 0
    for c in range(chunks):
        want = torch.empty(lay.shape(tokens), dtype=torch_dtype(lay.dtype))
        KVPages(BS).gather(cpu, ids[c], want)
        exact += _same_bytes(slots[c], want)
    return {
        "savers": savers,
        "chunks": chunks,
        "exact": exact,
        "errors": errors,
        "ok": exact == chunks and not errors,
    }


def _error(e: BaseException) -> str:
    """``e`` and where it was raised, for a part that failed (printed and in the JSON)."""
    import traceback

    return "".join(traceback.format_exception(e)[-6:]).strip()


def _timed(fn: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def bandwidth(reps: int = 20) -> dict[str, Any]:
    """Part 2: store / retrieve of one llama-8b chunk vs torch's pinned copy_ (GB/s)."""
    lay = LLAMA_8B
    nbytes = CHUNK * lay.bytes_per_token
    blocks = 4 * CHUNK // BS
    layers = make_pages(
        "LBNHC", lay.num_layers, blocks, lay.num_kv_heads, BS, 2 * lay.head_size, lay.dtype, "cuda"
    )
    pool = MemoryPool(nbytes, nbytes)
    pool.pin()
    slot = pool.buffer[:nbytes].view(torch_dtype(lay.dtype)).view(lay.shape(CHUNK))
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = pool.buffer[:nbytes]
    xfer = Transfer(KVPages(BS), layers, lay, CHUNK)
    ids = list(range(0, blocks, 4))[: CHUNK // BS]  # scattered blocks: the indexed copy
    consecutive = list(range(1, 1 + CHUNK // BS))  # consecutive blocks (a fresh allocation): a plain copy

    def retrieve() -> None:
        xfer.load([(slot, ids)], layerwise=False)
        xfer.wait_all_layers()
        xfer.finish_loads()

    def retrieve_layerwise() -> None:
        xfer.load([(slot, ids)], layerwise=True)
        xfer.wait_layer(lay.num_layers - 1)
        xfer.finish_loads()

    def limit_d2h() -> None:
        host.copy_(flat_dev, non_blocking=True)

    def limit_h2d() -> None:
        flat_dev.copy_(host, non_blocking=True)

    def retrieve_run() -> None:
        xfer.load([(slot, consecutive)], layerwise=False)
        xfer.wait_all_layers()
        xfer.finish_loads()

    runs: dict[str, Callable[[], None]] = {
        "limit_d2h": limit_d2h,
        "store": lambda: xfer.save(ids, slot, None),
        "store_consecutive": lambda: xfer.save(consecutive, slot, None),
        "limit_h2d": limit_h2d,
        "retrieve": retrieve,
        "retrieve_consecutive": retrieve_run,
        "retrieve_layerwise": retrieve_layerwise,
    }
    for fn in runs.values():  # warm up (CUDA context, caching allocator, kernels)
        _timed(fn)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):  # interleaved: kvmesh and its limit see the same machine state
        for k, fn in runs.items():
            times[k].append(_timed(fn))
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    # Host time to queue a 2,048-token load (8 chunks): what the forward thread pays, the
    # copies themselves run on the load stream. Batched (the default) against layer-wise.
    items = [(slot, ids)] * 8
    host_ms: dict[str, list[float]] = {"load_host_ms": [], "load_host_ms_layerwise": []}
    for _ in range(reps):
        for key, layerwise in (("load_host_ms", False), ("load_host_ms_layerwise", True)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            xfer.load(items, layerwise=layerwise)
            host_ms[key].append((time.perf_counter() - t) * 1e3)
            xfer.finish_loads()
    # Where a store's and a retrieve's time goes on the GPU: each step alone, timed with
    # events on the stream (what is not here is host time: issuing the work, waiting).
    dev_chunk = torch.empty(lay.shape(CHUNK), dtype=torch_dtype(lay.dtype), device="cuda")
    steps: dict[str, Callable[[], None]] = {
        "gather": lambda: xfer.page.gather(layers, ids, dev_chunk),
        "d2h": limit_d2h,
        "h2d": limit_h2d,
        "scatter": lambda: xfer.page.scatter(dev_chunk, layers, ids),
    }
    step_ms: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(reps):
        for k, fn in steps.items():
            step_ms[k].append(_event_ms(fn))
    # Eight chunks (2,048 tokens) stored by two saver threads at once: one saver's gather
    # overlaps the other's D2H. Against eight pinned copies of the same bytes.
    many = MemoryPool(8 * nbytes, nbytes)
    many.pin()
    outs = [many.buffer[c * nbytes : (c + 1) * nbytes].view(slot.dtype).view(slot.shape) for c in range(8)]
    one_dev = torch.empty(8 * nbytes, dtype=torch.uint8, device="cuda")

    def saver(k: int) -> None:
        for c in range(k, 8, 2):
            xfer.save(ids, outs[c], None)

    def store_8_two_savers() -> None:
        threads = [threading.Thread(target=saver, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def limit_8() -> None:
        many.buffer.copy_(one_dev, non_blocking=True)

    pair: dict[str, list[float]] = {"store_8": [], "limit_8": []}
    store_8_two_savers()
    for _ in range(reps):
        pair["limit_8"].append(_timed(limit_8))
        pair["store_8"].append(_timed(store_8_two_savers))
    return {
        "chunk_bytes": nbytes,
        "gbps": gbps,
        "step_ms": {k: statistics.median(v) for k, v in step_ms.items()},
        "store_8_chunks_2_savers_ratio": statistics.median(
            a / b for a, b in zip(pair["limit_8"], pair["store_8"], strict=True)
        ),
        "store_ratio": statistics.median(
            d / s for d, s in zip(times["limit_d2h"], times["store"], strict=True)
        ),
        "retrieve_ratio": statistics.median(
            h / r for h, r in zip(times["limit_h2d"], times["retrieve"], strict=True)
        ),
        "store_consecutive_ratio": statistics.median(
            d / s for d, s in zip(times["limit_d2h"], times["store_consecutive"], strict=True)
        ),
        "retrieve_consecutive_ratio": statistics.median(
            h / r for h, r in zip(times["limit_h2d"], times["retrieve_consecutive"], strict=True)
        ),
        **{k: statistics.median(v) for k, v in host_ms.items()},
        "retrieve_layerwise_ratio": statistics.median(
            h / r for h, r in zip(times["limit_h2d"], times["retrieve_layerwise"], strict=True)
        ),
    }


def overlap(reps: int = 7, tokens: int = 2000, size: int = 8192, iters: int = 40) -> dict[str, Any]:
    """Part 3: matmul loop time alone vs during a save of ``tokens`` tokens' blocks."""
    lay = LLAMA_8B
    n_chunks = -(-tokens // CHUNK)
    blocks = 2 * n_chunks * CHUNK // BS
    layers = make_pages(
        "LBNHC", lay.num_layers, blocks, lay.num_kv_heads, BS, 2 * lay.head_size, lay.dtype, "cuda"
    )
    nbytes = CHUNK * lay.bytes_per_token
    pool = MemoryPool(n_chunks * nbytes, nbytes)
    pool.pin()
    xfer = Transfer(KVPages(BS), layers, lay, CHUNK)
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)

    def matmuls() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(iters):
            torch.mm(a, b)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    def save_all(after: Any = None) -> None:
        # ``after`` is recorded before the matmuls are queued (the previous step's forward),
        # so the save runs beside them, as the worker's save beside the next step.
        for c in range(n_chunks):
            n = min(CHUNK, tokens - c * CHUNK)
            out = pool.buffer[c * nbytes : c * nbytes + n * lay.bytes_per_token]
            out_t = out.view(torch_dtype(lay.dtype)).view(lay.shape(n))
            ids = list(range(2 * c * CHUNK // BS, 2 * c * CHUNK // BS + 2 * (-(-n // BS)), 2))
            xfer.save(ids, out_t, after)

    matmuls()
    save_all()  # warm up
    alone: list[float] = []
    during: list[float] = []
    save_s: list[float] = []
    for _ in range(reps):
        alone.append(matmuls())
        after = xfer.after_forward()
        th = threading.Thread(target=_timed_into, args=(functools.partial(save_all, after), save_s))
        th.start()
        during.append(matmuls())
        th.join()
    ratios = [d / a_ for a_, d in zip(alone, during, strict=True)]
    return {
        "tokens": tokens,
        "matmul_s_alone": statistics.median(alone),
        "matmul_s_during_save": statistics.median(during),
        "save_s": statistics.median(save_s),
        "slowdown": statistics.median(ratios) - 1.0,
    }


def _event_ms(fn: Callable[[], None]) -> float:
    """``fn``'s work on the current stream, in ms, by CUDA events."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def _timed_into(fn: Callable[[], None], out: list[float]) -> None:
    t = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t)


def run(quick: bool = False, json_path: str | None = None, plot_path: str | None = None) -> int:
    """The whole check; 0 when every target holds, 1 when one is missed, 0 (skipped) without CUDA."""
    from kvmesh.bench.runner import print_table, provenance, write_json

    prov = provenance("gpu")  # the code this run measures: read now, the tree may move on
    if not torch.cuda.is_available():
        print(
            "kvmesh bench gpu: skipped: no CUDA device (torch.cuda.is_available() is False); "
            "run it on a GPU machine"
        )
        if json_path:
            write_json(json_path, {"skipped": "no CUDA device"}, prov)
        return 0
    t0 = time.perf_counter()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    targets: dict[str, bool] = {}

    def part(name: str, fn: Callable[[], Any]) -> Any:
        """Run one part; a part that raises is reported and recorded, and the rest still run.
        The JSON is rewritten after each part, so a run cut short keeps what it measured."""
        print(f"-- {name} ({time.perf_counter() - t0:.0f} s)", flush=True)
        try:
            out = fn()
        except Exception as e:
            out = {"error": _error(e)}
            print(f"{name}: FAILED\n{out['error']}", flush=True)
        result[name] = out
        result["targets"] = targets
        result["wall_s"] = time.perf_counter() - t0
        if json_path:
            write_json(json_path, result, prov)
        return out

    trips = part("round_trips", check_round_trips)
    targets["round_trips_exact"] = all(r["exact"] for r in trips)
    print_table(
        [r for r in trips if not r["exact"]] or [{"case": f"all {len(trips)} cases", "exact": True}],
        ["case", "exact"],
    )
    for r in trips:
        if "error" in r:
            print(f"{r['case']}:\n{r['error']}")
    pin = part("pinning", check_pinning)
    targets["pinned_in_pieces_error_cleared"] = bool(pin.get("ok"))
    if "error" not in pin:
        print(f"pinning: {pin}")
    savers = part("concurrent_savers", check_concurrent_savers)
    targets["concurrent_savers_exact"] = bool(savers.get("ok"))
    if "error" not in savers:
        print(f"concurrent savers: {savers}")
    bw = part("bandwidth", functools.partial(bandwidth, reps=8 if quick else 20))
    targets["store_ratio>=0.8"] = bw.get("store_ratio", 0.0) >= 0.8
    targets["retrieve_ratio>=0.8"] = bw.get("retrieve_ratio", 0.0) >= 0.8
    if "gbps" in bw:
        g = bw["gbps"]
        rows = [
            ("store (gather+D2H)", g["store"], g["limit_d2h"], bw["store_ratio"]),
            ("retrieve (H2D+scatter)", g["retrieve"], g["limit_h2d"], bw["retrieve_ratio"]),
            (
                "store, consecutive blocks",
                g["store_consecutive"],
                g["limit_d2h"],
                bw["store_consecutive_ratio"],
            ),
            (
                "retrieve, consecutive blocks",
                g["retrieve_consecutive"],
                g["limit_h2d"],
                bw["retrieve_consecutive_ratio"],
            ),
            ("retrieve, layer-wise", g["retrieve_layerwise"], g["limit_h2d"], bw["retrieve_layerwise_ratio"]),
        ]
        print_table(
            [
                {"path": p, "GB/s": f"{v:.1f}", "limit GB/s": f"{lim:.1f}", "ratio": f"{r:.2f}"}
                for p, v, lim, r in rows
            ],
            ["path", "GB/s", "limit GB/s", "ratio"],
        )
        print(
            f"host time to queue a 2,048-token load: {bw['load_host_ms']:.2f} ms "
            f"(layer-wise: {bw['load_host_ms_layerwise']:.2f} ms)"
        )
        print(
            "GPU time per step of one chunk (ms): "
            + ", ".join(f"{k} {v:.3f}" for k, v in bw["step_ms"].items())
        )
        print(
            f"8 chunks stored by 2 savers at once: {bw['store_8_chunks_2_savers_ratio']:.2f}x the pinned copy"
        )
    ov = part("overlap", functools.partial(overlap, reps=3 if quick else 7))
    targets["slowdown<=5%"] = ov.get("slowdown", 1.0) <= 0.05
    if "slowdown" in ov:
        print(
            f"compute-stream slowdown during a {ov['tokens']}-token save: {100 * ov['slowdown']:.1f}% "
            f"(save {ov['save_s'] * 1e3:.1f} ms)"
        )
    for k, v in targets.items():
        print(f"target {k}: {'met' if v else 'MISSED'}")
    result["wall_s"] = time.perf_counter() - t0
    if json_path:
        write_json(json_path, result, prov)
    if plot_path and "gbps" in bw and "slowdown" in ov:
        _plot(plot_path, bw, ov)
    return 0 if all(targets.values()) else 1


def _plot(path: str, bw: dict[str, Any], ov: dict[str, Any]) -> None:
    from kvmesh.bench.runner import write_plot

    g = bw["gbps"]
    try:
        write_plot(
            path,
            ["store: gather + D2H", "retrieve: H2D + scatter"],
            {"kvmesh": [g["store"], g["retrieve"]], "pinned copy_ (limit)": [g["limit_d2h"], g["limit_h2d"]]},
            "GB/s (32 MiB llama-8b chunk)",
            f"kvmesh host-device path on {torch.cuda.get_device_name()}; "
            f"compute slowdown during a save {100 * ov['slowdown']:.1f}%",
            [f"{bw['store_ratio']:.2f}x", f"{bw['retrieve_ratio']:.2f}x"],
        )
    except ImportError:
        print("matplotlib is not installed: no plot")
