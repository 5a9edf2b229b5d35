"""CacheConfig: LMCache key names, YAML files, KVMESH_* variables, and clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvmesh.config import GB, CacheConfig
from kvmesh.errors import ConfigError

LMCACHE_YAML = """\
# an LMCache configuration file, as its docs show it
chunk_size: 256
local_cpu: True
max_local_cpu_size: 5
local_disk: "file://local/disk_test/local_disk/"
max_local_disk_size: 10
remote_url: "redis://localhost:6379"
remote_serde: "naive"
"""


def test_defaults() -> None:
    cfg = CacheConfig()
    assert cfg == CacheConfig.from_dict({})
    assert cfg.chunk_size == 128  # measured in bench ttft: 256 left up to 255 tokens to recompute
    assert cfg.local_cpu is True
    assert cfg.save_unfull_chunk is False
    assert cfg.local_disk is None and cfg.disk_url is None
    assert cfg.remote_url is None
    assert cfg.remote_serde == "raw"
    assert cfg.write_mode == "through"
    assert cfg.cpu_bytes == 2 * GB


def test_from_dict_with_lmcache_key_names() -> None:
    cfg = CacheConfig.from_dict(
        {
            "chunk_size": 128,
            "local_cpu": False,
            "max_local_cpu_size": 1.5,
            "local_disk": "/var/cache/kv",
            "max_local_disk_size": 3,
            "remote_url": "redis://cache:6379",
            "remote_serde": "naive",
        }
    )
    assert cfg.chunk_size == 128
    assert cfg.local_cpu is False
    assert cfg.cpu_bytes == int(1.5 * GB)
    assert cfg.disk_url == "file:///var/cache/kv"
    assert cfg.disk_bytes == 3 * GB
    assert cfg.remote_url == "redis://cache:6379"
    assert cfg.remote_serde == "raw"  # LMCache's "naive" is kvmesh's raw codec


def test_relative_disk_path_becomes_an_absolute_file_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert CacheConfig.from_dict({"local_disk": "kv"}).disk_url == "file://" + str(tmp_path / "kv")
    assert CacheConfig.from_dict({"max_local_disk_size": 0}).disk_bytes is None  # 0 = unbounded


def test_lmcache_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text(LMCACHE_YAML)
    cfg = CacheConfig.from_file(path)
    assert cfg.chunk_size == 256
    assert cfg.local_cpu is True
    assert cfg.cpu_bytes == 5 * GB
    assert cfg.disk_url == "file://local/disk_test/local_disk/"
    assert cfg.disk_bytes == 10 * GB
    assert cfg.remote_url == "redis://localhost:6379"
    assert cfg.remote_serde == "raw"
    assert CacheConfig.from_file(str(path)) == cfg


def test_empty_yaml_file_gives_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert CacheConfig.from_file(path) == CacheConfig()


def test_unreadable_or_invalid_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        CacheConfig.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_size: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        CacheConfig.from_file(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- chunk_size\n- 256\n")
    with pytest.raises(ConfigError, match="mapping"):
        CacheConfig.from_file(listy)


def test_yaml_file_with_unknown_key_names_it(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(LMCACHE_YAML + "use_layerwize: true\n")  # a typo, not LMCache's use_layerwise
    with pytest.raises(ConfigError, match="use_layerwize") as exc:
        CacheConfig.from_file(path)
    assert "c.yaml" in str(exc.value)


def test_from_env() -> None:
    env = {
        "KVMESH_CHUNK_SIZE": "512",
        "KVMESH_LOCAL_CPU": "false",
        "KVMESH_MAX_LOCAL_CPU_SIZE": "0.5",
        "KVMESH_REMOTE_URL": "redis://cache:6379/0",
        "KVMESH_REMOTE_SERDE": "naive",
        "KVMESH_WRITE_MODE": "back",
        "KVMESH_REMOTE_TTL_S": "null",
        "KVMESH_ROUTER_PORT": "8000",  # belongs to another component: ignored here
        "CHUNK_SIZE": "7",  # no prefix: ignored
        "PATH": os.environ.get("PATH", ""),
    }
    cfg = CacheConfig.from_env(env)
    assert cfg.chunk_size == 512
    assert cfg.local_cpu is False
    assert cfg.cpu_bytes == GB // 2
    assert cfg.remote_url == "redis://cache:6379/0"
    assert cfg.remote_serde == "raw"
    assert cfg.write_mode == "back"
    assert cfg.remote_ttl_s is None
    assert CacheConfig.from_env({}) == CacheConfig()


@pytest.mark.parametrize("value", ["123", "yes", "1.5", "null-ish", "1:30"])
def test_from_env_keeps_text_values_as_text(value: str) -> None:
    cfg = CacheConfig.from_env({"KVMESH_CACHE_SALT": value, "KVMESH_LOCAL_DISK": value})
    assert cfg.cache_salt == value
    assert cfg.local_disk == value


def test_from_env_reads_config_file_first_and_overrides_it(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(LMCACHE_YAML)
    cfg = CacheConfig.from_env({"KVMESH_CONFIG_FILE": str(path), "KVMESH_CHUNK_SIZE": "64"})
    assert cfg.chunk_size == 64
    assert cfg.remote_url == "redis://localhost:6379"
    assert cfg.cpu_bytes == 5 * GB
    base = CacheConfig.from_env({"KVMESH_LOCAL_CPU": "0"}, base={"chunk_size": 32, "cache_salt": "t"})
    assert (base.chunk_size, base.cache_salt, base.local_cpu) == (32, "t", False)


def test_from_env_bad_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match="chunk_size"):
        CacheConfig.from_env({"KVMESH_CHUNK_SIZE": "lots"})
    with pytest.raises(ConfigError, match="write_mode"):
        CacheConfig.from_env({"KVMESH_WRITE_MODE": "sideways"})


def test_unknown_key_names_it_and_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as exc:
        CacheConfig.from_dict({"chunk_size": 256, "chunk_sise": 128})
    msg = str(exc.value)
    assert "'chunk_sise'" in msg
    assert "valid keys" in msg
    for valid in (
        "chunk_size",
        "local_cpu",
        "max_local_cpu_size",
        "local_disk",
        "remote_url",
        "remote_serde",
    ):
        assert valid in msg
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize(
    "key,value",
    [
        ("chunk_size", 0),
        ("chunk_size", -16),
        ("chunk_size", "abc"),
        ("chunk_size", 1.5),
        ("max_local_cpu_size", 0),
        ("max_local_cpu_size", "big"),
        ("max_local_disk_size", -1),
        ("local_cpu", "sometimes"),
        ("remote_serde", "lz4"),
        ("disk_serde", "pickle"),
        ("write_mode", "sideways"),
        ("eviction_policy", "random"),
        ("remote_part_size", 0),
        ("max_pending_writes", 0),
        ("store_wait_s", -1),
        ("cache_salt", ["a"]),
    ],
)
def test_bad_value_names_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=repr(key)):
        CacheConfig.from_dict({key: value})


def test_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match="mapping"):
        CacheConfig.from_dict(["chunk_size", 256])  # type: ignore[arg-type]


def test_reference_lists_every_key_with_a_description() -> None:
    rows = CacheConfig.reference()
    assert {r[0] for r in rows} == set(CacheConfig.model_fields)
    assert all(r[2] for r in rows)
