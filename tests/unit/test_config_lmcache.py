"""LMCache configurations: the files of LMCache's docs and v0 examples load (or fail at
config time for schemes kvmesh does not serve), every key is reported, and unsupported
features warn by key (errors with strict: true)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from kvmesh.cli import main
from kvmesh.config import GB, CacheConfig
from kvmesh.config_lmcache import redact_url
from kvmesh.config_lmcache_keys import NO_EQUIVALENT, RETIRED
from kvmesh.config_lmcache_pd import PD_KEYS
from kvmesh.errors import ConfigError
from kvmesh.integrations.vllm.options import ConnectorOptions

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lmcache"
UNSERVED = {"v1-infinistore.yaml": "infinistore", "v0-cpu-lm.yaml": "lm"}
# files that ask for LMCache features kvmesh does not have, or hold keys nobody knows: the
# keys warned about (errors with strict: true)
WARNS = {
    "v1-blending.yaml": {"enable_blending", "use_layerwise", "blend_check_layers", "blend_recompute_ratios"},
    "v1-controller.yaml": {
        "enable_controller",
        "controller_pull_url",
        "controller_reply_url",
        "lmcache_worker_ports",
    },
    "v1-layerwise-cachegen.yaml": {"use_layerwise"},
    "v0-save-decode.yaml": {"save_decode_cache"},
    "lmc-controller-url.yaml": {"enable_controller", "controller_url", "lmcache_worker_port"},
    "lmc-resp.yaml": {"async_loading"},
    "lmc-s3-coreweave.yaml": {"enable_async_loading"},
    "lmc-weka.yaml": {"weka_path", "cufile_buffer_size"},
}
# the meaning each LMCache file must load with (beyond "loads")
MEANING: dict[str, Callable[[CacheConfig], bool]] = {
    "v1-disagg-prefill.yaml": lambda c: c._pd_role == "kv_producer" and c.local_cpu is False,
    "v1-valkey.yaml": lambda c: c.remote_url == "valkey://localhost:6379",
    "lmc-controller-url.yaml": lambda c: (
        c.controller_url is None and c.admin_name == "lmcache_default_instance"
    ),
    "lmc-fs-legacy-url.yaml": lambda c: c.remote_url == "fs:///tmp/lmcache-fs",
    "lmc-pd-1p1d-decoder-nixl.yaml": lambda c: (
        c._pd_role == "kv_consumer" and not c.local_cpu and c.max_local_cpu_size == 0
    ),
    "lmc-pd-1p1d-prefiller.yaml": lambda c: c._pd_role == "kv_producer" and c.save_unfull_chunk,
    "lmc-pd-xpyd-decoder.yaml": lambda c: c._pd_role == "kv_consumer" and c.max_local_cpu_size == 0,
    "lmc-redis-sentinel.yaml": lambda c: (
        c.remote_url == "redis-sentinel://localhost:26379,localhost:26380,localhost:26381"
    ),
    "lmc-resp.yaml": lambda c: c.remote_url == "redis://default:YOUR_REDIS_PASSWORD@localhost:6379",
    "lmc-s3-coreweave.yaml": lambda c: _s3(c) == ("test-127", "test-2/", "https://cwlota.com", "320"),
    "lmc-s3-tigris.yaml": lambda c: _s3(c) == ("my-kv-bucket", "", "https://t3.storage.dev", "64"),
    "lmc-s3-express.yaml": lambda c: _s3(c)[:3] == ("kv--usw2-az1--x-s3", "", None),
    "lmc-valkey-credentials-db.yaml": lambda c: (
        c.remote_url == "valkey://Your%20username:Your%20password@localhost:6379/0"
    ),
}
ALL = sorted(p.name for p in FIXTURES.glob("*.yaml"))


def _s3(cfg: CacheConfig) -> tuple[str, str, str | None, str | None]:
    from kvmesh.tiers.s3 import _parse

    assert cfg.remote_url is not None
    q = _parse(cfg.remote_url)
    return q["bucket"], q["prefix"], q.get("endpoint_url"), q.get("max_concurrency")


def test_fixtures_are_there_with_sources() -> None:
    assert len(ALL) >= 30
    assert set(UNSERVED) | set(WARNS) | set(MEANING) <= set(ALL)
    for name in ALL:  # every file taken from LMCache's repository or docs names its source
        if name.startswith("lmc-"):
            assert (FIXTURES / name).read_text().startswith("# source: "), name
    for env in FIXTURES.glob("env/*.env"):
        assert env.read_text().startswith("# source: "), env.name


@pytest.mark.parametrize("name", ALL)
def test_every_lmcache_docs_config_loads_or_fails_at_config_time(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = FIXTURES / name
    if name in UNSERVED:
        with pytest.raises(ConfigError) as exc:
            CacheConfig.from_file(path)
        msg = str(exc.value)
        assert f"scheme {UNSERVED[name]!r}" in msg and "served schemes" in msg
        for scheme in ("redis", "redis-cluster", "redis-sentinel", "s3", "valkey", "fs"):
            assert scheme in msg
        return
    with caplog.at_level(logging.WARNING, logger="kvmesh.config"):
        cfg = CacheConfig.from_file(path)
    warned = {r.key for r in cfg.readings if r.action in ("unsupported", "unknown")}
    assert warned == WARNS.get(name, set())
    for key in warned:  # a warning at start names each key
        assert any(key in rec.getMessage() for rec in caplog.records)
    if name in MEANING:
        assert MEANING[name](cfg), (name, cfg)
    import yaml

    written = yaml.safe_load(path.read_text())
    reported = {r.key.split(".")[0] for r in cfg.readings}
    assert reported == set(written)  # every key the user wrote is reported
    if warned:
        with pytest.raises(ConfigError, match="strict"):
            CacheConfig.from_layers([("file", written), ("test", {"strict": True})])


def _env_file(path: Path) -> dict[str, str]:
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    return dict(ln.split("=", 1) for ln in lines if ln and not ln.startswith("#"))


def test_lmcache_environment_fixtures(caplog: pytest.LogCaptureFixture) -> None:
    """production-stack's PD decoder and LMCache CI's: no CPU tier, the consumer role, and
    LMCache's runtime switches (LMCACHE_USE_EXPERIMENTAL, LMCACHE_LOG_LEVEL) not warned about."""
    for name in ("production-stack-pd-decoder.env", "buildkite-pd-decoder.env"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvmesh.config"):
            cfg = CacheConfig.from_env(_env_file(FIXTURES / "env" / name))
        assert cfg.local_cpu is False and cfg.max_local_cpu_size == 0 and cfg.remote_serde == "raw"
        assert cfg._pd_role == "kv_consumer" and cfg.read_as_lmcache
        assert not caplog.records, [r.getMessage() for r in caplog.records]
    with caplog.at_level(logging.WARNING, logger="kvmesh.config"):
        weka = CacheConfig.from_env(_env_file(FIXTURES / "env" / "weka.env"))
    assert {r.key for r in weka.readings if r.action == "unsupported"} == {"weka_path", "cufile_buffer_size"}
    assert weka.chunk_size == 256 and weka.local_cpu is False


def test_v0_keys_map_onto_kvmesh_keys() -> None:
    cfg = CacheConfig.from_file(FIXTURES / "v0-cpu-local.yaml")
    assert cfg.local_cpu is True and cfg.cpu_bytes == 20 * GB
    disk = CacheConfig.from_file(FIXTURES / "v0-disk-local.yaml")
    assert disk.local_disk == "file://local_disk/" and disk.disk_bytes == 5 * GB
    remote = CacheConfig.from_file(FIXTURES / "v0-cpu-redis.yaml")
    assert remote.remote_url == "redis://localhost:65432" and remote.remote_serde == "cachegen"
    assert CacheConfig.from_file(FIXTURES / "v0-hybrid-safetensor.yaml").remote_serde == "safetensors"
    nulls = CacheConfig.from_file(FIXTURES / "v0-local-null-remote.yaml")
    assert nulls.remote_url is None and nulls.remote_serde == "raw"
    assert CacheConfig.from_dict({"local_device": None}).local_cpu is False
    assert CacheConfig.from_dict({"local_device": "cuda"}).local_cpu is True
    with pytest.raises(ConfigError, match=r"'local_device'.*valid"):
        CacheConfig.from_dict({"local_device": "tpu"})


def test_v1_keys_and_extra_config_are_mapped() -> None:
    cfg = CacheConfig.from_file(FIXTURES / "v1-local-disk.yaml")
    assert cfg.disk_o_direct is True and cfg.local_cpu is False and cfg.disk_bytes == 10 * GB
    s3 = CacheConfig.from_file(FIXTURES / "v1-s3.yaml")
    assert s3.remote_url is not None and s3.remote_url.startswith(
        "s3://my-kv-bucket.s3.us-east-1.amazonaws.com?"
    )
    assert "region=us-east-1" in s3.remote_url and "max_concurrency=320" in s3.remote_url
    assert s3.remote_timeout_s == 10
    ignored = {r.key for r in s3.readings if r.action == "ignored"}
    assert "extra_config.s3_prefer_http2" in ignored
    mc = CacheConfig.from_file(FIXTURES / "v1-mooncake.yaml")
    assert mc.remote_url is not None and mc.remote_url.startswith("mooncakestore://localhost:50051/?")
    for part in ("metadata_server=http", "protocol=tcp", "global_segment_size=3355443200", "local_hostname="):
        assert part in mc.remote_url
    cg = CacheConfig.from_file(FIXTURES / "v1-layerwise-cachegen.yaml")
    assert cg.eviction_policy == "lru" and cg.remote_serde == "cachegen"
    api = CacheConfig.from_dict({"internal_api_server_enabled": True, "internal_api_server_port_start": 7000})
    assert api.admin_enabled is True and api.admin_port == 7000
    cluster = CacheConfig.from_dict(
        {"remote_url": "valkey://h1:7000", "extra_config": {"valkey_mode": "cluster"}}
    )
    assert cluster.remote_url == "redis-cluster://h1:7000"
    json_extra = CacheConfig.from_dict({"extra_config": '{"use_odirect": true}'})
    assert json_extra.disk_o_direct is True


def test_default_valued_lmcache_keys_are_ignored_without_warning(caplog: pytest.LogCaptureFixture) -> None:
    data = {k: d for k, (d, _why) in {**NO_EQUIVALENT, **RETIRED}.items()}
    data |= {k: None for k in PD_KEYS}
    with caplog.at_level(logging.WARNING, logger="kvmesh.config"):
        cfg = CacheConfig.from_dict(data)
    assert {r.action for r in cfg.readings} <= {"ignored", "mapped"}  # mapped: an alias (nixl_*)
    assert not caplog.records
    assert len(data) > 100  # LMCache v1's, v0's and older v1 releases' keys


def test_aliases_lmcache_prefix_and_unknown_keys() -> None:
    cfg = CacheConfig.from_dict({"lmcache.chunk_size": 128, "enable_xpyd": False, "lmcache.mp.host": "x"})
    assert cfg.chunk_size == 128
    with pytest.raises(ConfigError, match=r"unknown config key.*'chunk_sise'"):
        CacheConfig.from_dict({"chunk_sise": 1})
    # kvmesh's own key wins over an LMCache key mapped onto it, whatever the order
    assert CacheConfig.from_dict({"max_local_cpu_size": 1, "max_local_cache_size": 9}).cpu_bytes == GB


def test_bad_values_name_the_key_and_valid_values() -> None:
    with pytest.raises(ConfigError, match=r"'remote_serde'.*kivi.*not supported"):
        CacheConfig.from_dict({"remote_serde": "kivi"})
    with pytest.raises(ConfigError, match=r"'remote_serde'.*valid codecs: cachegen, raw, safetensors, zstd"):
        CacheConfig.from_dict({"remote_serde": "lz4"})
    with pytest.raises(ConfigError, match="'chunk_size'"):
        CacheConfig.from_dict({"lmcache.chunk_size": "big"})
    with pytest.raises(ConfigError, match=r"'extra_config'.*JSON"):
        CacheConfig.from_dict({"extra_config": "{nope"})


def test_lmcache_env_and_config_file(tmp_path: Path) -> None:
    env = {
        "LMCACHE_CONFIG_FILE": str(FIXTURES / "v1-redis.yaml"),
        "LMCACHE_CHUNK_SIZE": "512",
        "LMCACHE_LOCAL_CPU": "False",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "3",
        "LMCACHE_EXTRA_CONFIG": '{"use_odirect": true}',
        "LMCACHE_TRACK_USAGE": "false",  # LMCache's runtime switch, not a config key
        "KVMESH_CHUNK_SIZE": "64",  # kvmesh's variable wins over LMCache's
    }
    cfg = CacheConfig.from_env(env)
    assert cfg.remote_url == "redis://localhost:6379"
    assert cfg.chunk_size == 64 and cfg.local_cpu is False and cfg.cpu_bytes == 3 * GB
    assert cfg.disk_o_direct is True
    sources = {r.key: r.source for r in cfg.readings}
    assert sources["remote_url"] == "file v1-redis.yaml (LMCACHE_CONFIG_FILE)"
    assert sources["extra_config.use_odirect"] == "env LMCACHE_EXTRA_CONFIG"


def test_connector_extra_config_takes_lmcache_prefixed_keys() -> None:
    opts = ConnectorOptions.from_extra_config(
        {"lmcache.chunk_size": 128, "lmcache.local_device": "cpu", "lmcache.remote_serde": "safetensor"},
        environ={},
    )
    assert opts.cache.chunk_size == 128 and opts.cache.remote_serde == "safetensors"
    # an lmcache.-prefixed key is LMCache's by name: one LMCache would ignore is warned about
    # (naming the closest key); an unprefixed unknown key is still refused
    warned = ConnectorOptions.from_extra_config({"lmcache.chunk_sise": 1}, environ={}).cache.readings
    assert [(r.key, r.action) for r in warned] == [("lmcache.chunk_sise", "unknown")]
    assert "did you mean 'chunk_size'" in warned[0].note
    with pytest.raises(ConfigError, match=r"chunk_sise"):
        ConnectorOptions.from_extra_config({"chunk_sise": 1}, environ={})


def test_redact_url() -> None:
    assert redact_url("s3://b/p?region=x&secret_access_key=abc") == "s3://b/p?region=x&secret_access_key=***"
    assert redact_url("redis://u:pw@h:1/0") == "redis://***@h:1/0"


def test_config_check_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", str(FIXTURES / "v1-blending.yaml")]) == 0
    out = capsys.readouterr().out
    assert "unsupported enable_blending" in out and "CacheBlend" in out
    assert "taken       chunk_size" in out
    assert "4 key(s) have no kvmesh equivalent" in out
    assert main(["config", "check", "--strict", str(FIXTURES / "v1-blending.yaml")]) == 2
    assert main(["config", "check", str(FIXTURES / "v1-infinistore.yaml")]) == 1
    err = capsys.readouterr().err
    assert "does not serve URL scheme 'infinistore'" in err
    assert main(["config", "check", str(FIXTURES / "v0-cpu-local.yaml")]) == 0
    out = capsys.readouterr().out
    assert "mapped      max_local_cache_size" in out and "max_local_cpu_size: 20.0" in out


# ---- the failure kinds of issue #26, one test each ------------------------------------------


def test_no_cpu_tier_is_local_cpu_false_with_size_zero() -> None:
    cfg = CacheConfig.from_dict({"local_cpu": False, "max_local_cpu_size": 0})
    assert cfg.local_cpu is False and cfg.cpu_bytes == 0
    with pytest.raises(ConfigError, match=r"max_local_cpu_size: 0 leaves the CPU tier no room.*local_cpu"):
        CacheConfig.from_dict({"max_local_cpu_size": 0})


def test_fs_legacy_url_names_the_path_and_a_bare_host_is_refused() -> None:
    cfg = CacheConfig.from_dict({"remote_url": "fs://localhost:0/tmp/lmcache-fs"})
    assert cfg.remote_url == "fs:///tmp/lmcache-fs"
    note = [r.note for r in cfg.readings if r.source == "extra_config"]
    assert note and "uses only the path" in note[0]
    assert CacheConfig.from_dict({"remote_url": "fs:///srv/kv"}).remote_url == "fs:///srv/kv"
    with pytest.raises(ConfigError, match=r"'remote_url'.*'shared' stands where a host goes"):
        CacheConfig.from_dict({"remote_url": "fs://shared/dir"})


def test_redis_and_valkey_credentials_database_tls_ttl_go_into_the_url() -> None:
    def url(remote: str, extra: dict[str, object]) -> str | None:
        return CacheConfig.from_dict({"remote_url": remote, "extra_config": extra}).remote_url

    assert url("redis://h:1", {"redis_username": "u", "redis_password": "p w", "redis_database": 4}) == (
        "redis://u:p%20w@h:1/4"
    )
    assert url("valkey://h:1", {"valkey_password": "pw", "tls_enable": True}) == "rediss://:pw@h:1"
    assert url("redis://u:mine@h:1/2", {"redis_password": "other", "redis_database": 5}) == (
        "redis://u:mine@h:1/2"  # what the URL says wins
    )
    assert url("valkey://h:1", {"valkey_mode": "cluster", "valkey_password": "pw", "valkey_database": 3}) == (
        "redis-cluster://:pw@h:1"
    )
    # TLS asked for (tls_enable, or a rediss:// URL) stays on in cluster mode: every node over TLS
    assert url("valkey://h:1,h:2", {"valkey_mode": "cluster", "tls_enable": True}) == (
        "redis-cluster://h:1,h:2?ssl=true"
    )
    assert url("rediss://h:1", {"valkey_mode": "cluster"}) == "redis-cluster://h:1?ssl=true"
    assert url("redis-cluster://h:1", {"tls_enable": True}) == "redis-cluster://h:1?ssl=true"
    assert url("redis-sentinel://h:1", {"use_tls": True}) == "redis-sentinel://h:1?ssl=true"
    assert url("unix:///tmp/r.sock", {"password": "pw", "redis_database": 1}) == "unix://:pw@/tmp/r.sock?db=1"
    ttl = CacheConfig.from_dict({"remote_url": "valkey://h:1", "extra_config": {"valkey_enable_ttl": True}})
    assert ttl.remote_ttl_s == 86400
    with pytest.raises(ConfigError, match="valkey_database"):
        url("valkey://h:1", {"valkey_database": "zero"})
    # credentials never reach config check's output
    assert redact_url(url("redis://h:1", {"redis_password": "p"}) or "") == "redis://***@h:1"


def test_s3_virtual_host_endpoints_keep_their_endpoint() -> None:
    def s3(remote: str, extra: dict[str, object]) -> tuple[str, str, str | None, str | None]:
        return _s3(CacheConfig.from_dict({"remote_url": remote, "extra_config": extra}))

    # LMCache's s3://HOST is the endpoint its client sends requests to
    assert s3("s3://kv.minio.local:9000", {"s3_region": "x", "disable_tls": True})[:3] == (
        "kv",
        "",
        "http://minio.local:9000",
    )
    assert s3("s3://kv.s3.us-east-1.amazonaws.com", {"s3_region": "us-east-1"})[:3] == ("kv", "", None)
    assert s3("s3://kv", {"s3_endpoint_url": "https://e"})[2] == "https://e"
    # in kvmesh's own configuration a dotted name stays a bucket name (warned by the tier)
    own = CacheConfig.from_dict({"remote_url": "s3://my.bucket/p", "write_mode": "through"})
    assert own.remote_url == "s3://my.bucket/p"


def test_lmcache_controller_url_is_not_kvmeshs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvmesh.config"):
        cfg = CacheConfig.from_dict({"controller_url": "localhost:9001"})
    assert cfg.controller_url is None
    assert "ZMQ address of LMCache's cache controller" in caplog.text and "http://ROUTER:PORT" in caplog.text
    env = CacheConfig.from_env({"LMCACHE_CONTROLLER_URL": "http://looks-like-http:1"})
    assert env.controller_url is None  # an LMCACHE_ variable is LMCache's key
    own = CacheConfig.from_dict({"controller_url": "http://router:8080"})
    assert own.controller_url == "http://router:8080"


def test_unknown_keys_warn_in_lmcache_configurations_and_fail_in_kvmeshs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvmesh.config"):
        cfg = CacheConfig.from_dict({"enable_blending": False, "chunk_sise": 256, "distributed_url": "x:1"})
    readings = {r.key: r for r in cfg.readings}
    assert (
        readings["chunk_sise"].action == "unknown"
        and "did you mean 'chunk_size'" in readings["chunk_sise"].note
    )
    assert readings["distributed_url"].action == "unsupported"  # an older release's key, explained
    assert "chunk_sise" in caplog.text
    with pytest.raises(ConfigError, match="strict"):
        CacheConfig.from_layers([("f", {"enable_blending": False, "chunk_sise": 1}), ("s", {"strict": True})])
    # kvmesh's own configuration (a kvmesh-only key in it) refuses a typo, naming the closest key
    with pytest.raises(ConfigError, match=r"'chunk_sise' \(did you mean 'chunk_size'\?\)"):
        CacheConfig.from_dict({"write_mode": "back", "chunk_sise": 1})
    # LMCACHE_* variables: an unknown one is warned about; LMCache's runtime switches are not
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvmesh.config"):
        env = CacheConfig.from_env(
            {"LMCACHE_CHUNK_SIZ": "256", "LMCACHE_USE_EXPERIMENTAL": "True", "LMCACHE_LOG_LEVEL": "DEBUG"}
        )
    assert [(r.key, r.action) for r in env.readings] == [("chunk_siz", "unknown")]
    assert "LMCACHE_CHUNK_SIZ" in caplog.text and "did you mean 'chunk_size'" in caplog.text


def test_pd_keys_map_onto_vllm_roles(caplog: pytest.LogCaptureFixture) -> None:
    sender = CacheConfig.from_dict({"enable_pd": True, "pd_role": "sender", "pd_proxy_port": 7500})
    assert sender._pd_role == "kv_producer"
    notes = {r.key: r.note for r in sender.readings}
    assert "not NIXL" in notes["enable_pd"] and "kv_transfer_params" in notes["pd_proxy_port"]
    sender.check_kv_role("kv_producer")  # agrees: nothing said
    with caplog.at_level(logging.WARNING, logger="kvmesh.config"):
        sender.check_kv_role("kv_consumer")
    assert "pd_role asks for vLLM kv_role='kv_producer'" in caplog.text
    strict = CacheConfig.from_dict({"pd_role": "receiver", "strict": True})
    with pytest.raises(ConfigError, match="kv_role='kv_consumer'"):
        strict.check_kv_role("kv_both")
    odd = CacheConfig.from_dict({"pd_role": "both"})
    assert [r.action for r in odd.readings] == ["unsupported"]
    assert CacheConfig.from_dict({"nixl_role": "receiver"})._pd_role == "kv_consumer"  # older alias


def test_discard_partial_chunks_is_the_inverse_of_save_unfull_chunk() -> None:
    opts = ConnectorOptions.from_extra_config(
        {"discard_partial_chunks": False, "lmcache_rpc_port": "producer1", "skip_last_n_tokens": 1},
        environ={},
    )
    assert opts.cache.save_unfull_chunk is True


def test_config_check_lists_defaults_that_differ(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", str(FIXTURES / "lmc-redis-sentinel.yaml")]) == 0
    out = capsys.readouterr().out
    assert "defaults that differ from LMCache" in out
    assert "remote_timeout_s (LMCache: blocking_timeout_secs): kvmesh 5.0, LMCache 10" in out
    assert "chunk_size:" not in out.split("differ from LMCache")[1]  # the file sets chunk_size
    assert main(["config", "check", str(FIXTURES / "v1-cpu-offload.yaml")]) == 0
    diff = capsys.readouterr().out.split("differ from LMCache")[1]
    for row in ("max_local_disk_size: kvmesh 20.0, LMCache 0.0", "admin_port (LMCache: internal_api_server"):
        assert row in diff
