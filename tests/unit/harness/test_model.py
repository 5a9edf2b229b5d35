"""Tiny models: which directory is used as is, which is built, and the connector config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.config import CacheConfig
from kvmesh.errors import ConfigError
from kvmesh.harness import connector, model


def test_ensure_model_uses_any_existing_model_as_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple[str, dict[str, object]]] = []
    monkeypatch.setattr(model, "make_tiny", lambda out_dir, **kw: built.append((str(out_dir), kw)))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert model.ensure_model(mine) == str(mine)
    assert built == []  # a user's model (not made by make_tiny) is left alone
    assert model.ensure_model(tmp_path / "new", "bench") == str(tmp_path / "new")
    assert built == [(str(tmp_path / "new"), model.PRESETS["bench"])]
    with pytest.raises(ValueError, match="valid: tiny, bench"):
        model.ensure_model(tmp_path / "x", "huge")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert model.ensure_model(empty) == str(empty) and built[-1][0] == str(empty)


def test_ensure_model_writes_nothing_over_other_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``--model`` that names a directory of other things (or a file) is a clear error, not a
    tiny model built in among them."""
    monkeypatch.setattr(model, "make_tiny", lambda out_dir, **kw: pytest.fail("built a model"))
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds no model"):
        model.ensure_model(tmp_path)
    with pytest.raises(ConfigError, match="holds no model"):
        model.ensure_model(tmp_path / "notes.txt")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_make_tiny_validates_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of heads"):
        model.make_tiny(tmp_path / "m", hidden=250, heads=4)
    with pytest.raises(ValueError, match="head size"):
        model.make_tiny(tmp_path / "m", hidden=48, heads=4, kv_heads=2)
    assert not (tmp_path / "m").exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not written by make_tiny"):
        model.make_tiny(tmp_path / "busy", vocab=600, layers=1, hidden=128, heads=2, kv_heads=1)


def test_connector_config_is_a_valid_kvmesh_config() -> None:
    cfg = connector.connector_config("redis://127.0.0.1:1/0")
    assert cfg["kv_connector"] == "KVMeshConnector"
    assert cfg["kv_connector_module_path"] == "kvmesh.integrations.vllm"
    assert cfg["kv_role"] == "kv_both" and cfg["kv_load_failure_policy"] == "recompute"
    extra = cfg["kv_connector_extra_config"]
    # The shipped chunk size: not pinned, so the connector's default applies.
    assert extra == {"max_local_cpu_size": 0.5, "remote_url": "redis://127.0.0.1:1/0"}
    assert CacheConfig.from_dict(extra).chunk_size == connector.shipped_chunk_size() == 128
    local = connector.connector_config(local_disk="/tmp/d", chunk_size=256)["kv_connector_extra_config"]
    assert local == {"chunk_size": 256, "max_local_cpu_size": 0.5, "local_disk": "/tmp/d"}
    CacheConfig.from_dict(local)


def test_make_tiny_lora_writes_a_peft_adapter_that_changes_the_model(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import load_file

    from kvmesh.core.fingerprint import adapter_fingerprint

    base = tmp_path / "base"
    base.mkdir()
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    (base / "config.json").write_text(json.dumps(cfg))
    a = model.make_tiny_lora(base, tmp_path / "a", seed=1, rank=4)
    again = model.make_tiny_lora(base, tmp_path / "again", seed=1, rank=4)
    b = model.make_tiny_lora(base, tmp_path / "b", seed=2, rank=4)
    config = json.loads((a / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == ("LORA", 4, ["q_proj", "v_proj"])
    tensors = load_file(str(a / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1.self_attn"
    assert tensors[f"{prefix}.q_proj.lora_A.weight"].shape == (4, 64)
    assert tensors[f"{prefix}.q_proj.lora_B.weight"].shape == (64, 4)  # 4 heads x 16
    assert tensors[f"{prefix}.v_proj.lora_B.weight"].shape == (32, 4)  # 2 kv heads x 16
    assert all(np.abs(t).sum() > 0 for t in tensors.values())  # B is not peft's zero init
    assert adapter_fingerprint(a) == adapter_fingerprint(again) != adapter_fingerprint(b)
    with pytest.raises(ValueError, match=r"config\.json"):
        model.make_tiny_lora(tmp_path / "nowhere", tmp_path / "c")


def test_swa_preset_alternates_sliding_window_and_full_attention(tmp_path: Path) -> None:
    # vLLM's Llama reads layer_types and sliding_window (tests/e2e/test_vllm_hybrid.py runs it).
    assert model.PRESETS["swa"]["sliding_window"] == 256
    small = {**model.PRESETS["swa"], "vocab": 600, "hidden": 128, "heads": 2, "kv_heads": 1}
    cfg = json.loads((model.make_tiny(tmp_path / "swa", **small) / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert cfg["sliding_window"] == 256
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        model.make_tiny(tmp_path / "bad", **{**small, "sliding_window": 0})
