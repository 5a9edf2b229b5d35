#!/usr/bin/env python3
"""Host time to queue each torch call of the host-device copy path on a GPU machine (medians
of 50-200 calls), the wall time of ``Transfer.save`` for scattered and consecutive blocks,
and the GPU time of the gather's kernels: what docs/bench/gpu.md's "where the time goes"
comes from. Run from a checkout on a GPU machine: ``python3 scripts/gpu_host_costs.py``."""
import statistics, sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
import numpy as np
import torch
from kvmesh.bench.gpu import bench as g
from kvmesh.core.memory import MemoryPool
from kvmesh.integrations.vllm import layouts as LY
from kvmesh.integrations.vllm.transfer import Transfer

lay = g.LLAMA_8B; CH = g.CHUNK; BS = g.BS
nbytes = CH * lay.bytes_per_token
blocks = 4 * CH // BS
layers = g.make_pages("LBNHC", lay.num_layers, blocks, lay.num_kv_heads, BS, 2 * lay.head_size, lay.dtype, "cuda")
pool = MemoryPool(nbytes, nbytes); pool.pin()
slot = pool.buffer[:nbytes].view(torch.bfloat16).view(lay.shape(CH))
page = LY.KVPages(BS)
xfer = Transfer(page, layers, lay, CH)
ids = list(range(0, blocks, 4))[: CH // BS]
cids = list(range(8, 8 + CH // BS))
stack = page._stacked(layers)
small = torch.zeros(16, device="cuda")
arr = np.arange(512, dtype=np.int64)
pinned = torch.empty(512, dtype=torch.int64, pin_memory=True)
dsmall = torch.empty(512, dtype=torch.int64, device="cuda")
idx = torch.as_tensor(ids, device="cuda")
stage = torch.empty(lay.shape(CH), dtype=torch.bfloat16, device="cuda")
ev = torch.cuda.Event(); ev.record(); torch.cuda.synchronize()
s = torch.cuda.Stream()

def host(fn, n=200, sync_each=False):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
        if sync_each: torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6

src, dst = LY._words(stack, stage, 256)
sel = src.index_select(1, idx)
def perm():
    b = sel.view(32, 16, 8, 16, 2, 32).permute(0, 4, 1, 3, 2, 5)
    dst.view(32, 2, 16, 16, 8, 32).copy_(b)
ops = {
    "python no-op call": (lambda: None, False),
    "kernel launch small.add_(1)": (lambda: small.add_(1), False),
    "pageable 4 KiB H2D": (lambda: torch.from_numpy(arr).to("cuda", non_blocking=True), False),
    "pinned 4 KiB H2D": (lambda: dsmall.copy_(pinned, non_blocking=True), False),
    "np outer+from_numpy": (lambda: torch.from_numpy(np.add.outer(np.asarray(ids) * 1, np.arange(1)).ravel()), False),
    "_stacked (cached)": (lambda: page._stacked(layers), False),
    "_words views": (lambda: LY._words(stack, stage, 256), False),
    "index_select 32 MiB (issue)": (lambda: src.index_select(1, idx), True),
    "permuted copy 32 MiB (issue)": (perm, True),
    "D2H 32 MiB issue": (lambda: slot.copy_(stage, non_blocking=True), True),
    "event record": (lambda: torch.cuda.Event().record(), False),
    "event synchronize (done)": (lambda: ev.synchronize(), False),
    "prepare (host, 256 tok)": (lambda: page.prepare(layers, ids, CH), False),
    "xfer.save wall (scattered ids)": (lambda: xfer.save(ids, slot, None), False),
    "xfer.save wall (consecutive ids)": (lambda: xfer.save(cids, slot, None), False),
    "page.gather issue (scattered)": (lambda: page.gather(layers, ids, stage), True),
}
for k, (fn, se) in ops.items():
    try:
        fn(); torch.cuda.synchronize()
        print(f"{k:36s} {host(fn, 50 if se else 200, se):8.1f} us")
    except Exception as e:
        print(f"{k:36s} ERROR {e}")
# consecutive blocks: a view instead of index_select
def gather_view():
    v = stack.view(torch.int64)[:, 8:24]
    b = v.view(32, 16, 8, 16, 2, 32).permute(0, 4, 1, 3, 2, 5)
    dst.view(32, 2, 16, 16, 8, 32).copy_(b)
print(f"{'gather consecutive as view (issue)':36s} {host(gather_view, 50, True):8.1f} us")
print("gpu ms: index_select", g._event_ms(lambda: src.index_select(1, idx)), "perm", g._event_ms(perm), "view-gather", g._event_ms(gather_view))
