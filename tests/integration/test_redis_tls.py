"""The shared tier over TLS against real servers: a ``redis-server`` serving TLS only
(``--tls-port``, a certificate signed by the test's own CA), and a three-primary cluster with
``tls-cluster yes``. Chunks round-trip over ``rediss://`` and ``redis-cluster://...?ssl=true``
with the CA named (``ssl_ca_certs``); a server whose certificate does not verify is an
unreachable tier (misses, its cause said at start), never a connection that goes on
unverified, and plain TCP to a TLS port is a miss, not an error out of the read.

Managed Redis/Valkey with encryption in transit (ElastiCache, Memorystore, Azure Cache) is
where fleets run the shared tier; LMCache's ``tls_enable`` and ``use_tls`` map here."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import pytest

from kvmesh.core.keys import KVLayout
from kvmesh.harness.services import RedisServer, TlsFiles
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import Tier, TierOptions, open_tier
from kvmesh.tiers.testing import random_chunks

LAYOUT = KVLayout(2, 2, 16, "bfloat16")
PASSWORD = "tls-test-" + "p" * 32


def _tier(url: str, timeout_s: float = 1.0) -> Tier:
    opts = TierOptions(
        name="remote", metrics=TierMetrics("remote"), timeout_s=timeout_s, probe_interval_s=0.1
    )
    return open_tier(url, opts)


def _round_trip(tier: Tier, n: int = 6) -> None:
    keys, chunks = random_chunks(n, LAYOUT, 32, seed=3)
    assert tier.put(keys, chunks) == [True] * n, tier.metrics.snapshot()
    got = tier.get(keys)
    assert [g is not None and bytes(g.data) == bytes(c.data) for g, c in zip(got, chunks, strict=True)] == [
        True
    ] * n


@pytest.fixture
def tls_server(redis_server_factory: Callable[..., RedisServer], tmp_path: Path) -> RedisServer:
    return redis_server_factory(password=PASSWORD, tls=TlsFiles.make(tmp_path / "tls")).start()


def _with_password(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://:{PASSWORD}@{rest}"


@pytest.mark.redis
def test_chunks_round_trip_over_rediss_with_the_ca_named(tls_server: RedisServer) -> None:
    tier = _tier(_with_password(tls_server.url))
    try:
        assert tier.health() == "up"
        _round_trip(tier)
    finally:
        tier.close()


@pytest.mark.redis
def test_a_server_that_does_not_verify_is_unreachable_and_says_why(
    tls_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A certificate from a CA the client was not told to trust (a man in the middle, or a
    missing ``ssl_ca_certs``): the handshake fails before AUTH, so the password is never
    sent; every read is a miss; the start log names the certificate failure, which no retry
    mends."""
    other_ca = TlsFiles.make(tmp_path / "other").ca
    url = f"rediss://:{PASSWORD}@{tls_server.host}:{tls_server.port}/0?ssl_ca_certs={quote(str(other_ca))}"
    with caplog.at_level(logging.WARNING, logger="kvmesh.tiers.breaker"):
        tier = _tier(url)
    try:
        assert tier.health() == "down"
        assert "CERTIFICATE_VERIFY_FAILED" in caplog.text, caplog.text
        keys, chunks = random_chunks(2, LAYOUT, 32, seed=4)
        assert tier.put(keys, chunks) == [False, False] and tier.get(keys) == [None, None]
    finally:
        tier.close()


@pytest.mark.redis
def test_plain_tcp_to_a_tls_port_is_a_miss(tls_server: RedisServer) -> None:
    tier = _tier(f"redis://:{PASSWORD}@{tls_server.host}:{tls_server.port}/0")
    try:
        t0 = time.monotonic()
        keys, _ = random_chunks(2, LAYOUT, 32, seed=5)
        assert tier.get(keys) == [None, None]
        assert time.monotonic() - t0 < 3.0
        assert tier.health() == "down"
    finally:
        tier.close()
