"""The pure parts of the vLLM connector, without starting vLLM: paged <-> chunk copies,
scheduler-side planning, worker-side load/save against a real CacheEngine, the RPC, the
options and ``prewarm``."""

from __future__ import annotations

import json
import os
import pickle
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvmesh import CacheConfig, CacheEngine, KVLayout
from kvmesh.errors import ConfigError
from kvmesh.integrations.vllm.metadata import KVMeshConnectorMetadata, KVMeshKVEvents, LoadSpec, SaveSpec
from kvmesh.integrations.vllm.options import ConnectorOptions, check_chunk_size
from kvmesh.integrations.vllm.paged import (
    check_layers,
    chunk_to_paged,
    ordered_layers,
    paged_to_chunk,
)
from kvmesh.integrations.vllm.prewarm import add_prewarm_parser, prewarm
from kvmesh.integrations.vllm.rpc import RpcClient, RpcServer, socket_path
from kvmesh.integrations.vllm.scheduler import SchedulerSide
from kvmesh.integrations.vllm.worker import WorkerSide

BS = 128  # vLLM-CPU's block size


def token_kv(kv_layer: torch.Tensor, block_ids: list[int], i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference from docs/vllm-connector-notes.md (checked against transformers' K/V)."""
    nb, nh, n, c2 = kv_layer.shape
    d = c2 // 2
    page = kv_layer.view(nb, nh, 2, n * d)  # per head: K^T (d x n), then V (n x d)
    block, off = block_ids[i // n], i % n
    return page[block, :, 0].view(nh, d, n)[:, :, off], page[block, :, 1].view(nh, n, d)[:, off]


def settled(worker: Any, req: str, seq: int, tokens: Any, **kw: Any) -> Any:
    """``worker.lookup(..., detail=True)`` asked again while it answers pending, as the
    scheduler does at each step: a lookup may take longer than the worker's short wait on a
    loaded machine, and that must not fail a test of what it finds."""
    end = time.monotonic() + 10
    while (got := worker.lookup(req, seq, tokens, detail=True, **kw)) == {"pending": True}:
        assert time.monotonic() < end, "the lookup never answered"
        time.sleep(0.002)
    return got


def paged(
    num_layers: int = 3, num_blocks: int = 12, heads: int = 2, head_size: int = 16
) -> list[torch.Tensor]:
    """Layer views of one layer-major storage, as vLLM-CPU registers them."""
    per = num_blocks * heads * BS * 2 * head_size
    store = torch.randn(num_layers * per)
    return [
        store[i * per : (i + 1) * per].view(num_blocks, heads, BS, 2 * head_size) for i in range(num_layers)
    ]


# -- paged <-> chunk ---------------------------------------------------------------------
def test_paged_to_chunk_matches_token_kv_reference() -> None:
    layers = paged()
    ids = [7, 2, 11]
    out = torch.empty(3, 2, len(ids) * BS, 2, 16)
    paged_to_chunk(layers, ids, out)
    for li, layer in enumerate(layers):
        for i in range(len(ids) * BS):
            k, v = token_kv(layer, ids, i)
            assert torch.equal(out[li, 0, i], k) and torch.equal(out[li, 1, i], v)


def test_chunk_to_paged_round_trips_and_touches_only_its_blocks() -> None:
    layers = paged()
    before = [t.clone() for t in layers]
    chunk = torch.randn(3, 2, 2 * BS, 2, 16)
    chunk_to_paged(chunk, layers, [4, 0])
    back = torch.empty_like(chunk)
    paged_to_chunk(layers, [4, 0], back)
    assert torch.equal(back, chunk)
    for li in range(3):
        for b in range(12):
            if b not in (4, 0):
                assert torch.equal(layers[li][b], before[li][b])
        k, v = token_kv(layers[li], [4, 0], 130)
        assert torch.equal(k, chunk[li, 0, 130]) and torch.equal(v, chunk[li, 1, 130])


def test_chunk_to_paged_from_a_sliced_chunk_view() -> None:
    """The load path writes the tail of a chunk (from vLLM's block-aligned local hit on)."""
    layers = paged()
    chunk = torch.randn(3, 2, 2 * BS, 2, 16)
    chunk_to_paged(chunk[:, :, BS:], layers, [9])
    out = torch.empty(3, 2, BS, 2, 16)
    paged_to_chunk(layers, [9], out)
    assert torch.equal(out, chunk[:, :, BS:])


def test_ordered_layers_sorts_by_layer_index_not_text() -> None:
    t = {f"model.layers.{i}.self_attn.attn": torch.full((1,), float(i)) for i in (10, 2, 0, 1)}
    assert [float(x) for x in ordered_layers(t)] == [0.0, 1.0, 2.0, 10.0]


def test_check_layers_explains_a_wrong_shape() -> None:
    layout = KVLayout(3, 2, 16, torch.float32)
    check_layers(paged(), layout, BS)
    with pytest.raises(NotImplementedError, match="num_kv_heads, block_size, 2 \\* head_size"):
        check_layers([torch.zeros(4, 2, 64, 32)] * 3, layout, BS)
    with pytest.raises(ValueError, match="registered 2 KV cache layers"):
        check_layers(paged()[:2], layout, BS)


# -- options -----------------------------------------------------------------------------
def test_chunk_size_must_be_a_block_multiple() -> None:
    check_chunk_size(256, BS)
    check_chunk_size(512, BS)
    with pytest.raises(ValueError, match=r"chunk_size=200.*block_size=128"):
        check_chunk_size(200, BS)


def test_options_inline_file_and_env(tmp_path: Path) -> None:
    opts = ConnectorOptions.from_extra_config({"chunk_size": 512, "remote_url": "redis://h:1"}, environ={})
    assert opts.cache.chunk_size == 512 and opts.cache.remote_url == "redis://h:1"
    f = tmp_path / "kvmesh.yaml"
    f.write_text("chunk_size: 384\nmax_local_cpu_size: 0.5\n")
    opts = ConnectorOptions.from_extra_config(
        {"config_file": str(f), "max_local_cpu_size": 1.0, "rpc_timeout_s": 0.5, "model_id": "m"}, environ={}
    )
    assert (opts.cache.chunk_size, opts.cache.max_local_cpu_size) == (384, 1.0)  # inline beats the file
    assert (opts.rpc_timeout_s, opts.model_fingerprint) == (0.5, "m")
    opts = ConnectorOptions.from_extra_config({"chunk_size": 512}, environ={"KVMESH_CHUNK_SIZE": "1024"})
    assert opts.cache.chunk_size == 1024  # the environment wins
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config key"):
        ConnectorOptions.from_extra_config({"chunk_sise": 256}, environ={})


# -- scheduler side ----------------------------------------------------------------------
class FakeRank:
    """Answers lookups with min(what is asked, `holds`); None simulates a dead worker."""

    def __init__(self, holds: int | None = 10**9) -> None:
        self.holds = holds
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def call(self, op: str, **args: Any) -> Any:
        self.calls.append((op, args))
        if self.holds is None:
            return None
        return min(self.holds, len(args["tokens"])) // 256 * 256


def request(req_id: str, n: int, **kw: Any) -> SimpleNamespace:
    fields: dict[str, Any] = {
        "request_id": req_id,
        "prompt_token_ids": list(range(10, 10 + n)),
        "block_hashes": [f"h{i}".encode() for i in range(n // BS)],
        "lora_request": None,
        "mm_features": None,
        "cache_salt": None,
    }
    return SimpleNamespace(**{**fields, **kw})


def sched_out(
    new: list[tuple[Any, list[int], int, int]] | None = None,
    cached: list[tuple[str, list[int] | None, int, int]] | None = None,
    resumed: set[str] | None = None,
) -> SimpleNamespace:
    """new: (request, block_ids, num_computed, scheduled); cached: (id, new blocks, computed, scheduled)."""
    new, cached = new or [], cached or []
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r.request_id, block_ids=(ids,), num_computed_tokens=c)
            for r, ids, c, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            resumed_req_ids=resumed or set(),
            new_block_ids=[(c[1],) if c[1] is not None else None for c in cached],
            num_computed_tokens=[c[2] for c in cached],
        ),
        num_scheduled_tokens={**{r.request_id: s for r, _, _, s in new}, **{c[0]: c[3] for c in cached}},
    )


def test_lookup_leaves_a_token_to_compute_and_subtracts_the_local_hit() -> None:
    rank = FakeRank()
    s = SchedulerSide(256, BS, [rank])
    assert s.lookup(request("a", 1025), 0) == 1024
    assert len(rank.calls[-1][1]["tokens"]) == 1024
    assert s.lookup(request("b", 1000), 0) == 768  # (1000 - 1) // 256 * 256
    assert s.lookup(request("c", 1000), 512) == 256  # vLLM holds 512 itself
    n = len(rank.calls)
    assert s.lookup(request("d", 1000), 896) == 0  # the local hit covers all kvmesh could add
    assert len(rank.calls) == n  # ... so the worker was not even asked
    assert s.lookup(request("e", 256), 0) == 0  # one chunk, and a token must stay


def test_lookup_takes_the_min_over_tp_ranks_and_counts_rpc_failures() -> None:
    s = SchedulerSide(256, BS, [FakeRank(), FakeRank(holds=512)])
    assert s.lookup(request("a", 2000), 0) == 512
    dead = SchedulerSide(256, BS, [FakeRank(None)])
    r = request("b", 2000)
    assert dead.lookup(r, 0) == 0 and dead.stats["rpc_failures"] == 1
    dead.after_alloc(r, [], 0)
    # A rank may have pinned before the answer was lost: the release still goes out.
    assert dead.build_meta(sched_out()).releases == [("b", 1)]


def test_uncacheable_requests_are_neither_looked_up_nor_saved() -> None:
    rank = FakeRank()
    s = SchedulerSide(256, BS, [rank])
    r = request("mm", 1025, mm_features=[object()])
    assert s.lookup(r, 0) == 0 and not rank.calls
    meta = s.build_meta(sched_out(new=[(r, list(range(9)), 0, 1025)]))
    assert meta.saves == []


def test_alloc_plans_a_load_with_vllm_hit_as_skip() -> None:
    s = SchedulerSide(256, BS, [FakeRank()])
    r = request("a", 1025)
    assert s.lookup(r, 128) == 1024 - 128
    blocks = list(range(100, 109))
    s.after_alloc(r, blocks, 1024 - 128)
    meta = s.build_meta(sched_out(new=[(r, blocks, 1024, 1)]))
    (load,) = meta.loads
    assert (load.req_id, load.seq, load.skip) == ("a", 1, 128)
    assert load.token_ids == r.prompt_token_ids[:1024] and load.block_ids == blocks[:8]
    assert meta.releases == []  # the worker releases the pins after loading
    assert s.build_meta(sched_out()).loads == []  # planned once


def test_alloc_without_external_tokens_releases_the_pins() -> None:
    s = SchedulerSide(256, BS, [FakeRank()])
    r = request("a", 1025)
    s.lookup(r, 0)
    s.lookup(r, 0)  # asked again (allocation failed last step): a newer seq
    s.after_alloc(r, [], 0)
    assert s.build_meta(sched_out()).releases == [("a", 2)]


def test_saves_follow_chunked_prefill_and_carry_vllm_hashes() -> None:
    s = SchedulerSide(256, BS, [FakeRank(holds=0)], convert_hash=lambda h: int(h[1:]))
    r = request("a", 1100)
    s.lookup(r, 0)
    s.after_alloc(r, [], 0)
    m1 = s.build_meta(sched_out(new=[(r, [0, 1, 2, 3], 0, 500)]))  # 500 tokens computed
    (save,) = m1.saves
    assert (len(save.token_ids), save.block_ids, save.skip) == (256, [0, 1], 0)
    assert save.block_hashes == [0, 1]
    m2 = s.build_meta(sched_out(cached=[("a", [4, 5, 6, 7, 8], 500, 600)]))  # 1100 computed
    (save,) = m2.saves
    assert (len(save.token_ids), save.skip, save.block_ids) == (1024, 256, [0, 1, 2, 3, 4, 5, 6, 7])
    assert save.block_hashes == list(range(8))
    assert s.build_meta(sched_out(cached=[("a", None, 1100, 1)])).saves == []  # decoding: nothing new


def test_resumed_request_gets_a_fresh_block_list() -> None:
    s = SchedulerSide(256, BS, [FakeRank(holds=0)])
    r = request("a", 1100)
    s.lookup(r, 0)
    s.build_meta(sched_out(new=[(r, [0, 1, 2, 3], 0, 256)]))
    meta = s.build_meta(
        sched_out(cached=[("a", [50, 51, 52, 53, 54, 55, 56, 57, 58], 0, 1100)], resumed={"a"})
    )
    (save,) = meta.saves
    assert save.block_ids == [50, 51, 52, 53, 54, 55, 56, 57] and save.skip == 256


def test_invalid_blocks_replan_the_saves_from_the_failure() -> None:
    s = SchedulerSide(256, BS, [FakeRank()])
    r = request("a", 1025)
    s.lookup(r, 0)
    blocks = list(range(20, 29))
    s.after_alloc(r, blocks, 1024)
    assert s.build_meta(sched_out(new=[(r, blocks, 1024, 1)])).saves[0].skip == 0
    s.on_invalid_blocks({22})  # block 2 (tokens 256..383) failed to load: vLLM recomputes from 256
    (save,) = s.build_meta(sched_out(cached=[("a", None, 256, 769)])).saves
    assert (save.skip, len(save.token_ids)) == (256, 1024)


def test_finished_before_alloc_releases_and_forgets() -> None:
    s = SchedulerSide(256, BS, [FakeRank()])
    r = request("a", 1025)
    s.lookup(r, 0)
    s.finished(r)
    meta = s.build_meta(sched_out())
    assert meta.releases == [("a", 1)] and meta.loads == [] and meta.saves == []


def test_metadata_and_events_survive_pickling() -> None:
    meta = KVMeshConnectorMetadata(
        loads=[LoadSpec("a", 1, [1, 2], [3], 0)], saves=[SaveSpec("a", [1], [3], 0, [7])], releases=[("b", 2)]
    )
    assert pickle.loads(pickle.dumps(meta)) == meta
    ev = KVMeshKVEvents()
    ev.add_events([BlockRemoved(block_hashes=[1], medium="CPU")])
    back = pickle.loads(pickle.dumps(ev))
    assert back.get_all_events() == [BlockRemoved(block_hashes=[1], medium="CPU")]


def test_events_aggregate_keeps_what_every_tp_rank_reported() -> None:
    a, b = BlockRemoved(block_hashes=[1], medium="CPU"), BlockRemoved(block_hashes=[2], medium="CPU")
    ev = KVMeshKVEvents()
    ev.add_events([a, b])
    ev.add_events([a])  # what vLLM's executor does with a second worker's container
    ev.increment_workers(1)
    assert ev.aggregate().get_all_events() == [a]


# -- worker side -------------------------------------------------------------------------
LAYOUT = KVLayout(3, 2, 16, torch.float32)


@pytest.fixture
def worker() -> Any:
    engine = CacheEngine({"chunk_size": 256, "max_local_cpu_size": 0.01}, layout=LAYOUT, model_id="unit")
    w = WorkerSide(engine, paged(num_blocks=24), BS)
    yield w
    w.close()


def test_worker_save_then_load_into_other_blocks(worker: WorkerSide) -> None:
    tokens = list(range(1000, 1000 + 1025))
    src = list(range(0, 9))
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens[:1024], src[:8], 0, list(range(8)))]))
    assert worker.wait_for_writes(10)  # the saver thread finishes the save
    assert worker.engine.lookup(tokens) == 1024
    assert worker.lookup("b", 1, tokens[:1024]) == 1024
    assert worker.engine.stats()["cpu"]["pinned"] == 4
    dst = list(range(12, 20))
    worker.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, tokens[:1024], dst, 128)]))
    assert worker.take_load_errors() == set()
    assert worker.engine.stats()["cpu"]["pinned"] == 0  # released after loading
    for layer in worker.layers:
        assert torch.equal(layer[dst[1:]], layer[src[1:8]])  # block 0 was vLLM's own: untouched
        assert not torch.equal(layer[dst[0]], layer[src[0]])
    stats = worker.stats()["connector"]
    assert stats["loads"] == 1 and stats["load_tokens"] == 1024 - 128 and stats["saved_tokens"] == 1024


