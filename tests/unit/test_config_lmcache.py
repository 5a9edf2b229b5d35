"""LMCache configurations: the files of LMCache's docs and v0 examples load (or fail at
config time for schemes kvmesh does not serve), every key is reported, and unsupported
features warn by key (errors with strict: true)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvmesh.cli import main
from kvmesh.config import GB, CacheConfig
from kvmesh.config_lmcache import redact_url
from kvmesh.config_lmcache_keys import NO_EQUIVALENT
from kvmesh.errors import ConfigError
from kvmesh.integrations.vllm.options import ConnectorOptions

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lmcache"
UNSERVED = {"v1-infinistore.yaml": "infinistore", "v0-cpu-lm.yaml": "lm"}
# files that ask for LMCache features kvmesh does not have: the keys warned about
WARNS = {
    "v1-blending.yaml": {"enable_blending", "use_layerwise", "blend_check_layers", "blend_recompute_ratios"},
    "v1-disagg-prefill.yaml": {
        "enable_pd",
        "transfer_channel",
        "pd_role",
        "pd_proxy_host",
        "pd_proxy_port",
        "pd_buffer_size",
        "pd_buffer_device",
    },
    "v1-controller.yaml": {
        "enable_controller",
        "lmcache_instance_id",
        "controller_pull_url",
        "controller_reply_url",
        "lmcache_worker_ports",
    },
    "v1-layerwise-cachegen.yaml": {"use_layerwise"},
    "v0-save-decode.yaml": {"save_decode_cache"},
    "v1-valkey.yaml": {"extra_config.valkey_num_workers"},
}
ALL = sorted(p.name for p in FIXTURES.glob("*.yaml"))


def test_fixtures_are_there() -> None:
    assert len(ALL) >= 18
    assert set(UNSERVED) | set(WARNS) <= set(ALL)


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
        for scheme in ("redis", "redis-cluster", "s3", "valkey", "fs"):
            assert scheme in msg
        return
    with caplog.at_level(logging.WARNING, logger="kvmesh.config"):
        cfg = CacheConfig.from_file(path)
    warned = {r.key for r in cfg.readings if r.action == "unsupported"}
    assert warned == WARNS.get(name, set())
    for key in warned:  # a warning at start names each key
        assert any(key in rec.getMessage() for rec in caplog.records)
    import yaml

    written = yaml.safe_load(path.read_text())
    reported = {r.key.split(".")[0] for r in cfg.readings}
    assert reported == set(written)  # every key the user wrote is reported
    if warned:
        with pytest.raises(ConfigError, match="strict"):
            CacheConfig.from_layers([("file", written), ("test", {"strict": True})])


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
    data = {k: d for k, (d, _why) in NO_EQUIVALENT.items()}
    with caplog.at_level(logging.WARNING, logger="kvmesh.config"):
        cfg = CacheConfig.from_dict(data)
    assert {r.action for r in cfg.readings} <= {"ignored", "mapped"}  # mapped: an alias (nixl_*)
    assert not caplog.records
    assert len(NO_EQUIVALENT) > 90  # LMCache v1's and v0's keys


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
    assert sources["remote_url"] == "file v1-redis.yaml"
    assert sources["extra_config.use_odirect"] == "env LMCACHE_EXTRA_CONFIG"


def test_connector_extra_config_takes_lmcache_prefixed_keys() -> None:
    opts = ConnectorOptions.from_extra_config(
        {"lmcache.chunk_size": 128, "lmcache.local_device": "cpu", "lmcache.remote_serde": "safetensor"},
        environ={},
    )
    assert opts.cache.chunk_size == 128 and opts.cache.remote_serde == "safetensors"
    with pytest.raises(ConfigError, match=r"lmcache.chunk_sise"):
        ConnectorOptions.from_extra_config({"lmcache.chunk_sise": 1}, environ={})


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
