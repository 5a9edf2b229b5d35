"""``KVMeshConnector.register_kv_caches`` against what vLLM reports: each claimed backend
starts with its adapter, the others are refused by name. The KV tensors are vLLM's own
views on the ``meta`` device (shapes and strides, no memory), which stands in for a GPU: the
connector only asks for "not CPU"; the vLLM config is a stub holding the fields it reads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector import utils as kv_utils
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvmesh.integrations.vllm.connector import KVMeshConnector
from kvmesh.integrations.vllm.layouts import CpuPackedPages, KVPages, LatentPages
from kvmesh.integrations.vllm.options import ConnectorOptions
from tests.unit.integrations.vllm_pages import vllm_layers

BS = 16
L = 4


def _connector(tmp_path: Path, mla: bool, layout: str, cache_dtype: str = "auto") -> Any:
    c: Any = object.__new__(KVMeshConnector)  # the worker half only: no scheduler RPC clients
    model = SimpleNamespace(
        get_num_layers=lambda par: L,
        get_num_kv_heads=lambda par: 2,
        get_head_size=lambda: 24 if mla else 8,
        use_mla=mla,
        model="stub-model",
        dtype=torch.bfloat16,
    )
    c._vllm_config = SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, kv_cache_layout=layout, block_size=BS),
        kv_events_config=None,
    )
    c._kv_cache_config = SimpleNamespace(kv_tp_replicas=1)
    c.options = ConnectorOptions.from_extra_config(
        # A stub model has no weights to fingerprint: the operator names its identity.
        {
            "chunk_size": 32,
            "max_local_cpu_size": 0.01,
            "admin_enabled": False,
            "socket_dir": str(tmp_path),
            "model_fingerprint": "stub-model@1",
        },
        environ={},
    )
    c.block_size, c.engine_id, c.dp_rank = BS, "unit", 0
    c._worker = c._server = c._pd = None
    c.pd_mode = "off"  # kv_both without a fleet key
    c._kv_transfer_config = SimpleNamespace(is_kv_producer=False, kv_port=0)
    c._clients = []
    return c


def _kv(mla: bool, layout: KVCacheLayout, device: str) -> dict[str, torch.Tensor]:
    views = (
        vllm_layers(L, 8, BS, 2, 8, torch.bfloat16, layout, mla=mla)
        if not mla
        else vllm_layers(L, 8, BS, 1, 24, torch.bfloat16, layout, mla=True)
    )
    return {f"model.layers.{i}.attn": (v.to("meta") if device == "meta" else v) for i, v in enumerate(views)}


def _backend(name: str) -> Any:
    return SimpleNamespace(get_name=lambda: name)


@pytest.mark.parametrize(
    ("backend", "mla", "layout", "adapter"),
    [
        ("FLASH_ATTN", False, KVCacheLayout.LBNHC, KVPages),
        ("FLASHINFER", False, KVCacheLayout.LBHNC, KVPages),
        ("TRITON_ATTN", False, KVCacheLayout.BLNHC, KVPages),
        ("FLEX_ATTENTION", False, KVCacheLayout.LBNHC, KVPages),
        ("FLASHMLA", True, KVCacheLayout.LBHNC, LatentPages),
        ("TRITON_MLA", True, KVCacheLayout.LBNHC, LatentPages),
    ],
)
def test_each_claimed_gpu_backend_starts_with_its_adapter(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    mla: bool,
    layout: KVCacheLayout,
    adapter: type,
) -> None:
    monkeypatch.setattr(kv_utils, "get_current_attn_backends", lambda cfg, names=None: [_backend(backend)])
    c = _connector(tmp_path, mla, layout.name)
    try:
        c.register_kv_caches(_kv(mla, layout, "meta"))
        w = c._worker
        assert type(w.page) is adapter and w.xfer is not None
        assert w.engine.layout.kv_planes == (1 if mla else 2)
        assert w.engine.keys.shard == 0
    finally:
        c.shutdown()


def test_cpu_attention_keeps_the_cpu_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_utils, "get_current_attn_backends", lambda cfg, names=None: [_backend("CPU_ATTN")])
    monkeypatch.setattr(KVMeshConnector, "_check_cpu_isa", lambda self, layout: None)
    c = _connector(tmp_path, False, "LBHNC")
    try:
        c.register_kv_caches(_kv(False, KVCacheLayout.LBHNC, "cpu"))
        assert type(c._worker.page) is CpuPackedPages and c._worker.xfer is None  # the snapshot path
    finally:
        c.shutdown()


@pytest.mark.parametrize(
    ("backend", "mla", "layout", "dtype", "match"),
    [
        ("ROCM_ATTN", False, "LBHNC", "auto", "ROCM_ATTN"),
        ("FLASHMLA_SPARSE", True, "LBHNC", "auto", "FLASHMLA_SPARSE"),
        ("FLASH_ATTN", False, "LBHNC", "nvfp4", "nvfp4"),
        ("CPU_ATTN", False, "LBHNC", "auto", "KV on meta"),
    ],
)
def test_other_backends_and_dtypes_stop_the_worker_by_name(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    mla: bool,
    layout: str,
    dtype: str,
    match: str,
) -> None:
    monkeypatch.setattr(kv_utils, "get_current_attn_backends", lambda cfg, names=None: [_backend(backend)])
    c = _connector(tmp_path, mla, layout, dtype)
    with pytest.raises((NotImplementedError, ValueError), match=match):
        c.register_kv_caches(_kv(mla, KVCacheLayout[layout], "meta"))
    assert c._worker is None


def test_fp8_kv_allocated_as_bytes_is_keyed_as_fp8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        kv_utils, "get_current_attn_backends", lambda cfg, names=None: [_backend("FLASH_ATTN")]
    )
    c = _connector(tmp_path, False, "LBNHC", "fp8_e5m2")
    kv = {k: v.view(torch.uint8) for k, v in _kv(False, KVCacheLayout.LBNHC, "meta").items()}
    kv = {k: v[..., : v.shape[-1] // 2] for k, v in kv.items()}  # bf16 bytes -> 1-byte elements
    try:
        c.register_kv_caches(kv)
        assert c._worker.engine.layout.dtype == "float8_e5m2"
    finally:
        c.shutdown()


def test_a_kv_dtype_the_pool_cannot_hold_stops_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        kv_utils, "get_current_attn_backends", lambda cfg, names=None: [_backend("FLASH_ATTN")]
    )
    c = _connector(tmp_path, False, "LBNHC")
    kv = {
        k: torch.empty(v.shape, dtype=torch.float64, device="meta")
        for k, v in _kv(False, KVCacheLayout.LBNHC, "meta").items()
    }
    with pytest.raises(ValueError, match=r"unsupported KV dtype torch\.float64; supported: bfloat16"):
        c.register_kv_caches(kv)