def test_worker_save_keeps_the_kv_of_its_step_when_the_blocks_are_reused(worker: WorkerSide) -> None:
    """The saver thread finishes a save after its step: what it stores must be the KV the
    step computed, even if the next forward overwrites those blocks first."""
    gate = threading.Event()
    worker._saver.submit(gate.wait, 0)  # hold the saver so the save below stays queued
    tokens = list(range(3000, 3000 + 512))
    src = [0, 1, 2, 3]
    want = [layer[src].clone() for layer in worker.layers]
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens, src, 0)]))
    for layer in worker.layers:
        layer[src] = torch.randn_like(layer[src])  # the next step reuses the blocks
    gate.set()
    assert worker.wait_for_writes(10)
    assert worker.lookup("b", 1, tokens) == 512
    dst = [10, 11, 12, 13]
    worker.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, tokens, dst, 0)]))
    assert worker.take_load_errors() == set()
    for layer, before in zip(worker.layers, want, strict=True):
        assert torch.equal(layer[dst], before)


def test_worker_save_copies_only_the_chunks_the_pool_lacks(worker: WorkerSide) -> None:
    tokens = list(range(4000, 4000 + 768))
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens[:512], [0, 1, 2, 3], 0)]))
    assert worker.wait_for_writes(10)
    # A follow-up re-sends the first two chunks from other blocks holding other KV: the pool
    # keeps its copies and only the third chunk is new.
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("b", tokens, [6, 7, 8, 9, 4, 5], 0)]))
    assert worker.wait_for_writes(10)
    assert worker.stats()["connector"]["saved_tokens"] == 768
    with worker.engine.retrieve_chunks(np.asarray(tokens), max_tokens=768) as chunks:
        got = [c.kv.clone() for c in chunks]
    reference = torch.empty_like(got[0])
    for i, blocks in enumerate([[0, 1], [2, 3], [4, 5]]):
        paged_to_chunk(worker.layers, blocks, reference)
        assert torch.equal(got[i], reference)


