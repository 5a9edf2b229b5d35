"""S3 tier against a real S3-compatible HTTP server: moto's standalone ``moto_server``
process on loopback (the most production-like S3 server that installs from the
registries here; MinIO and Ceph RGW do not). Includes the server killed mid-run."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.harness.stores import S3_CREDS as CREDS
from kvmesh.harness.stores import MotoServer
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import ChunkData, TierOptions, open_tier
from kvmesh.tiers.testing import random_chunks
from tests.waiting import eventually


@pytest.fixture
def bucket(moto: MotoServer, request: pytest.FixtureRequest) -> str:
    name = "kv-" + request.node.name.replace("_", "-")[:40].lower().strip("-")
    moto.client().create_bucket(Bucket=name)
    return name


LAYOUT = KVLayout(2, 2, 16, "bfloat16")


def _chunks(
    n: int, tokens: int = 64, seed: int = 0, layout: KVLayout = LAYOUT
) -> tuple[list[ChunkKey], list[ChunkData]]:
    return random_chunks(n, layout, tokens, seed)


def _tier(moto: MotoServer, bucket: str, query: str = "", **kw: object):  # type: ignore[no-untyped-def]
    url = f"s3://{bucket}/pfx?endpoint_url={moto.endpoint}&access_key_id=testing&secret_access_key=testing&region=us-east-1{query}"
    opts = TierOptions(
        name="remote", metrics=TierMetrics("remote"), probe_interval_s=0.2, timeout_s=2.0, retries=1, **kw
    )  # type: ignore[arg-type]
    return open_tier(url, opts)


@pytest.mark.slow
def test_round_trip_contains_delete_clear(moto: MotoServer, bucket: str) -> None:
    tier = _tier(moto, bucket)
    try:
        keys, chunks = _chunks(4)
        assert tier.contains(keys) == [False] * 4
        assert tier.get(keys) == [None] * 4
        assert tier.put(keys[:3], chunks[:3]) == [True] * 3
        assert tier.contains(keys) == [True, True, True, False]
        got = tier.get(keys)
        for c, g in zip(chunks[:3], got[:3], strict=True):
            assert g is not None and bytes(g.data) == bytes(c.data)
            np.testing.assert_array_equal(g.tokens, c.tokens)
        assert got[3] is None
        names = [o["Key"] for o in moto.client().list_objects_v2(Bucket=bucket)["Contents"]]
        assert all(n.startswith("pfx/kvm2-") for n in names)
        assert tier.delete(keys[:1]) == 1
        assert tier.contains(keys[:1]) == [False]
        moto.client().put_object(Bucket=bucket, Key="pfx/not-ours", Body=b"x")
        assert tier.clear() == 2
        assert tier.contains(keys) == [False] * 4
        assert moto.client().head_object(Bucket=bucket, Key="pfx/not-ours")  # left alone
        assert tier.metrics.counters["hits"] == 3 and tier.health() == "up"
    finally:
        tier.close()


@pytest.mark.slow
def test_large_chunk_uses_ranged_gets_and_multipart_upload(moto: MotoServer, bucket: str) -> None:
    big = KVLayout(4, 4, 64, "float32")  # 8 KiB per token: 768 tokens = 6 MiB
    tier = _tier(moto, bucket, "&range_bytes=1048576&multipart_bytes=5242880", codec="zstd")
    try:
        keys, chunks = _chunks(1, tokens=768, layout=big)
        assert tier.put(keys, chunks) == [True]
        head = moto.client().head_object(Bucket=bucket, Key="pfx/" + keys[0].text)
        assert "-" in head["ETag"]  # a multipart upload's ETag
        buf = np.empty(len(chunks[0].data), dtype=np.uint8)
        got = tier.get(keys, into=lambda n: buf.data if n == buf.nbytes else None)[0]
        assert got is not None and bytes(got.data) == bytes(chunks[0].data)
    finally:
        tier.close()


@pytest.mark.slow
def test_corrupt_object_is_a_miss_and_deleted(moto: MotoServer, bucket: str) -> None:
    tier = _tier(moto, bucket)
    try:
        keys, chunks = _chunks(2)
        tier.put(keys, chunks)
        c = moto.client()
        name = "pfx/" + keys[0].text
        blob = bytearray(c.get_object(Bucket=bucket, Key=name)["Body"].read())
        blob[-1] ^= 0xFF
        c.put_object(Bucket=bucket, Key=name, Body=bytes(blob))
        got = tier.get(keys)
        assert got[0] is None and got[1] is not None
        assert tier.metrics.counters["corrupt"] == 1
        assert tier.contains(keys[:1]) == [False]
    finally:
        tier.close()


@pytest.mark.slow
def test_server_killed_mid_run_gives_misses_then_recovers(tmp_path: Path) -> None:
    server = MotoServer(tmp_path)
    server.start()
    try:
        server.client().create_bucket(Bucket="kv-kill")
    except BaseException:
        server.kill()
        raise
    tier = _tier(server, "kv-kill")
    try:
        keys, chunks = _chunks(6)
        assert tier.put(keys[:3], chunks[:3]) == [True] * 3
        errors: list[BaseException] = []
        stop = threading.Event()

        def hammer() -> None:  # reads and writes in flight while the server dies
            while not stop.is_set():
                try:
                    tier.get(keys[:3])
                    tier.put(keys[3:], chunks[3:])
                except BaseException as exc:
                    errors.append(exc)

        worker = threading.Thread(target=hammer)
        worker.start()
        time.sleep(0.5)
        server.kill()  # moto keeps data in memory: it comes back empty
        time.sleep(1.0)
        stop.set()
        worker.join(30)
        assert not errors, errors[:3]
        t0 = time.monotonic()
        for _ in range(5):  # no exception reaches the caller, ever
            assert tier.get(keys[:3]) == [None] * 3
            assert tier.put(keys[3:], chunks[3:]) == [False] * 3
            assert tier.contains(keys) == [False] * 6
        assert tier.health() == "down"
        assert time.monotonic() - t0 < 20  # the breaker answers fast once open
        assert tier.metrics.counters["errors"] >= 3
        why = tier.metrics.snapshot()["skipped_by_reason"]  # every refused store, with why
        assert why["tier_down"] >= 15 and set(why) <= {"tier_down", "tier_error"}
        assert sum(why.values()) == tier.metrics.counters["skipped_stores"]
        server.start()
        server.client().create_bucket(Bucket="kv-kill")
        eventually(lambda: tier.health() == "up", 10)
        assert tier.health() == "up"
        assert tier.put(keys[3:], chunks[3:]) == [True] * 3
        assert all(g is not None for g in tier.get(keys[3:]))
    finally:
        tier.close()
        server.kill()


@pytest.mark.slow
def test_cache_engine_over_s3_with_lmcache_style_config(
    moto: MotoServer, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvmesh.config import CacheConfig
    from kvmesh.core.engine import CacheEngine

    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    cfg = CacheConfig.from_dict(
        {
            "chunk_size": 64,
            "local_cpu": False,
            "max_local_cpu_size": 0.01,
            "remote_url": f"s3://{bucket}/lmcache",
            "remote_serde": "safetensor",
            "extra_config": {"s3_endpoint": moto.endpoint, "s3_region": "us-east-1", "s3_num_io_threads": 4},
        }
    )
    eng = CacheEngine(cfg, layout=LAYOUT, model_id="m")
    try:
        tokens = list(range(256))
        kv = torch.randn(LAYOUT.shape(256)).to(torch.bfloat16)
        eng.store(tokens, kv)
        assert eng.wait_for_writes(20)
        assert eng.lower["remote"].contains(eng.keys.keys(tokens)) == [True] * 4
        eng.clear("cpu", force=True)
        n, out = eng.retrieve(tokens)
        assert n == 256 and torch.equal(out, kv)
        assert eng.metrics["remote"].counters["hits"] == 4
    finally:
        eng.close()


@pytest.mark.slow
def test_lmcache_virtual_host_url_reaches_its_endpoint(moto: MotoServer, bucket: str) -> None:
    """LMCache's ``s3://BUCKET.ENDPOINT`` (as Tigris and CoreWeave configurations write it)
    with its extra_config keys: the chunks land in BUCKET on that endpoint, under
    ``s3_file_prefix`` (before, the whole host was taken for a bucket name on AWS)."""
    from kvmesh.config import CacheConfig

    host = moto.endpoint.removeprefix("http://")
    cfg = CacheConfig.from_dict(
        {
            "chunk_size": 256,
            "remote_url": f"s3://{bucket}.{host}",
            "extra_config": {
                "s3_region": "us-east-1",
                "aws_access_key_id": "testing",
                "aws_secret_access_key": "testing",
                "disable_tls": True,
                "s3_file_prefix": "lmc",
                "s3_num_io_threads": 4,
            },
        }
    )
    assert cfg.remote_url is not None
    opts = TierOptions(name="remote", metrics=TierMetrics("remote"), timeout_s=2.0, retries=1)
    tier = open_tier(cfg.remote_url, opts)
    try:
        keys, chunks = _chunks(2)
        assert tier.put(keys, chunks) == [True, True]
        got = tier.get(keys)
        assert [bytes(g.data) for g in got if g is not None] == [bytes(c.data) for c in chunks]
        names = [o["Key"] for o in moto.client().list_objects_v2(Bucket=bucket)["Contents"]]
        assert len(names) == 2 and all(n.startswith("lmc/kvm2-") for n in names)
    finally:
        tier.close()


@pytest.mark.slow
def test_https_endpoint_with_a_private_ca(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An S3-compatible store serving https with a certificate of a private CA (MinIO, Ceph
    RGW behind a company CA): ``ca_bundle`` names the CA and chunks round-trip; without it the
    certificate does not verify, the tier starts down and says why; a CA for a plain http
    endpoint is refused as the configuration error it is."""
    from kvmesh.errors import ConfigError
    from kvmesh.harness.services import TlsFiles

    server = MotoServer(tmp_path, tls=TlsFiles.make(tmp_path / "tls"))
    server.start()
    try:
        server.client().create_bucket(Bucket="kv-tls")
        opts = TierOptions(name="remote", metrics=TierMetrics("remote"), probe_interval_s=0.2, timeout_s=2.0)
        tier = open_tier(server.tier_url("kv-tls"), opts)
        try:
            keys, chunks = _chunks(3)
            assert tier.put(keys, chunks) == [True] * 3
            got = tier.get(keys)
            assert [
                g is not None and bytes(g.data) == bytes(c.data) for g, c in zip(got, chunks, strict=True)
            ] == [True] * 3
        finally:
            tier.close()
        unverified = server.tier_url("kv-tls").split("&ca_bundle=", 1)[0]
        with caplog.at_level("WARNING", logger="kvmesh.tiers.breaker"):
            tier = open_tier(
                unverified, TierOptions(name="remote", metrics=TierMetrics("remote"), timeout_s=2.0)
            )
        try:
            assert tier.health() == "down" and tier.get(keys) == [None] * 3
            assert "CERTIFICATE_VERIFY_FAILED" in caplog.text, caplog.text
        finally:
            tier.close()
        plain = unverified.replace("https://", "http://") + f"&ca_bundle={server.tls.ca}"  # type: ignore[union-attr]
        with pytest.raises(ConfigError, match="plain http"):
            open_tier(plain, TierOptions(name="remote", metrics=TierMetrics("remote")))
    finally:
        server.kill()
