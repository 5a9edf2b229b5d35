#!/usr/bin/env python3
"""Store (gather + D2H) and retrieve (H2D + scatter) variants of one llama-8b chunk on a GPU,
each against torch's pinned copy of the same bytes, interleaved in one process (30 pairs;
medians of paired ratios); every variant's bytes are checked against ``v0`` first.

``v0`` is the checkout's own ``Transfer.save`` / ``Transfer.load``; the others are written
out here: host-built indices, layer-group pipelines over two streams, whole blocks by
``index_select``. The comparisons in docs/bench/gpu.md come from this script (runs 3 and 4).
Run from a checkout on a GPU machine: ``python3 scripts/gpu_copy_variants.py``."""
import statistics, sys, time, traceback
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
import numpy as np
import torch
from kvmesh.bench.gpu import bench as g
from kvmesh.core.memory import MemoryPool, torch_dtype
from kvmesh.integrations.vllm import layouts as LY
from kvmesh.integrations.vllm.transfer import Transfer

lay = g.LLAMA_8B
CH = g.CHUNK
BS = g.BS
nbytes = CH * lay.bytes_per_token
blocks = 4 * CH // BS
layers = g.make_pages("LBNHC", lay.num_layers, blocks, lay.num_kv_heads, BS, 2 * lay.head_size, lay.dtype, "cuda")
pool = MemoryPool(2 * nbytes, nbytes); pool.pin()
slot = pool.buffer[:nbytes].view(torch.bfloat16).view(lay.shape(CH))
ref = pool.buffer[nbytes:].view(torch.bfloat16).view(lay.shape(CH))
flat_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
host = pool.buffer[:nbytes]
page = LY.KVPages(BS)
xfer = Transfer(page, layers, lay, CH)
ids = list(range(0, blocks, 4))[: CH // BS]
stack = page._stacked(layers)
assert stack is not None
s_a = torch.cuda.Stream(); s_b = torch.cuda.Stream()
stage = torch.empty(lay.shape(CH), dtype=torch.bfloat16, device="cuda")
tmp = torch.empty(lay.num_layers, CH // BS, lay.num_kv_heads, BS, 2 * lay.head_size, dtype=torch.bfloat16, device="cuda")
L = lay.num_layers

def prep_dev():
    return page.prepare(layers, ids, CH)

def prep_host():
    t = np.arange(CH)
    kb = np.asarray(ids, dtype=np.int64)[t // BS] + 0
    off = t % BS
    both = torch.from_numpy(np.stack([kb, off])).to("cuda", non_blocking=True)
    return both[0], both[1]

def gather_stack(st, kb, off, out):
    d = out.shape[-1]
    for p in range(2):
        src, dst = LY._words(st[..., p * d:(p + 1) * d], out[:, p].transpose(0, 1))
        LY._index_into(src, [None, kb, None, off], dst)

def store_v0():
    xfer.save(ids, slot, None)

def store_host_prep():
    with torch.cuda.stream(s_a):
        kb, off = prep_host()
        gather_stack(stack, kb, off, stage)
        slot.copy_(stage, non_blocking=True)
        ev = s_a.record_event()
    ev.synchronize()

def make_pipe(G, host=True):
    per = L // G
    def store():
        with torch.cuda.stream(s_a):
            kb, off = prep_host() if host else prep_dev()
            evs = []
            for k in range(G):
                gather_stack(stack[k * per:(k + 1) * per], kb, off, stage[k * per:(k + 1) * per])
                evs.append(s_a.record_event())
        with torch.cuda.stream(s_b):
            for k in range(G):
                s_b.wait_event(evs[k])
                slot[k * per:(k + 1) * per].copy_(stage[k * per:(k + 1) * per], non_blocking=True)
            done = s_b.record_event()
        done.synchronize()
    return store

def store_blocks():
    kbl = torch.as_tensor(ids, dtype=torch.long).to("cuda", non_blocking=True)
    with torch.cuda.stream(s_a):
        torch.index_select(stack.view(torch.int64), 1, kbl, out=tmp.view(torch.int64))
        d = lay.head_size
        src = tmp.view(L, CH // BS, lay.num_kv_heads, BS, 2, d).permute(0, 4, 1, 3, 2, 5)
        stage.view(L, 2, CH // BS, BS, lay.num_kv_heads, d).copy_(src)
        slot.copy_(stage, non_blocking=True)
        ev = s_a.record_event()
    ev.synchronize()

def limit_d2h():
    host.copy_(flat_dev, non_blocking=True)

def limit_h2d():
    flat_dev.copy_(host, non_blocking=True)

# retrieve variants
def retr_v0():
    xfer.load([(slot, ids)], layerwise=False); xfer.wait_all_layers(); xfer.finish_loads()

def scatter_stack(st, kb, off, chunk):
    d = chunk.shape[-1]
    for p in range(2):
        dst, src = LY._words(st[..., p * d:(p + 1) * d], chunk[:, p].transpose(0, 1))
        dst[:, kb, :, off] = src

def make_rpipe(G, host=True):
    per = L // G
    def retr():
        with torch.cuda.stream(s_b):
            evs = []
            for k in range(G):
                stage[k * per:(k + 1) * per].copy_(slot[k * per:(k + 1) * per], non_blocking=True)
                evs.append(s_b.record_event())
        with torch.cuda.stream(s_a):
            kb, off = prep_host() if host else prep_dev()
            for k in range(G):
                s_a.wait_event(evs[k])
                scatter_stack(stack[k * per:(k + 1) * per], kb, off, stage[k * per:(k + 1) * per])
            done = s_a.record_event()
        done.synchronize()
    return retr

stores = {"v0": store_v0, "host_prep": store_host_prep, "pipe4_host": make_pipe(4), "pipe8_host": make_pipe(8),
          "pipe4_dev": make_pipe(4, False), "pipe2_host": make_pipe(2), "blocks": store_blocks}
retrs = {"v0": retr_v0, "rpipe4_host": make_rpipe(4), "rpipe8_host": make_rpipe(8), "rpipe4_dev": make_rpipe(4, False)}

# correctness: each store variant's slot must equal v0's
store_v0(); ref.copy_(slot)
ok = {}
for k, fn in list(stores.items()):
    try:
        slot.zero_(); fn(); torch.cuda.synchronize()
        ok[k] = bool(torch.equal(slot.view(torch.int16), ref.view(torch.int16)))
    except Exception:
        traceback.print_exc(); ok[k] = False; stores.pop(k)
print("store exact:", ok)
# retrieve correctness: load ref into other blocks, compare gathers
other = list(range(1, blocks, 4))[: CH // BS]
rok = {}
saved = ids[:]
for k, fn in list(retrs.items()):
    try:
        for lyr in layers:
            lyr[other] = 0
        slot.copy_(ref)
        ids[:] = other
        fn(); torch.cuda.synchronize()
        ids[:] = saved
        back = torch.empty_like(stage); page.gather(layers, other, back); torch.cuda.synchronize()
        rok[k] = bool(torch.equal(back.cpu().view(torch.int16), ref.view(torch.int16)))
    except Exception:
        traceback.print_exc(); rok[k] = False; retrs.pop(k)
    finally:
        ids[:] = saved
print("retrieve exact:", rok)
for fn in [*stores.values(), *retrs.values(), limit_d2h, limit_h2d]:
    g._timed(fn)
T = {k: [] for k in [*("s_" + x for x in stores), *("r_" + x for x in retrs), "d2h", "h2d"]}
for _ in range(30):
    T["d2h"].append(g._timed(limit_d2h))
    for k, fn in stores.items():
        T["s_" + k].append(g._timed(fn))
    T["h2d"].append(g._timed(limit_h2d))
    for k, fn in retrs.items():
        T["r_" + k].append(g._timed(fn))
for k in stores:
    r = statistics.median(a / b for a, b in zip(T["d2h"], T["s_" + k]))
    print(f"store {k:12s} {statistics.median(T['s_' + k]) * 1e3:.3f} ms  ratio {r:.3f}")
for k in retrs:
    r = statistics.median(a / b for a, b in zip(T["h2d"], T["r_" + k]))
    print(f"retr  {k:12s} {statistics.median(T['r_' + k]) * 1e3:.3f} ms  ratio {r:.3f}")
print(f"limits d2h {statistics.median(T['d2h']) * 1e3:.3f} ms h2d {statistics.median(T['h2d']) * 1e3:.3f} ms")
