"""The host-device path (transfer.py + worker.py) driven on CPU tensors: the same calls,
in the same order, as on CUDA, with no-op streams. The pages are vLLM's own FlashAttention
(LBNHC) and MLA views (vllm_pages.py); the engine is real."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvmesh import CacheEngine, KVLayout
from kvmesh.core.memory import MemoryPool
from kvmesh.errors import ClosedError, ConfigError
from kvmesh.integrations.vllm.connector import KVMeshConnector
from kvmesh.integrations.vllm.device import Event, Stream
from kvmesh.integrations.vllm.layouts import KVPages, LatentPages
from kvmesh.integrations.vllm.metadata import KVMeshConnectorMetadata, LoadSpec, SaveSpec
from kvmesh.integrations.vllm.scheduler import SchedulerSide
from kvmesh.integrations.vllm.worker import WorkerSide
from tests.unit.integrations.test_connector import settled
from tests.unit.integrations.vllm_pages import as_bytes, reference_gather, vllm_layers

BS = 16
CS = 32  # chunk = 2 blocks
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


def _worker(
    mla: bool = False,
    layout: KVCacheLayout = KVCacheLayout.LBNHC,
    layerwise: bool = True,
    async_loads: str = "lower",
) -> WorkerSide:
    heads, d = (1, 24) if mla else (2, 8)
    layers = vllm_layers(3, 24, BS, heads, d, torch.bfloat16, layout, mla=mla, seed=5)
    kv = KVLayout(3, 1, d, torch.bfloat16, kv_planes=1) if mla else KVLayout(3, heads, d, torch.bfloat16)
    engine = CacheEngine({"chunk_size": CS, "max_local_cpu_size": 0.01}, layout=kv, model_id="dev")
    page = LatentPages(BS) if mla else KVPages(BS)
    return WorkerSide(
        engine, layers, BS, page=page, layer_names=NAMES, layerwise=layerwise, async_loads=async_loads
    )


@pytest.fixture(params=[False, True], ids=["flash_attn", "mla"])
def worker(request: Any) -> Iterator[WorkerSide]:
    w = _worker(mla=request.param)
    yield w
    w.close()


def _logical(w: WorkerSide, ids: list[int], tokens: int) -> torch.Tensor:
    return as_bytes(reference_gather(w.layers, ids, tokens, BS, w.page.planes))


def test_the_device_path_is_taken_for_gpu_layouts(worker: WorkerSide) -> None:
    assert worker.xfer is not None and not worker.xfer.cuda


def test_save_then_layerwise_load_reproduces_the_logical_kv(worker: WorkerSide) -> None:
    tokens = list(range(100, 100 + 3 * CS))
    src = [3, 9, 1, 17, 5, 0]
    want = _logical(worker, src, 3 * CS)
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens, src, 0)]))
    assert worker.wait_for_writes(10)
    assert worker.finished({"a"}) == {"a"}  # its saves are done: vLLM may free the blocks
    assert worker.lookup("b", 1, tokens) == 3 * CS
    dst = [20, 21, 22, 23, 10, 11]
    worker.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, tokens, dst, BS)]))
    for name in NAMES:  # what vLLM's attention layers call before reading their KV
        worker.wait_for_layer(name)
    assert worker._layerwise
    assert worker.take_load_errors() == set()
    got = _logical(worker, dst, 3 * CS)
    assert torch.equal(got[:, :, BS:], want[:, :, BS:])  # block 0 was vLLM's own hit: not written
    assert worker.engine.stats()["cpu"]["pinned"] == 0
    worker.end_step(KVMeshConnectorMetadata())
    assert worker._loads_open is None  # the retrieved chunks went once the copies were done
    # vLLM called the layer hooks: from now on loads go layer-major, one event per layer.
    assert worker.lookup("c", 2, tokens) == 3 * CS
    again = [12, 13, 14, 15, 16, 18]
    worker.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("c", 2, tokens, again, 0)]))
    for name in NAMES:
        worker.wait_for_layer(name)
    assert worker.take_load_errors() == set()
    assert torch.equal(_logical(worker, again, 3 * CS), want)


@pytest.mark.parametrize("mla", [False, True], ids=["flash_attn", "mla"])
def test_async_load_on_the_device_path_is_queued_then_named(mla: bool) -> None:
    """The host-device path of an asynchronous load (Transfer.load_now: H2D + one scatter per
    chunk on the load stream, named once its event completed), on CPU tensors with no-op
    streams; ``async_loads: all`` sends this cpu hit through it."""
    w = _worker(mla=mla, layerwise=False, async_loads="all")
    try:
        tokens = list(range(300, 300 + 3 * CS))
        src = [3, 9, 1, 17, 5, 0]
        want = _logical(w, src, 3 * CS)
        w.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens, src, 0)]))
        assert w.wait_for_writes(10) and w.finished({"a"}) == {"a"}
        assert settled(w, "b", 1, tokens) == {"tokens": 3 * CS, "lower": True}
        dst = [20, 21, 22, 23, 10, 11]
        w.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, tokens, dst, 0, load_async=True)]))
        deadline = time.monotonic() + 10
        named: set[str] = set()
        while not named and time.monotonic() < deadline:
            named = w.finished_loading(set())
            time.sleep(0.01)
        assert named == {"b"} and w.take_load_errors() == set()
        assert torch.equal(_logical(w, dst, 3 * CS), want)
        assert w.engine.stats()["cpu"]["pinned"] == 0
    finally:
        w.close()


def test_blocks_are_held_until_the_save_has_read_them(worker: WorkerSide) -> None:
    """A save that runs after its step never reads a block vLLM has since reused: vLLM
    frees the blocks only once ``finished`` reports the request, after the copy."""
    gate = threading.Event()
    worker._saver.submit(gate.wait, 0)  # the saver thread is busy: the save stays queued
    tokens = list(range(500, 500 + 2 * CS))
    src = [2, 4, 6, 8]
    want = _logical(worker, src, 2 * CS)
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens, src, 0)]))
    assert worker.finished({"a"}) == set()  # finished, but its save has not read the blocks
    assert worker.finished(set()) == set()
    gate.set()
    assert worker.wait_for_writes(10)
    assert worker.finished(set()) == {"a"}  # reported once, now
    assert worker.finished(set()) == set()
    for layer in worker.layers:  # vLLM reuses the blocks for another request
        layer[src] = torch.zeros_like(layer[src])
    with worker.engine.retrieve_chunks(np.asarray(tokens), max_tokens=len(tokens)) as chunks:
        stored = torch.cat([as_bytes(c.kv) for c in chunks], dim=2)
    assert torch.equal(stored, want)


def test_a_preempted_requests_saves_complete_before_the_next_forward(worker: WorkerSide) -> None:
    gate = threading.Event()
    worker._saver.submit(gate.wait, 0, "p")  # ahead of p's saves, on their thread
    tokens = list(range(900, 900 + CS))
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("p", tokens, [7, 8], 0)]))
    assert not worker.wait_for_preempted(["p"], timeout=0.2)  # still queued
    assert worker.wait_for_preempted(["other"], timeout=0)  # nothing of its own in flight
    threading.Timer(0.1, gate.set).start()
    assert worker.wait_for_preempted(["p"], timeout=10)
    assert worker.engine.lookup(tokens) == CS


def test_a_request_with_nothing_new_to_save_is_reported_at_once(worker: WorkerSide) -> None:
    tokens = list(range(40, 40 + CS))
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens, [0, 1], 0)]))
    assert worker.wait_for_writes(10)
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("b", tokens, [2, 3], 0)]))  # all held
    assert worker.finished({"a", "b"}) == {"a", "b"}
    assert worker.finished({"never-saved"}) == set()  # vLLM did not hold it for us


def test_a_failed_device_save_still_releases_the_blocks(worker: WorkerSide) -> None:
    tokens = list(range(70, 70 + CS))
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens, [0, 99], 0)]))  # no block 99
    assert worker.wait_for_writes(10)
    assert worker.finished({"a"}) == {"a"}
    assert worker.stats()["connector"]["save_failures"] == 1


def test_without_layer_hooks_the_forward_waits_for_every_layer() -> None:
    w = _worker()
    try:
        calls: list[str] = []
        assert w.xfer is not None
        w.xfer.wait_all_layers = lambda: calls.append("all")  # type: ignore[method-assign]
        w.start_step(KVMeshConnectorMetadata())
        assert calls == ["all"] and not w._layerwise
    finally:
        w.close()


def test_cpu_streams_are_program_order() -> None:
    s = Stream(torch.device("cpu"))
    ev = s.record()
    assert isinstance(ev, Event) and ev.query()
    s.wait(ev)
    s.wait(None)
    with s.use():
        x = torch.ones(2) + 1
    s.synchronize()
    assert x.tolist() == [2.0, 2.0]


def test_pinning_needs_cuda_and_an_unused_pool() -> None:
    pool = MemoryPool(1024, 256)
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        obj = pool.allocate(10)
        with pytest.raises(ClosedError):
            pool.pin()
        assert obj is not None
        obj.release()
        pool.pin()
        assert pool.pinned and pool.buffer.is_pinned()
    else:
        with pytest.raises(ConfigError, match="CUDA is not available"):
            pool.pin()


def test_tp_shards_and_the_mla_latent() -> None:
    conn: Any = SimpleNamespace(_kv_cache_config=SimpleNamespace(kv_tp_replicas=1))
    assert [KVMeshConnector._shard(conn, r, False) for r in range(4)] == [0, 1, 2, 3]
    conn._kv_cache_config.kv_tp_replicas = 2  # TP 4 over 2 KV heads: ranks pair up
    assert [KVMeshConnector._shard(conn, r, False) for r in range(4)] == [0, 0, 1, 1]
    assert [KVMeshConnector._shard(conn, r, True) for r in range(4)] == [0, 0, 0, 0]  # stored once


def test_a_shard_missing_on_one_rank_is_a_miss_for_all() -> None:
    """Rank 1 lacks the chunks rank 0 holds: the scheduler plans no load (never partial KV)."""
    tokens = list(range(10, 10 + 4 * CS))
    ranks = [_worker(), _worker()]
    try:
        ranks[0].end_step(KVMeshConnectorMetadata(saves=[SaveSpec("w", tokens, list(range(8)), 0)]))
        assert ranks[0].wait_for_writes(10)
        rpc = [SimpleNamespace(call=lambda op, w=w, **a: getattr(w, op)(**a)) for w in ranks]
        sched = SchedulerSide(CS, BS, rpc)
        req = SimpleNamespace(
            request_id="r", prompt_token_ids=[*tokens, 1], block_hashes=[], lora_request=None,
            mm_features=None, cache_salt=None,
        )  # fmt: skip
        assert sched.lookup(req, 0) == 0
        assert ranks[0].engine.stats()["cpu"]["pinned"] == 4  # until the release vLLM's 0 grant brings
    finally:
        for w in ranks:
            w.close()


def test_scheduler_holds_blocks_only_for_requests_with_saves() -> None:
    sched = SchedulerSide(CS, BS, [], delay_free=True)
    req = SimpleNamespace(
        request_id="a", prompt_token_ids=list(range(2 * CS)), block_hashes=[], lora_request=None,
        mm_features=None, cache_salt=None,
    )  # fmt: skip
    sched.lookup(req, 0)
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="a", block_ids=([0, 1, 2, 3],), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens={"a": 2 * CS},
        preempted_req_ids={"z"},
    )  # fmt: skip
    meta = sched.build_meta(out)
    assert [s.req_id for s in meta.saves] == ["a"] and meta.preempted == ["z"]
    assert sched.finished(req) is True
    other = SimpleNamespace(**{**vars(req), "request_id": "b"})
    assert sched.finished(other) is False
    assert SchedulerSide(CS, BS, []).finished(req) is False  # vLLM-CPU: never held


def test_layerwise_off_ignores_the_layer_hooks() -> None:
    w = _worker()
    w.close()
    heads, d = 2, 8
    layers = vllm_layers(3, 24, BS, heads, d, torch.bfloat16, KVCacheLayout.LBNHC, seed=5)
    engine = CacheEngine(
        {"chunk_size": CS, "max_local_cpu_size": 0.01},
        layout=KVLayout(3, heads, d, torch.bfloat16),
        model_id="d",
    )
    w = WorkerSide(engine, layers, BS, page=KVPages(BS), layer_names=NAMES, layerwise=False)
    try:
        w.wait_for_layer(NAMES[0])
        assert not w._layerwise
    finally:
        w.close()


def test_connector_asks_for_piecewise_graphs_only_for_layerwise_loads() -> None:
    # The default (whole-chunk loads) keeps vLLM's full CUDA graphs.
    assert not KVMeshConnector.requires_piecewise_for_cudagraph({})
    assert not KVMeshConnector.requires_piecewise_for_cudagraph({"layerwise_load": False})
    assert KVMeshConnector.requires_piecewise_for_cudagraph({"layerwise_load": True})


def test_layerwise_load_option_is_a_bool() -> None:
    from kvmesh.integrations.vllm.options import ConnectorOptions

    assert ConnectorOptions.from_extra_config({}, environ={}).layerwise_load is False
    assert ConnectorOptions.from_extra_config({"layerwise_load": False}, environ={}).layerwise_load is False
    with pytest.raises(ConfigError, match="layerwise_load must be true or false"):
        ConnectorOptions.from_extra_config({"layerwise_load": "yes"}, environ={})


def test_a_load_that_cannot_be_queued_is_recomputed_not_raised(worker: WorkerSide) -> None:
    tokens = list(range(300, 300 + CS))
    worker.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens, [0, 1], 0)]))
    assert worker.wait_for_writes(10)
    assert worker.lookup("b", 1, tokens) == CS
    worker.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, tokens, [5, 99], 0)]))  # no block 99
    assert worker.take_load_errors() == {5, 99}
    assert worker.stats()["connector"]["load_failures"] == 1
    assert worker.engine.stats()["cpu"]["pinned"] == 0


class _FakeStream:
    """Records the stream calls (fault-injection style stand-in for a CUDA stream)."""

    current: ClassVar[list[str]] = ["compute"]

    def __init__(self, name: str, log: list[tuple[str, str, str]]) -> None:
        self.name, self.log = name, log

    def record(self) -> Event:
        self.log.append((self.name, "record", _FakeStream.current[-1]))
        return Event()

    def wait(self, ev: Event | None) -> None:
        self.log.append((self.name, "wait", _FakeStream.current[-1]))

    def synchronize(self) -> None:
        self.log.append((self.name, "synchronize", _FakeStream.current[-1]))

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        _FakeStream.current.append(self.name)
        try:
            yield
        finally:
            _FakeStream.current.pop()


def test_stream_ordering_of_saves_and_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The order CUDA relies on: the compute event is recorded outside the side streams'
    contexts (where the current stream would be the side stream), the side stream waits on
    it before its copies, and the compute stream waits on the load events."""
    w = _worker()
    try:
        assert w.xfer is not None
        log: list[tuple[str, str, str]] = []
        compute = _FakeStream("compute", log)
        monkeypatch.setattr(type(w.xfer), "compute", property(lambda self: compute))
        w.xfer.save_stream = _FakeStream("save", log)  # type: ignore[assignment]
        w.xfer.load_stream = _FakeStream("load", log)  # type: ignore[assignment]
        tokens = list(range(10, 10 + CS))
        w.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", tokens, [0, 1], 0)]))
        assert w.wait_for_writes(10)
        assert log[:3] == [
            ("compute", "record", "compute"),
            ("save", "wait", "save"),
            ("save", "record", "save"),
        ]
        log.clear()
        assert w.lookup("b", 1, tokens) == CS
        w.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, tokens, [4, 5], 0)]))
        assert log[0] == ("compute", "record", "compute") and log[1] == ("load", "wait", "load")
        assert ("load", "record", "load") in log
        assert log[-1] == ("compute", "wait", "compute")  # the forward waits for the loads
    finally:
        w.close()
