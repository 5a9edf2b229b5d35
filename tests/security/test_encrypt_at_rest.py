"""Finding 2 (issue #23), the reading side: token ids (the prompts) were stored in clear in
every chunk header, so anyone who can read the shared tier reads every tenant's prompts.

With ``encrypt_at_rest: true`` a reader of the tier learns neither prompts nor KV: the
stored bytes (files of a real ``fs://`` directory, values of a real ``redis-server``,
objects of a ``moto_server`` bucket) are searched for the prompt's token ids, as
little-endian u32 runs and as base64 of them, and for runs of the KV bytes; the same
search over a keyed but unencrypted store finds them (so the search can fail). Without a
fleet key, encryption is a ConfigError naming both keys, and a shared tier says plainly at
start-up, in its stats, in the engine's admin ``/health`` and in ``kvmesh config check``
that any writer can plant KV.
"""

from __future__ import annotations

import base64
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import httpx
import numpy as np
import pytest
import torch

from kvmesh import CacheEngine
from kvmesh.admin.server import AdminServer
from kvmesh.core.fleetkey import FleetKey
from kvmesh.errors import ConfigError
from kvmesh.harness.stores import MotoServer
from tests.security.chunks import CHUNK, LAYOUT, kv_for, prompt, raw_bytes

PLANT_WARNING = "anyone who can write to it can plant KV"


def stored_bytes(url: str, request: pytest.FixtureRequest) -> bytes:
    """Every byte the shared tier at ``url`` holds (names included)."""
    parts = urlsplit(url)
    if parts.scheme == "fs":
        return b"".join(p.name.encode() + p.read_bytes() for p in Path(parts.path).rglob("*") if p.is_file())
    if parts.scheme == "redis":
        import redis

        client = redis.Redis.from_url(url)
        try:
            out = []
            for name in client.scan_iter(match="*"):
                out.append(name + b"".join(k + v for k, v in client.hgetall(name).items()))
            return b"".join(out)
        finally:
            client.close()
    moto: MotoServer = request.getfixturevalue("moto")
    s3 = moto.client()
    bucket = parts.netloc
    names = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert dict(parse_qsl(parts.query))["endpoint_url"] == moto.endpoint
    return b"".join(n.encode() + s3.get_object(Bucket=bucket, Key=n)["Body"].read() for n in names)


def leaks(blob: bytes, tokens: list[int], kv: torch.Tensor) -> list[str]:
    """Where ``blob`` shows the prompt or its KV: any 4 consecutive token ids as LE u32, any
    12 bytes of them as base64 (at each of the 3 alignments), any 64 bytes of the KV."""
    found = []
    tb = np.asarray(tokens, dtype="<u4").tobytes()
    for i in range(len(tokens) - 3):
        if tb[4 * i : 4 * i + 16] in blob:
            found.append(f"token ids {i}..{i + 3} as LE u32")
    for off in range(3):
        enc = base64.b64encode(tb[off:])
        for j in range(0, len(enc) - 16, 4):
            if enc[j : j + 16] in blob:
                found.append(f"token bytes {off + 3 * j // 4}.. as base64")
    kvb = bytes(raw_bytes(kv))
    for j in range(0, len(kvb) - 64, 1024):
        if kvb[j : j + 64] in blob:
            found.append(f"KV bytes {j}..")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("shared_store", ["fs", "redis", "s3"], indirect=True)
def test_encrypted_tier_holds_no_token_ids_and_no_kv(
    shared_store: str,
    codec: str,
    key_file: Callable[..., str],
    make_engine: Callable[..., CacheEngine],
    request: pytest.FixtureRequest,
) -> None:
    key = key_file(FleetKey.generate())
    # The control: keyed, not encrypted. The search finds the prompt where it is in clear.
    tokens, kv = prompt(2 * CHUNK, seed=3), kv_for(2 * CHUNK, seed=3)
    macced = make_engine(shared_store, key=key, codec=codec)
    macced.store(tokens, kv)
    assert macced.wait_for_writes(20)
    assert any("base64" in w for w in leaks(stored_bytes(shared_store, request), tokens, kv))
    macced.clear("remote")

    tokens, kv = prompt(2 * CHUNK, seed=4), kv_for(2 * CHUNK, seed=4)
    sealed = make_engine(shared_store, key=key, codec=codec, encrypt=True)
    sealed.store(tokens, kv)
    assert sealed.wait_for_writes(20)
    blob = stored_bytes(shared_store, request)
    assert len(blob) > 2 * CHUNK * LAYOUT.bytes_per_token or codec == "zstd"  # the chunks are there
    assert leaks(blob, tokens, kv) == []
    # ... and replicas with the key read them back exactly.
    reader = make_engine(shared_store, key=key, encrypt=True)
    got, out = reader.retrieve(tokens)
    assert got == 2 * CHUNK and torch.equal(out[:, :, :got], kv)


def test_encryption_without_a_key_is_a_config_error(
    tmp_path: Path, make_engine: Callable[..., CacheEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVMESH_FLEET_KEY_FILE", raising=False)
    with pytest.raises(ConfigError) as err:
        make_engine(f"fs://{tmp_path}", encrypt=True)
    assert "encrypt_at_rest" in str(err.value) and "fleet_key_file" in str(err.value)


def test_a_shared_tier_without_a_key_says_any_writer_can_plant_kv(
    tmp_path: Path,
    make_engine: Callable[..., CacheEngine],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVMESH_FLEET_KEY_FILE", raising=False)
    url = f"fs://{tmp_path / 'shared'}"
    with caplog.at_level(logging.WARNING):
        eng = make_engine(url)
    assert any(PLANT_WARNING in r.getMessage() for r in caplog.records), "start-up says nothing"
    tokens, kv = prompt(CHUNK, seed=5), kv_for(CHUNK, seed=5)
    eng.store(tokens, kv)
    assert eng.wait_for_writes(20)
    assert eng.retrieve(tokens)[0] == CHUNK  # drop-in: it still works
    assert PLANT_WARNING in eng.stats()["remote"]["warning"]
    with AdminServer(eng, host="127.0.0.1", port=0) as admin:
        health = httpx.get(admin.url + "/kvmesh/admin/v1/health", timeout=10)
    assert health.status_code == 200
    assert any(PLANT_WARNING in w for w in health.json()["warnings"])

    cfg = tmp_path / "kvmesh.yaml"
    cfg.write_text(f"chunk_size: {CHUNK}\nremote_url: {url}\n")
    check = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "config", "check", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "KVMESH_FLEET_KEY_FILE"},
    )
    assert check.returncode == 0, check.stderr
    assert PLANT_WARNING in check.stdout


def test_a_keyed_shared_tier_does_not_warn(
    tmp_path: Path, key_file: Callable[..., str], make_engine: Callable[..., CacheEngine]
) -> None:
    eng = make_engine(f"fs://{tmp_path / 'shared'}", key=key_file(FleetKey.generate()))
    assert "warning" not in eng.stats()["remote"]
    assert eng.security_warnings() == []