def test_worker_save_that_fails_is_logged_and_the_step_goes_on(worker: WorkerSide) -> None:
    tokens = list(range(8000, 8000 + 512))
    bad = SaveSpec("a", tokens, [0, 1, 2, 99], 0)  # block 99 does not exist
    good = SaveSpec("b", tokens[:256], [4, 5], 0)
    worker.end_step(KVMeshConnectorMetadata(saves=[bad, good]))
    assert worker.wait_for_writes(10)
    assert worker.stats()["connector"]["save_failures"] == 1
    assert worker.engine.lookup(tokens[:256]) == 256  # the next save of the step still ran


def test_worker_events_use_vllm_hashes(worker: WorkerSide) -> None:
    tokens = list(range(5000, 5000 + 512))
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens, [0, 1, 2, 3], 0, [11, 12, 13, 14])]))
    assert worker.wait_for_writes(10)  # the saver thread finishes the save
    events = worker.events.take()
    assert events == [
        BlockStored(
            block_hashes=[11, 12], parent_block_hash=None, token_ids=tokens[:256], block_size=BS,
            lora_id=None, medium="CPU", lora_name=None,
        ),
        BlockStored(
            block_hashes=[13, 14], parent_block_hash=12, token_ids=tokens[256:], block_size=BS,
            lora_id=None, medium="CPU", lora_name=None,
        ),
    ]  # fmt: skip
    worker.clear("cpu")
    assert worker.events.take() == [BlockRemoved(block_hashes=[11, 12, 13, 14], medium="CPU")]


