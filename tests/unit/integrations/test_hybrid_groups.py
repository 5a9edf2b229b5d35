"""KV cache groups (groups.py, hybrid.py): what the hybrid KV cache manager hands the
connector. vLLM's own spec classes build the configs; nothing here starts vLLM."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvmesh.integrations.vllm.connector import KVMeshConnector
from kvmesh.integrations.vllm.groups import FULL, SLIDING, Group, UnsupportedGroups, classify, main_group
from kvmesh.integrations.vllm.hybrid import best_point
from tests.unit.integrations.test_connector import settled

BS = 16


def _full(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32, **kw)


def _swa(window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=window
    )


def _mamba() -> MambaSpec:
    return MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,))


def _config(*groups: tuple[list[str], Any]) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups],
    )


def test_a_dense_model_is_one_full_attention_group() -> None:
    groups = classify(_config((["l.0", "l.1"], _full())))
    assert groups == [Group(0, FULL, ("l.0", "l.1"), BS)]
    assert main_group(groups) == 0


def test_sliding_window_and_full_groups_get_distinct_key_spaces() -> None:
    groups = classify(_config((["l.0", "l.2"], _swa(64)), (["l.1", "l.3"], _full())))
    swa, full = groups
    assert (swa.kind, swa.window, full.kind) == (SLIDING, 64, FULL)
    assert main_group(groups) == 1  # the full-attention group decides a prefix hit
    assert swa.tag != full.tag and "64" in swa.tag and "l.0,l.2" in swa.tag
    # the window: a load up to token 256 needs tokens 192.. of the sliding group, all of the full one
    assert (swa.first_needed(256), full.first_needed(256), swa.first_needed(40)) == (192, 0, 0)


def test_sliding_layers_under_a_full_spec_are_full_attention() -> None:
    # The hybrid manager off: vLLM keeps every block of a sliding layer (a full spec).
    assert classify(_config((["l.0"], _full(sliding_window=64)))) == [Group(0, FULL, ("l.0",), BS)]


def test_a_mamba_group_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedGroups, match=r"group 1 \(MambaSpec: layers l\.1, l\.3\)"):
        classify(_config((["l.0", "l.2"], _full()), (["l.1", "l.3"], _mamba())))


def test_a_sliding_window_only_model_is_refused() -> None:
    with pytest.raises(UnsupportedGroups, match="needs a full-attention KV cache group"):
        classify(_config((["l.0"], _swa(64))))


def _vllm_config(tmp_path: Path) -> Any:
    extra = {
        "chunk_size": 32,
        "admin_enabled": False,
        "socket_dir": str(tmp_path),
        "model_fingerprint": "stub@1",
    }
    tc = SimpleNamespace(
        kv_connector_extra_config=extra,
        kv_role="kv_both",
        engine_id="unit",
        kv_load_failure_policy="recompute",
        is_kv_producer=True,
        is_kv_consumer=True,
        kv_port=0,
    )
    return SimpleNamespace(
        kv_transfer_config=tc,
        cache_config=SimpleNamespace(block_size=BS),
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_rank=0
        ),
    )


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_the_connector_stays_out_of_a_model_with_a_mamba_group(
    role: KVConnectorRole, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert supports_hma(KVMeshConnector)
    cfg = _config((["l.0", "l.2"], _full()), (["l.1", "l.3"], _mamba()))
    with caplog.at_level(logging.ERROR, logger="kvmesh.integrations.vllm.connector"):
        c = KVMeshConnector(_vllm_config(tmp_path), role, cfg)
    assert "MambaSpec: layers l.1, l.3" in caplog.text and "stays off" in caplog.text
    assert c.refused is not None and c._sched is None  # no lookup clients, no scheduler side
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(100)))
    assert c.get_num_new_matched_tokens(request, 0) == (0, False)
    assert c.request_finished_all_groups(request, ([1], [2])) == (False, None)
    assert c.build_connector_meta(SimpleNamespace()).saves == []
    c.register_kv_caches({"l.0": torch.zeros(1)})  # nothing started: vLLM runs without kvmesh
    assert c._worker is None and c._server is None


def test_a_load_point_needs_every_groups_window() -> None:
    bounds = [(0, 32), (32, 64), (64, 96), (96, 128)]
    # A window of 40 tokens: a load up to point p needs the chunks holding tokens p-40..p-1.
    swa = SimpleNamespace(first_chunk=lambda point, b: sum(1 for _, e in b if e <= max(0, point - 40)))
    # Held: chunks 1, 2. Point 128 needs chunks 2..3 (3 missing); 96 needs 1..2: the hit.
    assert best_point(4, bounds, [swa], [[False, True, True, False]]) == 3  # type: ignore[list-item]
    # Held: chunks 2, 3. Point 128 needs 2..3: the hit, unless the full group stops earlier:
    # with 2 chunks there, 64 needs 0..1 and 32 needs 0, none of them held.
    assert best_point(4, bounds, [swa], [[False, False, True, True]]) == 4  # type: ignore[list-item]
    assert best_point(2, bounds, [swa], [[False, False, True, True]]) == 0  # type: ignore[list-item]


# -- the worker with a sliding-window group (real engines, vLLM-CPU's page layout) ----------
CS = 256  # chunk size
WINDOW = 256
TOKENS = list(range(3000, 3000 + 1025))
MAIN_SRC, MAIN_DST = list(range(1, 9)), list(range(13, 21))
# vLLM frees a sliding group's blocks left of the window: its block table holds the null block.
SWA_SRC, SWA_DST = [0] * 6 + [7, 8], [0] * 6 + [15, 16]


@pytest.fixture
def hybrid_worker(tmp_path: Path) -> Any:
    from kvmesh import CacheEngine, KVLayout
    from kvmesh.integrations.vllm.hybrid import GroupStore
    from kvmesh.integrations.vllm.layouts import CpuPackedPages
    from kvmesh.integrations.vllm.worker import WorkerSide
    from tests.unit.integrations.test_connector import BS as CPU_BS
    from tests.unit.integrations.test_connector import paged

    layout = KVLayout(2, 2, 16, torch.float32)
    cfg = {"chunk_size": CS, "max_local_cpu_size": 0.01, "admin_enabled": False}
    swa = Group(0, SLIDING, ("l.0", "l.2"), CPU_BS, WINDOW)
    main = CacheEngine(cfg, layout=layout, model_id="m|g1")
    store = GroupStore(
        swa, CacheEngine(cfg, layout=layout, model_id=f"m|{swa.tag}"), paged(2, 24), CpuPackedPages(CPU_BS)
    )
    w = WorkerSide(main, paged(2, 24), CPU_BS, groups=[store], async_loads="all")
    yield w
    w.close()


def _save(w: Any) -> None:
    from kvmesh.integrations.vllm.metadata import KVMeshConnectorMetadata, SaveSpec

    spec = SaveSpec("a", TOKENS[:1024], MAIN_SRC, 0, group_blocks=[SWA_SRC, MAIN_SRC])
    w.end_step(KVMeshConnectorMetadata(saves=[spec]))
    assert w.wait_for_writes(10)


def _load(w: Any) -> set[str]:
    import time

    from kvmesh.integrations.vllm.metadata import KVMeshConnectorMetadata, LoadSpec

    spec = LoadSpec("b", 1, TOKENS[:1024], MAIN_DST, 0, load_async=True, group_blocks=[SWA_DST, MAIN_DST])
    w.start_step(KVMeshConnectorMetadata(loads=[spec]))
    end = time.monotonic() + 10
    while time.monotonic() < end:
        got: set[str] = w.finished_loading(set())
        if got:
            return got
        time.sleep(0.01)
    return set()


def test_a_sliding_group_stores_only_its_window_and_loads_it_back(hybrid_worker: Any) -> None:
    w = hybrid_worker
    (store,) = w.groups
    _save(w)
    # 4 chunks of the full group, 1 (tokens 768..1023, the window before 1024) of the sliding one
    assert w.engine.stats()["cpu"]["objects"] == 4 and store.engine.stats()["cpu"]["objects"] == 1
    assert settled(w, "b", 1, TOKENS[:1024]) == {"tokens": 1024, "lower": True}
    assert _load(w) == {"b"} and w.take_failed_loads() == set()
    for layer in w.layers:
        assert torch.equal(layer[MAIN_DST], layer[MAIN_SRC])
    for layer in store.layers:
        assert torch.equal(layer[[15, 16]], layer[[7, 8]])
    assert w.engine.stats()["cpu"]["pinned"] == 0 and store.engine.stats()["cpu"]["pinned"] == 0


def test_a_point_whose_window_is_missing_is_no_hit(hybrid_worker: Any) -> None:
    w = hybrid_worker
    _save(w)
    # The full group holds 768 tokens of this prefix, but the sliding group lacks tokens
    # 512..767 (its window before 768) and every earlier window: nothing can be loaded.
    assert settled(w, "c", 1, TOKENS[:768]) == {"tokens": 0, "lower": False}
    w.clear("cpu")  # a clear empties every group's engine
    assert [e.stats()["cpu"]["objects"] for e in (w.engine, w.groups[0].engine)] == [0, 0]


def test_a_short_load_is_a_failed_receive_not_a_block_error(hybrid_worker: Any) -> None:
    w = hybrid_worker
    (store,) = w.groups
    _save(w)
    assert settled(w, "b", 1, TOKENS[:1024])["tokens"] == 1024
    store.engine.clear("cpu", force=True)  # the window's chunk is gone before the read
    assert _load(w) == {"b"}  # named (vLLM leaves WAITING_FOR_REMOTE_KVS) ...
    assert w.take_failed_loads() == {"b"}  # ... as failed: vLLM recomputes the request
    assert w.take_load_errors() == set()  # never block ids: they are per group


def test_the_scheduler_plans_every_groups_blocks_and_loads_asynchronously() -> None:
    from kvmesh.integrations.vllm.scheduler import SchedulerSide
    from tests.unit.integrations.test_async_loads import AnswerRank
    from tests.unit.integrations.test_connector import request

    s = SchedulerSide(CS, 128, [AnswerRank([{"tokens": 1024, "lower": False}])], groups=2, main_group=1)
    r = request("a", 1025)
    assert s.lookup(r, 0) == 1024 and s.load_async("a")  # hybrid: always asynchronous
    swa, full = [0] * 6 + [7, 8, 9], list(range(20, 29))
    s.after_alloc(r, full, 1024, (swa, full))
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="a", block_ids=(swa, full), num_computed_tokens=1024)],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
        ),
        num_scheduled_tokens={"a": 1},
        preempted_req_ids=set(),
    )
    meta = s.build_meta(out)
    (load,) = meta.loads
    assert load.block_ids == full[:8] and load.group_blocks == [swa[:8], full[:8]]


@pytest.mark.parametrize(
    ("device", "pd", "why"),
    [("cuda", False, "with KV on cuda"), ("cpu", True, "prefill/decode hand-over of a hybrid model")],
)
def test_a_hybrid_model_kvmesh_cannot_serve_yet_is_refused_by_name(
    device: str,
    pd: bool,
    why: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvmesh.integrations.vllm.connector as connector_mod

    if pd:
        monkeypatch.setattr(connector_mod, "pd_mode", lambda options, role: "pull")
    cfg = _vllm_config(tmp_path)
    cfg.device_config = SimpleNamespace(device_type=device)
    groups = _config((["l.0", "l.2"], _swa(64)), (["l.1", "l.3"], _full()))
    with caplog.at_level(logging.ERROR, logger="kvmesh.integrations.vllm.connector"):
        c = KVMeshConnector(cfg, KVConnectorRole.WORKER, groups)
    assert c.refused is not None and why in c.refused and "sliding_window64" in c.refused
    assert "stays off" in caplog.text
    cfg.device_config.device_type = "cpu"
    monkeypatch.undo()
    assert KVMeshConnector(cfg, KVConnectorRole.WORKER, groups).refused is None  # vLLM-CPU: served
