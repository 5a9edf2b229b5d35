"""``redis-sentinel://`` against real servers: a master, its replica and a ``redis-server
--sentinel`` watching them. LMCache's Sentinel URL (its master name from
``REDIS_SERVICE_NAME``) loads, chunks round-trip through the master the sentinel names, and
after a failover the tier follows the new master: the chunks written before are still read
and new writes land on the promoted replica."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from kvmesh.config import CacheConfig
from kvmesh.core.keys import KVLayout
from kvmesh.harness.services import RedisSentinel, RedisServer, TlsFiles
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import TierOptions, open_tier
from kvmesh.tiers.testing import random_chunks
from tests.waiting import wait_for

LAYOUT = KVLayout(2, 2, 16, "float32")
SERVICE = "kvmaster"
PASSWORD = "sentinel-test-pw"


def _master_port(sentinel: RedisSentinel) -> int:
    client = sentinel.client()
    try:
        _host, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(port)
    finally:
        client.close()


def _replica_ready(sentinel: RedisSentinel) -> bool:
    client = sentinel.client()
    try:
        replicas = client.execute_command("SENTINEL", "REPLICAS", SERVICE)
    finally:
        client.close()
    return any(r.get(b"flags") == b"slave" and r.get(b"master-link-status") == b"ok" for r in replicas)


@pytest.fixture
def sentinel_set(
    redis_server_factory: Callable[..., RedisServer], tmp_path: Path
) -> Iterator[tuple[RedisServer, RedisServer, RedisSentinel]]:
    master = redis_server_factory(password=PASSWORD).start()
    replica = redis_server_factory(
        password=PASSWORD, extra_args=("--replicaof", master.host, str(master.port))
    ).start()
    sentinel = RedisSentinel(master, SERVICE, workdir=tmp_path / "sentinel")
    try:
        sentinel.start()
        wait_for(lambda: _replica_ready(sentinel), 30.0, "the sentinel to see the replica")
        yield master, replica, sentinel
    finally:
        sentinel.kill()


def test_lmcache_sentinel_url_follows_a_failover(
    sentinel_set: tuple[RedisServer, RedisServer, RedisSentinel], monkeypatch: pytest.MonkeyPatch
) -> None:
    master, replica, sentinel = sentinel_set
    monkeypatch.setenv("REDIS_SERVICE_NAME", SERVICE)  # where LMCache's connector takes the name
    cfg = CacheConfig.from_dict(
        {
            "chunk_size": 256,
            "remote_url": f"redis-sentinel://{sentinel.host}:{sentinel.port}",
            "extra_config": {"redis_password": PASSWORD},
        }
    )
    assert cfg.remote_url is not None
    tier = open_tier(
        cfg.remote_url,
        TierOptions(name="remote", metrics=TierMetrics("remote"), timeout_s=3.0, probe_interval_s=0.2),
    )
    try:
        keys, chunks = random_chunks(3, LAYOUT, 16, seed=5)
        assert tier.put(keys[:2], chunks[:2]) == [True, True]
        mc = master.client()
        try:
            assert len(mc.keys("kvm2-*")) == 2  # written to the master the sentinel names
            assert mc.wait(1, 5000) == 1  # the replica has them before the failover
        finally:
            mc.close()

        sc = sentinel.client()
        try:
            sc.execute_command("SENTINEL", "FAILOVER", SERVICE)
        finally:
            sc.close()
        wait_for(lambda: _master_port(sentinel) == replica.port, 30.0, "the sentinel to promote the replica")

        def role(server: RedisServer) -> str:
            client = server.client()
            try:
                return str(client.info("replication")["role"])
            finally:
                client.close()

        wait_for(lambda: role(replica) == "master", 30.0, "the replica to take the master role")
        # Until the sentinel demotes the old master, a write may still reach it (Redis
        # replication is asynchronous); after that its READONLY answer sends the tier on.
        wait_for(lambda: role(master) == "slave", 30.0, "the old master to be demoted")
        got = tier.get(keys[:2])
        assert [bytes(g.data) for g in got if g is not None] == [bytes(c.data) for c in chunks[:2]]

        def stored_on_new_master() -> bool:
            return tier.put(keys[2:], chunks[2:]) == [True]

        wait_for(stored_on_new_master, 30.0, "a write through the new master")
        rc = replica.client()
        try:
            assert len(rc.keys("kvm2-*")) == 3
        finally:
            rc.close()
    finally:
        tier.close()


def test_master_and_sentinel_over_tls(
    redis_server_factory: Callable[..., RedisServer], tmp_path: Path
) -> None:
    """A master and its sentinel serving TLS only: ``ssl=true`` (the master), ``sentinel_ssl=true``
    (the sentinels) and ``ssl_ca_certs`` (the CA, for both) reach the master the sentinel
    names, and chunks round-trip. Before, a sentinel could be reached only over plain TCP and
    the master's CA could not be named."""
    files = TlsFiles.make(tmp_path / "tls")
    master = redis_server_factory(password=PASSWORD, tls=files).start()
    sentinel = RedisSentinel(master, SERVICE, workdir=tmp_path / "sentinel", tls=files)
    try:
        sentinel.start()
        url = (f"redis-sentinel://:{PASSWORD}@{sentinel.host}:{sentinel.port}?service_name={SERVICE}"
               f"&ssl=true&sentinel_ssl=true&ssl_ca_certs={quote(str(files.ca))}")  # fmt: skip
        tier = open_tier(url, TierOptions(name="remote", metrics=TierMetrics("remote"), timeout_s=3.0))
        try:
            assert tier.health() == "up"
            keys, chunks = random_chunks(3, LAYOUT, 16, seed=6)
            assert tier.put(keys, chunks) == [True] * 3
            got = tier.get(keys)
            assert [bytes(g.data) for g in got if g is not None] == [bytes(c.data) for c in chunks]
        finally:
            tier.close()
    finally:
        sentinel.kill()


def test_sentinel_url_errors_name_the_form() -> None:
    from kvmesh.errors import ConfigError

    with pytest.raises(ConfigError, match="redis-sentinel://"):
        open_tier("redis-sentinel://h1,h2:1", TierOptions(metrics=TierMetrics("remote")))
    with pytest.raises(ConfigError, match="needs ssl=true"):  # a CA for no TLS connection
        open_tier("redis-sentinel://h1:1?ssl_ca_certs=/ca.pem", TierOptions(metrics=TierMetrics("remote")))