def test_worker_failed_load_reports_blocks_and_saves_nothing_after_them(worker: WorkerSide) -> None:
    tokens = list(range(7000, 7000 + 1025))
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens[:1024], list(range(8)), 0)]))
    assert worker.wait_for_writes(10)  # the saver thread finishes the save
    assert worker.lookup("b", 1, tokens[:1024]) == 1024
    # Chunk 2 vanishes between lookup and load (a pin does not survive a forced clear).
    key = worker.engine.keys.keys(tokens[:768])[2]
    worker.engine.cpu.delete([key], force=True)
    dst = list(range(12, 20))
    meta = KVMeshConnectorMetadata(
        loads=[LoadSpec("b", 1, tokens[:1024], dst, 0)], saves=[SaveSpec("b", tokens[:1024], dst, 0)]
    )
    worker.start_step(meta)
    assert worker.take_load_errors() == set(dst[4:])  # tokens 512.. (chunk 2 on) were not loaded
    worker.end_step(meta)  # what the forward computed from 512 on used bad KV: not saved
    assert worker.wait_for_writes(10)  # the saver thread finishes the save
    assert worker.engine.lookup(tokens[:1024]) == 512
    assert worker.stats()["connector"]["load_failures"] == 1
    assert worker.engine.stats()["cpu"]["pinned"] == 0


