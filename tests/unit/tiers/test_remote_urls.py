"""URL parsing of the s3, redis-cluster and mooncake tiers (no servers needed)."""

from __future__ import annotations

from urllib.parse import quote

import pytest

from kvmesh.errors import ConfigError
from kvmesh.tiers import redis_cluster, s3
from kvmesh.tiers.base import served_schemes


def test_s3_url_forms() -> None:
    q = s3._parse("s3://bucket/a/b?region=eu-west-1&endpoint_url=http://h:9000")
    assert (q["bucket"], q["prefix"], q["region"], q["endpoint_url"]) == (
        "bucket",
        "a/b/",
        "eu-west-1",
        "http://h:9000",
    )
    v = s3._parse("s3://my-kv.s3.us-east-2.amazonaws.com")  # LMCache's virtual-host form
    assert (v["bucket"], v["prefix"], v["region"]) == ("my-kv", "", "us-east-2")
    assert s3._parse("s3://b.s3.amazonaws.com/p")["bucket"] == "b"
    with pytest.raises(ConfigError, match="names no bucket"):
        s3._parse("s3:///prefix")


def test_redis_cluster_url_forms() -> None:
    auth, seeds, tls = redis_cluster._parse("redis-cluster://h1:7000,h2:7001")
    assert auth == {} and seeds == [("h1", 7000), ("h2", 7001)] and tls is None
    auth, seeds, tls = redis_cluster._parse("redis-cluster://u:pw@h1:7000,h2:7001/0")
    assert auth == {"username": "u", "password": "pw"} and seeds == [("h1", 7000), ("h2", 7001)]
    assert redis_cluster._parse("redis-cluster://secret@h:1")[0] == {"password": "secret"}
    with pytest.raises(ConfigError, match="host:port"):
        redis_cluster._parse("redis-cluster://h1,h2:7000")
    auth, seeds, tls = redis_cluster._parse(
        "redis-cluster://h1:7000,h2:7001?ssl=true&ssl_ca_certs=/etc/ca.pem"
    )
    assert seeds == [("h1", 7000), ("h2", 7001)] and tls == {"ssl_ca_certs": "/etc/ca.pem"}
    assert redis_cluster._parse("redis-cluster://h1:7000?ssl=false")[2] is None
    # A query the tier cannot honour is refused, never dropped (it once took TLS with it).
    for bad, message in [("h1:7000?tls=true", "unknown parameter"), ("h1:7000?ssl=maybe", "ssl='maybe'"),
                         ("h1:7000?ssl_ca_certs=/ca.pem", "needs ssl=true"),
                         (":pa#ss@h1:7000?ssl=true", "%23")]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            redis_cluster._parse(f"redis-cluster://{bad}")


def test_new_schemes_are_served() -> None:
    for scheme in ("s3", "redis-cluster", "mooncakestore", "valkey"):
        assert scheme in served_schemes()


def test_redis_cluster_node_urls_keep_any_password() -> None:
    """Each shard's ``redis://`` URL carries the cluster's credentials quoted: a password
    with ``/``, ``%``, ``?``, ``#`` or ``@`` reached redis-py cut or decoded into another."""
    from redis.connection import parse_url

    password, user = "p/a%41?b#c@d:e", "us er"
    auth, _, _ = redis_cluster._parse(f"redis-cluster://{quote(user)}:{quote(password, safe='')}@h1:7000")
    assert auth == {"username": user, "password": password}
    tier = redis_cluster.RedisClusterTier.__new__(redis_cluster.RedisClusterTier)
    tier._auth, tier._tls = auth, None
    got = parse_url(tier._node_url(("10.0.0.5", 7001)))
    assert (got["username"], got["password"], got["host"], got["port"]) == (user, password, "10.0.0.5", 7001)
    # With ssl=true each node is rediss://, with the cluster URL's ssl_* options.
    tier._tls = {"ssl_ca_certs": "/etc/kvmesh/ca dir/ca.pem"}
    got = parse_url(tier._node_url(("10.0.0.5", 7001)))
    assert got["connection_class"].__name__ == "SSLConnection" and got["password"] == password
    assert got["ssl_ca_certs"] == "/etc/kvmesh/ca dir/ca.pem"
    got = parse_url(tier._node_url(("fd00::5", 7001)))  # an IPv6 node from CLUSTER SLOTS
    assert (got["host"], got["port"]) == ("fd00::5", 7001)


def test_sentinel_tls_options_reach_master_and_sentinels_typed() -> None:
    """``ssl_*`` options of a ``redis-sentinel://`` URL go to the master's connections with
    ``ssl=true`` and to the sentinels' with ``sentinel_ssl=true``, typed as redis-py types them
    in a ``rediss://`` URL (the string "false" would have kept hostname checks on)."""
    from kvmesh.tiers.redis_wire import sentinel_client

    client = sentinel_client(
        "redis-sentinel://h1:1,h2:2?ssl=true&sentinel_ssl=true&ssl_ca_certs=/ca.pem&ssl_check_hostname=false",
        1.0,
    )
    master = client.connection_pool.connection_kwargs
    assert (master["ssl_ca_certs"], master["ssl_check_hostname"]) == ("/ca.pem", False)
    sentinels = client.connection_pool.sentinel_manager.sentinels  # type: ignore[attr-defined]
    for node in sentinels:
        kwargs = node.connection_pool.connection_kwargs
        assert node.connection_pool.connection_class.__name__ == "DeadlineSSLConnection"
        assert (kwargs["ssl_ca_certs"], kwargs["ssl_check_hostname"]) == ("/ca.pem", False)
    plain = sentinel_client("redis-sentinel://h1:1?ssl=true&ssl_ca_certs=/ca.pem", 1.0)
    node = plain.connection_pool.sentinel_manager.sentinels[0]  # type: ignore[attr-defined]
    assert node.connection_pool.connection_class.__name__ == "DeadlineConnection"  # sentinels stay plain


@pytest.mark.parametrize(
    "url, message",
    [
        ("redis-sentinel://h1:1?ssl=ture", "ssl='ture'"),  # once read as false: plain TCP
        ("redis-sentinel://:pa#ss@h1:1?ssl=true", "%23"),  # the query cut off as a fragment
    ],
)
def test_sentinel_urls_that_would_lose_tls_are_refused(url: str, message: str) -> None:
    from kvmesh.tiers.redis_wire import make_client

    with pytest.raises(ConfigError, match=message):
        make_client(url, 1.0)


def test_s3_parameters_are_read_strictly() -> None:
    """A misspelt flag or a number that is not one is a ConfigError naming it (``disable_tls``
    was read as false for anything but true/1/yes, and ``range_bytes=8M`` raised ValueError)."""
    from kvmesh.metrics import TierMetrics
    from kvmesh.tiers.base import TierOptions

    opts = TierOptions(name="remote", metrics=TierMetrics("remote"), timeout_s=1.0)
    for query, message in [("disable_tls=ture", "disable_tls='ture'"), ("range_bytes=8M", "range_bytes='8M'"),
                           ("max_concurrency=many", "max_concurrency='many'")]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            s3.S3Tier(f"s3://bucket/p?endpoint_url=http://127.0.0.1:9&{query}", opts)
