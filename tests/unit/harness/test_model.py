"""Tiny models: which directory is used as is, which is built, and the connector config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.config import CacheConfig
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
    assert extra == {"chunk_size": 256, "max_local_cpu_size": 0.5, "remote_url": "redis://127.0.0.1:1/0"}
    CacheConfig.from_dict(extra)
    local = connector.connector_config(local_disk="/tmp/d", chunk_size=128)["kv_connector_extra_config"]
    assert local == {"chunk_size": 128, "max_local_cpu_size": 0.5, "local_disk": "/tmp/d"}
    CacheConfig.from_dict(local)