def test_worker_release_ignores_an_older_lookup(worker: WorkerSide) -> None:
    tokens = list(range(1, 600))
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens[:512], [0, 1, 2, 3], 0)]))
    assert worker.wait_for_writes(10)  # the saver thread finishes the save
    worker.lookup("r", 1, tokens[:512])
    worker.lookup("r", 2, tokens[:512])  # replaces lookup 1 (its pins released)
    assert worker.engine.stats()["cpu"]["pinned"] == 2
    assert not worker.release("r", 1)
    assert worker.release("r", 2) and worker.engine.stats()["cpu"]["pinned"] == 0
    worker.lookup("s", 3, tokens[:512])
    worker.finished({"s"})  # the safety net for a request that finished with pins
    assert worker.engine.stats()["cpu"]["pinned"] == 0


# -- rpc ---------------------------------------------------------------------------------
def test_rpc_round_trip_and_failures_are_misses(tmp_path: Path) -> None:
    path = socket_path("engine-x", 0, 0, str(tmp_path))
    assert RpcClient(path, timeout_s=0.2).call("lookup") is None  # no worker yet: a miss, at once

    def slow() -> int:
        time.sleep(1.0)
        return 1

    server = RpcServer(path, {"echo": lambda **kw: kw, "slow": slow, "boom": lambda: 1 / 0}).start()
    try:
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        client = RpcClient(path, timeout_s=0.2, retry_after_s=0.5)
        assert client.call("echo", tokens=[1, 2, 3]) == {"tokens": [1, 2, 3]}
        assert client.call("nope") is None and client.call("boom") is None
        t0 = time.monotonic()
        assert client.call("slow") is None  # timed out ...
        assert client.call("echo") is None  # ... and quiet for a while, without waiting
        assert time.monotonic() - t0 < 0.6
        time.sleep(0.6)
        assert client.call("echo", a=1) == {"a": 1}  # reconnected; the late reply was discarded
        with pytest.raises(ConfigError, match="already serves"):
            RpcServer(path, {}).start()
    finally:
        server.close()
    assert not os.path.exists(path)


