"""``kvmesh epp`` argument and config handling (no servers started)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvmesh.epp.cli import config_from_args, register
from kvmesh.epp.config import EppConfig
from kvmesh.epp.scoring import endpoint_config, endpoint_name
from kvmesh.errors import ConfigError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["epp", *argv])


def test_defaults_are_the_protocol_ports() -> None:
    cfg = config_from_args(parse("--endpoint", "10.0.0.5:8000"))
    assert (cfg.grpc_port, cfg.health_port, cfg.metrics_port) == (9002, 9003, 9090)
    assert [r.key for r in cfg.routing.replicas] == ["10.0.0.5:8000"]


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(
        "grpc_port: 7000\nfallbacks: 1\nrouting:\n  policy: least-loaded\n  speculative_ttl_s: 0\n"
    )
    cfg = config_from_args(parse("--config", str(path), "--grpc-port", "7100", "--endpoint",
                                 "10.0.0.5:8000,events=tcp://10.0.0.5:5557"))  # fmt: skip
    assert cfg.grpc_port == 7100 and cfg.fallbacks == 1
    assert cfg.routing.policy == "least-loaded" and cfg.routing.speculative_ttl_s == 0
    assert cfg.routing.replicas[0].events == "tcp://10.0.0.5:5557"


def test_pool_discovery_config() -> None:
    cfg = config_from_args(parse("--pool", "p", "--pool-namespace", "ns"))
    assert cfg.kube is not None and (cfg.kube.pool, cfg.kube.namespace) == ("p", "ns")
    with pytest.raises(ConfigError, match="--pool-namespace needs --pool"):
        config_from_args(parse("--endpoint", "10.0.0.5:8000", "--pool-namespace", "ns"))


def test_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="no endpoints"):
        config_from_args(parse())
    with pytest.raises(ConfigError, match="unknown key 'grpc'"):
        EppConfig.from_dict({"grpc": 1})
    with pytest.raises(ConfigError, match=r"key 'routing'.*weights\.prefix"):
        EppConfig.from_dict({"routing": {"weights": {"prefix": -1}}})
    with pytest.raises(ConfigError, match="fallbacks"):
        EppConfig.from_dict({"fallbacks": 99})


def test_endpoint_specs() -> None:
    assert endpoint_config("10.0.0.5:8000").key == "10.0.0.5:8000"
    assert endpoint_config("http://10.0.0.5:8000").url == "http://10.0.0.5:8000"
    assert endpoint_name("http://[fd00::1]:8000/") == "[fd00::1]:8000"
    with pytest.raises(ConfigError, match="drop name="):
        endpoint_config("10.0.0.5:8000,name=a")
    with pytest.raises(ConfigError):
        endpoint_config("10.0.0.5:8000,bogus=1")
