"""Finding 10 (issue #23): chunk keys were an xxh3-128 chain, which is not collision-resistant,
and a read checked a chunk's own tokens, never its prefix.

Now the chain is SHA-256 (checked against an independent computation of the documented
recipe), so a key names its whole prefix; with a fleet key the header's MAC binds a chunk
to its key, so a chunk whose own tokens match but whose prefix differs (here: another
prompt's chunk relabelled by a writer without the key, what a chain collision would give)
is a miss. Chunks of the xxh3 version are misses, never misparsed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvmesh import CacheEngine
from kvmesh.core import serde
from kvmesh.core.fleetkey import FleetKey
from kvmesh.core.keys import KeyBuilder
from kvmesh.tiers.fs import FsTier
from tests.security.chunks import CHUNK, LAYOUT, kv_for, prompt, raw_bytes


def reference_keys(model: str, tokens: list[int], salt: str | None = None) -> list[str]:
    """The key recipe of kvmesh.core.keys, written out again from its docstring."""
    canon = json.dumps(
        {"v": "kvm2", "model": model, "layout": LAYOUT.to_dict(), "chunk_size": CHUNK, "salt": salt},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    prev = hashlib.sha256(canon).digest()
    out = []
    for s in range(0, len(tokens) - CHUNK + 1, CHUNK):
        prev = hashlib.sha256(prev + np.asarray(tokens[s : s + CHUNK], dtype="<u4").tobytes()).digest()
        out.append(f"kvm2-{hashlib.sha256(canon).hexdigest()[:16]}-r0-{prev.hex()}")
    return out


def test_keys_chain_sha256_over_the_whole_prefix() -> None:
    tokens = prompt(3 * CHUNK, seed=1)
    keys = [k.text for k in KeyBuilder("m", LAYOUT, CHUNK).keys(tokens)]
    assert keys == reference_keys("m", tokens)
    assert len(keys[0].rsplit("-", 1)[1]) == 64  # the whole 256-bit digest names the chunk
    salted = [k.text for k in KeyBuilder("m", LAYOUT, CHUNK, salt="t1").keys(tokens)]
    assert salted == reference_keys("m", tokens, salt="t1")
    other = tokens[:]
    other[0] += 1  # one token of the first chunk: every later key changes
    changed = [k.text for k in KeyBuilder("m", LAYOUT, CHUNK).keys(other)]
    assert all(a != b for a, b in zip(keys, changed, strict=True))


def test_a_chunk_of_another_prefix_with_the_same_tokens_is_a_miss(
    tmp_path: Path, key_file: Callable[..., str], make_engine: Callable[..., CacheEngine]
) -> None:
    url = f"fs://{tmp_path / 'shared'}"
    eng = make_engine(url, key=key_file(FleetKey.generate()))
    a, a2, b = prompt(CHUNK, seed=1), prompt(CHUNK, seed=2), prompt(CHUNK, seed=3)
    kv_ab, kv_a2 = kv_for(2 * CHUNK, seed=1), kv_for(CHUNK, seed=2)
    eng.store(a + b, kv_ab)
    eng.store(a2, kv_a2)
    assert eng.wait_for_writes(20)
    tier = eng.lower["remote"]
    assert isinstance(tier, FsTier)

    # A writer without the key relabels chunk 2 of A+B as chunk 2 of A'+B: its own tokens
    # (B) are right, its KV was computed after A, not A'.
    k_ab, k_a2b = eng.keys.keys(a + b)[1], eng.keys.keys(a2 + b)[1]
    blob = Path(tier.path(k_ab)).read_bytes()
    payload = blob[-CHUNK * LAYOUT.bytes_per_token :]
    assert payload == bytes(raw_bytes(kv_ab[:, :, CHUNK:]))  # a MAC, not encryption: readable
    forged = serde.encode_bytes(k_a2b, LAYOUT, np.asarray(b, dtype=np.uint32), payload)
    os.makedirs(os.path.dirname(tier.path(k_a2b)), exist_ok=True)
    Path(tier.path(k_a2b)).write_bytes(forged)

    got, out = eng.retrieve(a2 + b)
    assert got == CHUNK and torch.equal(out, kv_a2), "the relabelled chunk was served"
    assert eng.stats()["remote"]["unauthenticated"] >= 1


def _v1_chunk(key: str, tokens: list[int], kv: torch.Tensor) -> bytes:
    """A chunk as kvmesh's format version 1 wrote it (xxh3 checksums, tokens in clear)."""
    payload = bytes(raw_bytes(kv))
    meta = {
        "key": key,
        "layout": LAYOUT.to_dict(),
        "shape": list(LAYOUT.shape(len(tokens))),
        "codec": "raw",
        "raw_len": len(payload),
        "tokens": base64.b64encode(np.asarray(tokens, dtype="<u4").tobytes()).decode(),
        "checksum": xxhash.xxh3_128_hexdigest(payload),
    }
    hjson = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    head = struct.pack("<4sHHIQ", b"KVMC", 1, 0, len(hjson), len(payload)) + hjson
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + payload


def _v1_key(tokens: list[int]) -> str:
    canon = json.dumps(
        {"v": "kvm1", "model": "m", "layout": LAYOUT.to_dict(), "chunk_size": CHUNK, "salt": None},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    root = xxhash.xxh3_128(canon).digest()
    h = xxhash.xxh3_128(root + np.asarray(tokens[:CHUNK], dtype="<u4").tobytes()).digest()
    return f"kvm1-{root.hex()[:16]}-r0-{h.hex()}"


def test_chunks_of_the_xxh3_version_are_misses(
    tmp_path: Path, make_engine: Callable[..., CacheEngine]
) -> None:
    root = tmp_path / "shared"
    eng = make_engine(f"fs://{root}")
    tokens, kv = prompt(CHUNK, seed=7), kv_for(CHUNK, seed=7)
    old, today = _v1_key(tokens), eng.keys.keys(tokens)[0]
    # Where version 1 put it, and version-1 bytes under today's name.
    for name, sub in ((old, old.rsplit("-", 1)[1][:2]), (today.text, today.prefix_hash[:2])):
        (root / sub).mkdir(parents=True, exist_ok=True)
        (root / sub / f"{name}.kvc").write_bytes(_v1_chunk(name, tokens, kv))
    assert eng.lookup(tokens) == CHUNK  # the file under today's name exists ...
    assert eng.retrieve(tokens)[0] == 0  # ... and is refused, never misparsed
    assert eng.stats()["remote"]["corrupt"] == 1
