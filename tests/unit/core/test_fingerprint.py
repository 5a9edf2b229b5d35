"""Model fingerprints: keyed by the weights' content, not the model's name (issue #12).

Real safetensors files on disk (the ``safetensors`` library writes them), real engines
sharing a real directory tier.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from kvmesh import CacheEngine, KVLayout
from kvmesh.core.fingerprint import commit_of, model_fingerprint, weights_identity
from kvmesh.errors import ConfigError
from kvmesh.integrations.vllm.identity import replica_identity

LAYOUT = KVLayout(2, 2, 8, torch.float32)
CS = 16


def write_model(path: Path, seed: int, *, name_or_path: str | None = None, layers: int = 2) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"model_type": "llama", "num_hidden_layers": layers, "hidden_size": 64}
    if name_or_path is not None:
        config["_name_or_path"] = name_or_path
        config["transformers_version"] = f"5.{seed}.0"
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    tensors = {
        f"model.layers.{i}.w": rng.standard_normal((256, 64)).astype(np.float32) for i in range(layers)
    }
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_same_path_new_weights_changes_the_fingerprint(tmp_path: Path) -> None:
    """A fine-tune keeps names, shapes and config: only the bytes differ."""
    model = tmp_path / "llama"
    before = model_fingerprint(str(write_model(model, seed=1)))
    after = model_fingerprint(str(write_model(model, seed=2)))
    assert before != after


def test_same_weights_two_paths_share_the_fingerprint(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a" / "llama", seed=1, name_or_path="/a/llama")
    b = tmp_path / "copy" / "elsewhere"
    shutil.copytree(a, b)
    (b / "config.json").write_text(
        json.dumps(
            {
                **json.loads((a / "config.json").read_text()),
                "_name_or_path": "/b",
                "transformers_version": "x",
            }
        )
    )
    assert model_fingerprint(str(a)) == model_fingerprint(str(b))
    assert model_fingerprint(str(a), mode="full") == model_fingerprint(str(b), mode="full")


def test_config_and_kv_settings_are_part_of_it(tmp_path: Path) -> None:
    base = model_fingerprint(str(write_model(tmp_path / "m", seed=1)))
    assert base != model_fingerprint(str(tmp_path / "m"), kv_settings={"kv_cache_dtype": "fp8"})
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"factor": 2.0}}))
    assert base != model_fingerprint(str(tmp_path / "m"))


def test_full_mode_sees_a_change_the_samples_miss(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", seed=1)
    weights = model / "model.safetensors"
    sampled, full = model_fingerprint(str(model)), model_fingerprint(str(model), mode="full")
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 + 5000] ^= 0xFF  # between two samples
    weights.write_bytes(bytes(data))
    assert model_fingerprint(str(model)) == sampled  # the documented limit of sampling
    assert model_fingerprint(str(model), mode="full") != full


def test_unidentifiable_models_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model_fingerprint"):
        model_fingerprint(f"nobody/not-cached-{uuid.uuid4().hex}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        weights_identity(tmp_path / "empty")
    bad = write_model(tmp_path / "bad", seed=1)
    (bad / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match="safetensors header"):
        weights_identity(bad)
    with pytest.raises(ConfigError, match="mode"):
        model_fingerprint(str(bad), mode="most")  # type: ignore[arg-type]


def test_a_hub_commit_identifies_a_model_without_files() -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    revision = SimpleNamespace(resolved=commit)
    assert commit_of(revision) == commit and commit_of("main") is None
    fp = model_fingerprint(f"org/absent-{uuid.uuid4().hex}", revision=commit)
    assert fp.startswith("fp1:") and fp != model_fingerprint("org/other", revision=commit)


def vllm_config(model: Path, dtype: str = "float32") -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=str(model), revision=None, dtype=dtype, quantization=None, hf_overrides={}
        ),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )


def test_replica_identity_override_and_vllm_settings(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", seed=1)
    assert replica_identity(vllm_config(model), "release-7") == "release-7"
    assert replica_identity(vllm_config(model)) != replica_identity(vllm_config(model, "bfloat16"))
    assert replica_identity(vllm_config(model), "full") != replica_identity(vllm_config(model))


def _engine(identity: str, shared: Path) -> CacheEngine:
    return CacheEngine(
        {"chunk_size": CS, "max_local_cpu_size": 0.01, "remote_url": f"fs://{shared}"},
        layout=LAYOUT,
        model_id=identity,
    )


def test_engines_share_chunks_exactly_when_the_weights_match(tmp_path: Path) -> None:
    """Same name, other weights -> no shared chunk; same weights, two paths -> shared."""
    shared = tmp_path / "shared"
    tokens = list(range(4 * CS))
    kv = torch.arange(np.prod(LAYOUT.shape(len(tokens))), dtype=torch.float32).view(LAYOUT.shape(len(tokens)))
    first = write_model(tmp_path / "models" / "llama", seed=1)
    writer = _engine(replica_identity(vllm_config(first)), shared)
    writer.store(tokens, kv)
    writer.wait_for_writes()
    writer.close()

    copy = tmp_path / "other-host" / "llama"
    shutil.copytree(first, copy)
    sharer = _engine(replica_identity(vllm_config(copy)), shared)
    assert sharer.lookup(tokens) == len(tokens)
    sharer.close()

    write_model(first, seed=2)  # the checkpoint at the same path is replaced
    replaced = _engine(replica_identity(vllm_config(first)), shared)
    assert replaced.lookup(tokens) == 0
    replaced.close()
