"""Chunk keys: stable across processes and hash seeds, strict about token input."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.core.keys import ChunkKey, KeyBuilder, KVLayout, as_token_array

REPO = Path(__file__).resolve().parents[3]
LAYOUT = KVLayout(2, 2, 8, "float32")
TOKENS = [(i * 7919) % 50000 for i in range(70)]

# keys.py is pure (numpy + hashlib). The child loads that file alone: importing the ``kvmesh``
# package pulls in torch through the engine, which would make four cold starts take seconds.
_KEYS_SCRIPT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("kvmesh_keys_under_test", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
KeyBuilder, KVLayout = mod.KeyBuilder, mod.KVLayout
kb = KeyBuilder("org/model-7b", KVLayout(2, 2, 8, "float32"), 16, shard=1, salt="tenant-a",
                save_unfull_chunk=True)
print(json.dumps([k.text for k in kb.keys([(i * 7919) % 50000 for i in range(70)])]))
"""


def _keys_here() -> list[str]:
    kb = KeyBuilder("org/model-7b", LAYOUT, 16, shard=1, salt="tenant-a", save_unfull_chunk=True)
    return [k.text for k in kb.keys(TOKENS)]


def test_keys_identical_across_processes_and_hash_seeds() -> None:
    procs = []
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _KEYS_SCRIPT, str(REPO / "kvmesh" / "core" / "keys.py")],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    expected = _keys_here()
    assert len(expected) == 5  # 4 full chunks of 16 and a partial one of 6
    assert expected[-1].endswith("-p6")
    for got in results:
        assert got == expected


def test_key_matches_the_documented_hash_chain() -> None:
    """Recompute the first two keys from the module's documented recipe, independently."""
    canon = json.dumps(
        {
            "v": "kvm2",
            "model": "m",
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float32"},
            "chunk_size": 4,
            "salt": None,
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    root = hashlib.sha256(canon).digest()
    tokens = [1, 2, 3, 2**32 - 1, 5, 6, 7, 8]
    h0 = hashlib.sha256(root + np.array(tokens[:4], dtype="<u4").tobytes()).digest()
    h1 = hashlib.sha256(h0 + np.array(tokens[4:], dtype="<u4").tobytes()).digest()
    keys = KeyBuilder("m", LAYOUT, 4).keys(tokens)
    ns = root.hex()[:16]
    assert [k.text for k in keys] == [f"kvm2-{ns}-r0-{h0.hex()}", f"kvm2-{ns}-r0-{h1.hex()}"]


@pytest.mark.parametrize(
    "tokens",
    [
        "hello",
        b"\x01\x02",
        [1, 2.0, 3],
        [1, None],
        [[1, 2], [3, 4]],
        [1, True],
        np.zeros((2, 3), dtype=np.int64),
        np.zeros(4, dtype=np.float32),
        np.array([1.0, 2.0]),
        torch.zeros(4, dtype=torch.float32),
        torch.zeros((2, 2), dtype=torch.int64),
        42,
        None,
        (t for t in [1, 2, 3]),
    ],
    ids=[
        "str",
        "bytes",
        "list-with-float",
        "list-with-none",
        "nested-list",
        "list-with-bool",
        "2d-array",
        "float32-array",
        "float64-array",
        "float-tensor",
        "2d-tensor",
        "int",
        "none",
        "generator",
    ],
)
def test_tokens_that_are_not_a_sequence_of_ints_raise_type_error(tokens: object) -> None:
    kb = KeyBuilder("m", LAYOUT, 4)
    with pytest.raises(TypeError):
        kb.keys(tokens)


@pytest.mark.parametrize(
    "tokens",
    [
        [1, -1],
        [2**32],
        [0, 2**40],
        [2**70],
        [-(2**70)],
        np.array([3, -5], dtype=np.int64),
        np.array([2**32], dtype=np.int64),
        np.array([2**64 - 1], dtype=np.uint64),
        torch.tensor([7, -1]),
    ],
)
def test_token_ids_out_of_range_raise_value_error(tokens: object) -> None:
    with pytest.raises(ValueError, match=r"2\*\*32"):
        KeyBuilder("m", LAYOUT, 4).keys(tokens)


def test_edge_ids_are_accepted() -> None:
    arr = as_token_array([0, 2**32 - 1])
    assert arr.dtype == np.dtype("<u4")
    assert arr.tolist() == [0, 2**32 - 1]


@pytest.mark.parametrize(
    "convert",
    [
        lambda t: torch.tensor(t, dtype=torch.int64),
        lambda t: torch.tensor(t, dtype=torch.int32),
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.array(t, dtype=np.int32),
        lambda t: tuple(t),
        lambda t: [np.int64(x) for x in t],
    ],
    ids=["torch-int64", "torch-int32", "np-int64", "np-uint32", "np-int32", "tuple", "np-scalars"],
)
def test_torch_and_numpy_token_inputs_give_the_same_keys(convert: Callable[[list[int]], object]) -> None:
    kb = KeyBuilder("m", LAYOUT, 16)
    tokens = TOKENS[:64]
    expected = [k.text for k in kb.keys(tokens)]
    assert len(expected) == 4
    assert [k.text for k in kb.keys(convert(tokens))] == expected


def test_strided_array_hashes_its_values_not_its_memory() -> None:
    kb = KeyBuilder("m", LAYOUT, 4)
    base = np.arange(16, dtype=np.int64)
    assert kb.keys(base[::2]) == kb.keys(list(range(0, 16, 2)))
    t = torch.arange(16)
    assert kb.keys(t[::2]) == kb.keys(list(range(0, 16, 2)))


def test_empty_and_short_prompts_have_no_full_chunk() -> None:
    kb = KeyBuilder("m", LAYOUT, 4)
    assert kb.keys([]) == []
    assert kb.keys(np.zeros(0, dtype=np.int64)) == []
    assert kb.keys([1, 2, 3]) == []
    assert KeyBuilder("m", LAYOUT, 4, save_unfull_chunk=True).keys([1, 2, 3])[0].text.endswith("-p3")


def test_parse_rejects_malformed_keys() -> None:
    key = KeyBuilder("m", LAYOUT, 4).keys([1, 2, 3, 4])[0]
    assert ChunkKey.parse(key.text, 4) == key
    for bad in (
        key.text + "x",
        key.text.replace("kvm2", "kvm1"),  # the xxh3-chained version: never read again
        key.text.replace("kvm2", "kvm3"),
        key.text[:-1],
        key.text.upper(),
        key.text + "-p",
        "kvm2-zz",
        key.text[:-32],  # a kvm1-length (128-bit) hash
        "",
    ):
        with pytest.raises(ValueError):
            ChunkKey.parse(bad, 4)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "16"])
def test_bad_chunk_size_raises_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        KeyBuilder("m", LAYOUT, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("args", [(0, 2, 8), (2, -1, 8), (2, 2, 0), (2.0, 2, 8), (True, 2, 8)])
def test_bad_layout_raises_value_error(args: tuple[object, object, object]) -> None:
    with pytest.raises(ValueError, match="KVLayout"):
        KVLayout(*args, "float32")  # type: ignore[arg-type]


def test_layout_accepts_torch_dtypes_and_rejects_unknown() -> None:
    assert KVLayout(2, 2, 8, torch.bfloat16) == KVLayout(2, 2, 8, "bfloat16")
    assert KVLayout(2, 2, 8, torch.float16).itemsize == 2
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        KVLayout(2, 2, 8, torch.int64)