def test_rpc_server_replaces_a_stale_socket_file(tmp_path: Path) -> None:
    path = socket_path("engine-y", 0, 0, str(tmp_path))
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file stays, nobody listens: a crashed worker's leftover
    server = RpcServer(path, {"ping": lambda: "pong"}).start()
    try:
        assert RpcClient(path).call("ping") == "pong"
    finally:
        server.close()


# -- prewarm -----------------------------------------------------------------------------
def test_prewarm_sends_each_document_and_reports_prompt_tokens(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"path": self.path, **body})
            reply = json.dumps({"usage": {"prompt_tokens": len(body["prompt"].split())}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        docs = []
        for i, text in enumerate(["one two three", "four five"]):
            docs.append(tmp_path / f"d{i}.txt")
            docs[-1].write_text(text)
        rows = prewarm(f"http://127.0.0.1:{server.server_address[1]}", "tiny", docs, progress=False)
    finally:
        server.shutdown()
    assert [r["prompt_tokens"] for r in rows] == [3, 2]
    assert all(s["path"] == "/v1/completions" and s["max_tokens"] == 1 and s["model"] == "tiny" for s in seen)
    bad = prewarm("http://127.0.0.1:1", "tiny", [docs[0]], progress=False, timeout_s=1)
    assert "error" in bad[0]


def test_prewarm_parser() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_prewarm_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["prewarm", "--url", "http://h:8000", "--model", "m", "a.txt", "b.txt"])
    assert (args.url, args.model, args.files) == ("http://h:8000", "m", ["a.txt", "b.txt"])
    assert callable(args.func)


def test_connector_is_loadable_the_way_vllm_loads_it() -> None:
    import importlib

    module = importlib.import_module("kvmesh.integrations.vllm")
    cls = module.KVMeshConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert issubclass(cls, KVConnectorBase_V1)
    assert CacheConfig().chunk_size % BS == 0  # the default chunk size fits vLLM-CPU


# -- tail chunks (save_unfull_chunk) -------------------------------------------------------
def test_partial_last_block_round_trips_and_leaves_the_rest_of_the_block() -> None:
    layers = paged()
    before = [t.clone() for t in layers]
    chunk = torch.randn(3, 2, BS + 50, 2, 16)  # one whole block and 50 tokens of the next
    chunk_to_paged(chunk, layers, [5, 8])
    back = torch.empty_like(chunk)
    paged_to_chunk(layers, [5, 8], back)
    assert torch.equal(back, chunk)
    for li in range(3):
        k, v = token_kv(layers[li], [5, 8], BS + 49)
        assert torch.equal(k, chunk[li, 0, BS + 49]) and torch.equal(v, chunk[li, 1, BS + 49])
        # slots 50.. of block 8 keep what was there (vLLM computes them next)
        for i in range(BS + 50, 2 * BS):
            k, v = token_kv(layers[li], [5, 8], i)
            kb, vb = token_kv(before[li], [5, 8], i)
            assert torch.equal(k, kb) and torch.equal(v, vb)


def test_tail_lookup_loads_all_but_the_last_prompt_token() -> None:
    class TailRank(FakeRank):
        def call(self, op: str, **args: Any) -> Any:
            self.calls.append((op, args))
            return len(args["tokens"])  # holds the whole prompt, tail chunk included

    rank = TailRank()
    s = SchedulerSide(256, BS, [rank], tail=True)
    r = request("a", 1000)
    assert s.lookup(r, 0) == 999
    assert len(rank.calls[-1][1]["tokens"]) == 1000  # the tail chunk is keyed by the whole prompt
    blocks = list(range(40, 48))
    s.after_alloc(r, blocks, 999)
    (load,) = s.build_meta(sched_out(new=[(r, blocks, 999, 1)])).loads
    assert load.end == 999 and load.token_ids == r.prompt_token_ids and load.block_ids == blocks
    # Without tail chunks the same hit stops at the last chunk boundary.
    assert SchedulerSide(256, BS, [TailRank()]).lookup(request("b", 1000), 0) == 768


def test_tail_chunk_is_saved_once_the_whole_prompt_is_computed() -> None:
    s = SchedulerSide(256, BS, [FakeRank(holds=0)], tail=True)
    r = request("a", 600)
    s.lookup(r, 0)
    blocks = list(range(5))
    first = s.build_meta(sched_out(new=[(r, blocks, 0, 512)]))  # chunked prefill: 512 first
    assert [len(x.token_ids) for x in first.saves] == [512]
    second = s.build_meta(sched_out(cached=[("a", None, 512, 88)]))
    (save,) = second.saves
    assert len(save.token_ids) == 600 and save.skip == 512 and save.block_ids == blocks


def test_worker_tail_save_and_load_reproduce_the_kv() -> None:
    cfg = {"chunk_size": 256, "max_local_cpu_size": 0.01, "save_unfull_chunk": True}
    engine = CacheEngine(cfg, layout=LAYOUT, model_id="u")
    w = WorkerSide(engine, paged(num_blocks=24), BS)
    try:
        tokens = list(range(7000, 7000 + 600))
        src = [0, 1, 2, 3, 4]
        w.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens, src, 0)]))
        assert w.wait_for_writes(10)  # the saver thread finishes the save
        assert engine.lookup(tokens) == 600
        assert w.lookup("b", 1, tokens) == 600
        dst = [10, 11, 12, 13, 14]
        w.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, tokens, dst, 0, upto=599)]))
        assert w.take_load_errors() == set()
        for layer in w.layers:
            for i in range(599):
                got, want = token_kv(layer, dst, i), token_kv(layer, src, i)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    finally:
        w.close()
