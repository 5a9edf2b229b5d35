"""LoRA adapters: identified by their weights, and their chunks live in their own namespace
(issue #26; LMCache once served adapter B the KV of adapter A, vllm#44250)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from kvmesh import CacheEngine, KVLayout
from kvmesh.core.fingerprint import adapter_fingerprint
from kvmesh.core.keys import KeyBuilder
from kvmesh.errors import ConfigError

LAYOUT = KVLayout(2, 2, 8, torch.float32)


def write_adapter(path: Path, seed: int, *, base: str = "/models/base", rank: int = 4) -> Path:
    """A peft-format adapter: adapter_config.json and adapter_model.safetensors."""
    path.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": base,
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    tensors = {
        f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.weight": rng.standard_normal(
            (rank, 64) if ab == "A" else (64, rank)
        ).astype(np.float32)
        for m in ("q_proj", "v_proj")
        for ab in ("A", "B")
    }
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def test_same_bytes_under_another_path_share_the_fingerprint(tmp_path: Path) -> None:
    a = write_adapter(tmp_path / "a", seed=1)
    copy = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(a, copy)
    # the base model's path is not part of it: a copy pointing elsewhere is the same adapter
    cfg = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "other/path"}))
    assert adapter_fingerprint(a) == adapter_fingerprint(copy)
    assert adapter_fingerprint(a).startswith("lora-fp1:")


def test_changed_weights_or_config_change_the_fingerprint(tmp_path: Path) -> None:
    a = adapter_fingerprint(write_adapter(tmp_path / "a", seed=1))
    b = adapter_fingerprint(write_adapter(tmp_path / "b", seed=2))
    alpha = write_adapter(tmp_path / "alpha", seed=1)
    cfg = json.loads((alpha / "adapter_config.json").read_text())
    (alpha / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 16}))
    assert len({a, b, adapter_fingerprint(alpha)}) == 3


def test_fingerprint_is_computed_once_per_path(tmp_path: Path) -> None:
    a = write_adapter(tmp_path / "a", seed=1)
    first = adapter_fingerprint(a)
    (a / "adapter_model.safetensors").unlink()  # never read again in this process
    assert adapter_fingerprint(a) == first


@pytest.mark.parametrize("damage", ["missing_dir", "no_config", "bad_config", "no_weights", "bad_header"])
def test_missing_or_corrupt_adapters_are_refused_clearly(tmp_path: Path, damage: str) -> None:
    path = tmp_path / damage
    if damage != "missing_dir":
        write_adapter(path, seed=1)
    if damage == "no_config":
        (path / "adapter_config.json").unlink()
    elif damage == "bad_config":
        (path / "adapter_config.json").write_text("{not json")
    elif damage == "no_weights":
        (path / "adapter_model.safetensors").unlink()
    elif damage == "bad_header":
        (path / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match="cannot fingerprint the LoRA adapter"):
        adapter_fingerprint(path)


def test_base_model_keys_are_unchanged_by_adapter_support() -> None:
    """Chunks saved before adapters existed keep their names (no adapter field for the base)."""
    kb = KeyBuilder("m", LAYOUT, 4)
    assert kb.for_adapter(None) is kb
    assert kb.namespace == KeyBuilder("m", LAYOUT, 4, adapter=None).namespace
    a = kb.for_adapter("lora-fp1:aa")
    assert a is kb.for_adapter("lora-fp1:aa") and a.for_adapter(None).namespace == kb.namespace


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=40),
    adapters=st.lists(st.text(min_size=1, max_size=12), min_size=2, max_size=4, unique=True),
)
def test_keys_differ_across_adapters_and_the_base_for_the_same_tokens(
    tokens: list[int], adapters: list[str]
) -> None:
    kb = KeyBuilder("m", LAYOUT, 4, salt=None, save_unfull_chunk=True)
    names = [kb.keys(tokens)] + [kb.for_adapter(a).keys(tokens) for a in adapters]
    texts = [{k.text for k in keys} for keys in names]
    for i in range(len(texts)):
        for j in range(i + 1, len(texts)):
            assert not texts[i] & texts[j]
    for keys in names:  # still the documented kvm2-<ns>-r<shard>-<hash> form
        for k in keys:
            assert kb.parse(k.text) == k


def test_an_adapter_view_shares_the_tiers_but_never_the_chunks(tmp_path: Path) -> None:
    engine = CacheEngine({"chunk_size": 4, "max_local_cpu_size": 0.01}, layout=LAYOUT, model_id="m")
    try:
        a = engine.for_adapter("lora-fp1:a")
        assert a.for_adapter("lora-fp1:a") is a and a.for_adapter(None) is engine
        tokens = list(range(8))
        kv = torch.randn(LAYOUT.shape(8))
        assert a.store(tokens, kv) == 8
        assert engine.cpu is a.cpu and engine.stats()["cpu"]["objects"] == 2  # one pool
        assert a.lookup(tokens) == 8
        assert engine.lookup(tokens) == 0  # the base model never sees adapter A's KV
        assert engine.for_adapter("lora-fp1:b").lookup(tokens) == 0  # nor does adapter B
        n, got = a.retrieve(tokens)
        assert n == 8 and torch.equal(got, kv)
    finally:
        engine.close()
