"""LMCache's Redis / Valkey credentials and database number (``extra_config``) reach a real
``redis-server`` that demands them (``requirepass``, an ACL user), and a refused password
is reported as an authentication failure, not as an unreachable server."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from kvmesh.config import CacheConfig
from kvmesh.core.keys import KVLayout
from kvmesh.harness.services import RedisServer
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import TierOptions, open_tier
from kvmesh.tiers.testing import random_chunks

LAYOUT = KVLayout(2, 2, 16, "float32")
PASSWORD = "s3cret pw:@/%"  # characters a URL must quote


def _round_trip(url: str) -> None:
    tier = open_tier(url, TierOptions(name="remote", metrics=TierMetrics("remote"), timeout_s=2.0))
    try:
        keys, chunks = random_chunks(2, LAYOUT, 16, seed=3)
        assert tier.health() == "up"
        assert tier.put(keys, chunks) == [True, True]
        got = tier.get(keys)
        assert [bytes(g.data) for g in got if g is not None] == [bytes(c.data) for c in chunks]
    finally:
        tier.close()


def _kvmesh_keys(server: RedisServer, db: int) -> list[bytes]:
    client = server.client()
    try:
        client.select(db)
        return sorted(client.keys("kvm2-*"))
    finally:
        client.close()


def test_redis_password_and_database_from_extra_config(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    server = redis_server_factory(password=PASSWORD).start()
    cfg = CacheConfig.from_dict(
        {
            "chunk_size": 256,
            "remote_url": f"redis://{server.host}:{server.port}",
            "extra_config": {"redis_password": PASSWORD, "redis_database": 3},
        }
    )
    assert cfg.remote_url is not None and cfg.remote_url.endswith("/3")
    _round_trip(cfg.remote_url)
    assert len(_kvmesh_keys(server, 3)) == 2 and _kvmesh_keys(server, 0) == []


def test_valkey_acl_user_from_extra_config(redis_server_factory: Callable[..., RedisServer]) -> None:
    server = redis_server_factory(password="admin-pw").start()
    admin = server.client()
    try:
        admin.execute_command("ACL", "SETUSER", "kvuser", "on", ">kv pw", "~kvm2-*", "+@all")
    finally:
        admin.close()
    cfg = CacheConfig.from_dict(
        {
            "remote_url": f"valkey://{server.host}:{server.port}",
            "extra_config": {"valkey_username": "kvuser", "valkey_password": "kv pw", "valkey_database": 2},
        }
    )
    assert cfg.remote_url is not None
    _round_trip(cfg.remote_url)
    assert len(_kvmesh_keys(server, 2)) == 2


def test_refused_password_says_authentication_not_unreachable(
    redis_server_factory: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_server_factory(password=PASSWORD).start()
    for extra in ({"password": "wrong"}, {}):  # a wrong password, then none at all (NOAUTH)
        cfg = CacheConfig.from_dict(
            {"remote_url": f"resp://{server.host}:{server.port}", "extra_config": extra}
        )
        assert cfg.remote_url is not None
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvmesh.tiers.breaker"):
            tier = open_tier(cfg.remote_url, TierOptions(metrics=TierMetrics("remote"), timeout_s=1.0))
        try:
            text = " ".join(r.getMessage() for r in caplog.records)
            assert tier.health() == "down"
            assert "refused our credentials" in text and "unreachable" not in text
            assert "wrong" not in text  # the password is never logged
        finally:
            tier.close()
