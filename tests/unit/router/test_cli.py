"""``kvmesh router`` arguments, and the command serving in its own process until SIGTERM."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from kvmesh.errors import ConfigError
from kvmesh.harness.ports import free_port
from kvmesh.router.cli import add_router_parser, config_from_args
from kvmesh.router.testing import FakeVLLM, write_test_tokenizer

ROOT = Path(__file__).resolve().parents[3]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvmesh")
    add_router_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["router", *argv])


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    cfg_file = tmp_path / "r.yaml"
    cfg_file.write_text("policy: least-loaded\nport: 9000\nweights: {prefix: 5}\nreplicas: ['http://h:1']\n")
    cfg = config_from_args(parse("--config", str(cfg_file), "--port", "9100"))
    assert (cfg.policy, cfg.port, cfg.weights.prefix, [r.url for r in cfg.replicas]) == (
        "least-loaded",
        9100,
        5.0,
        ["http://h:1"],
    )
    cfg = config_from_args(
        parse("--config", str(cfg_file), "--replica", "http://x:2,events=tcp://x:5557", "--policy", "random")
    )
    assert cfg.policy == "random" and cfg.replicas[0].events == "tcp://x:5557" and len(cfg.replicas) == 1


def test_replica_admin_and_controller_section(tmp_path: Path) -> None:
    cfg_file = tmp_path / "r.yaml"
    cfg_file.write_text("controller: {rebuild_max_chunks: 10, rebuild: false}\n")
    cfg = config_from_args(
        parse("--config", str(cfg_file), "--replica", "http://x:2,admin=http://x:8200/,name=r0")
    )
    assert cfg.replicas[0].admin == "http://x:8200" and cfg.replicas[0].key == "r0"
    assert cfg.controller.rebuild_max_chunks == 10 and cfg.controller.rebuild is False
    with pytest.raises(ConfigError, match="admin"):
        config_from_args(parse("--replica", "http://x:2,admin=x:8200"))
    cfg_file.write_text("controller: {rebuild_max_chunks: -1}\n")
    with pytest.raises(ConfigError, match=r"controller\.rebuild_max_chunks"):
        config_from_args(parse("--config", str(cfg_file), "--replica", "http://x:2"))


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="no replicas"):
        config_from_args(parse())
    with pytest.raises(ConfigError, match="bad replica option"):
        config_from_args(parse("--replica", "http://h:1,zmq=tcp://h:2"))
    with pytest.raises(SystemExit):
        parse("--policy", "fastest")


_MAIN = textwrap.dedent(
    """
    import argparse, sys
    from kvmesh.router.cli import add_router_parser
    parser = argparse.ArgumentParser(prog="kvmesh")
    add_router_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(sys.argv[1:])
    sys.exit(args.func(args))
    """
)


def test_router_command_serves_until_sigterm(tmp_path: Path) -> None:
    tok = write_test_tokenizer(tmp_path / "tok")
    port = free_port()
    fake = FakeVLLM("a").start()
    cmd = [
        sys.executable,
        "-c",
        _MAIN,
        "router",
        "--model",
        str(tok),
        "--replica",
        fake.url,
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and proc.stdout.read()
            time.sleep(0.1)
        body = {"model": "tiny", "prompt": "hello"}
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"].startswith("a:")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        fake.stop()
