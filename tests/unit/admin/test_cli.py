"""``kvmesh cache ...`` (kvmesh.admin.cli) against a real controller on a Router, one bare
engine's admin API and one dead admin URL."""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvmesh import CacheConfig, CacheEngine, KVLayout
from kvmesh.admin.cli import add_cache_parser, build_request, render, table
from kvmesh.admin.server import AdminServer
from kvmesh.harness.ports import free_port
from kvmesh.router import RouterConfig
from kvmesh.router.config import ControllerConfig
from kvmesh.router.server import Router
from kvmesh.tiers.testing import reset_memory_stores

LAYOUT = KVLayout(2, 2, 8, torch.float32)
CS = 16
TOKEN = "cli-token"
IDS = [(i * 7919) % 32000 for i in range(40)]


def parse(*argv: str) -> argparse.Namespace:
    root = argparse.ArgumentParser(prog="kvmesh")
    add_cache_parser(root.add_subparsers(dest="command", required=True))
    return root.parse_args(["cache", *argv])


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    args = parse(*argv)
    code = int(args.func(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[str, CacheEngine]]:
    reset_memory_stores()
    cfg = CacheConfig.from_dict(
        {
            "chunk_size": CS,
            "max_local_cpu_size": 64 * CS * LAYOUT.bytes_per_token / 1024**3,
            "local_disk": str(tmp_path / "disk"),
            "max_local_disk_size": 0,
            "remote_url": f"mem://{uuid.uuid4().hex}",
        }
    )
    eng = CacheEngine(cfg, layout=LAYOUT, model_id="m")
    kv = torch.arange(LAYOUT.shape(40)[0] * 2 * 40 * 2 * 8, dtype=torch.float32).view(LAYOUT.shape(40)) % 7
    eng.store(IDS, kv)
    eng.wait_for_writes(10)
    dead = free_port()
    admin = AdminServer(eng, token=TOKEN).start()
    specs = (f"{admin.url},name=a", f"http://127.0.0.1:{dead},name=dead")
    router = Router(
        RouterConfig(port=0, controller=ControllerConfig(admins=specs, token=TOKEN, call_timeout_s=3))
    )
    router.start()
    try:
        yield router.url, eng
    finally:
        router.stop()
        admin.stop()
        eng.close(timeout=10)
        reset_memory_stores()


def test_lookup_table_and_json(
    setup: tuple[str, CacheEngine], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = setup
    tokens = ",".join(map(str, IDS))
    code, _, err = run(capsys, "lookup", "--controller", url, "--tokens", tokens)
    assert code == 2 and "401" in err  # a configured token is needed for every call
    monkeypatch.setenv("KVMESH_ADMIN_TOKEN", TOKEN)
    code, out, _ = run(capsys, "lookup", "--controller", url, "--tokens", tokens, "--cache-salt", "other")
    assert code == 1 and out.splitlines()[2].split() == ["a", "0", "0", "0", "0"]
    tokens = ",".join(map(str, IDS))
    code, out, _ = run(capsys, "lookup", "--controller", url, "--tokens", tokens, "--replica", "a")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["replica", "cpu", "disk", "remote", "hit", "tokens"]
    assert lines[2].split() == ["a", "32", "32", "32", "32"]
    assert "shared remote tier: 32 of 40 tokens" in out
    code, out, _ = run(capsys, "lookup", "--controller", url, "--tokens", tokens, "--json")
    assert code == 1  # the dead replica
    data = json.loads(out)
    assert data["replicas"]["a"]["result"]["hit_tokens"] == 32
    assert data["replicas"]["dead"]["ok"] is False


def test_mutating_commands(
    setup: tuple[str, CacheEngine],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, eng = setup
    f = tmp_path / "ids.json"
    f.write_text(json.dumps(IDS))
    base = ["--controller", url, "--replica", "a"]
    code, _, err = run(capsys, "pin", *base, "--tokens-file", str(f))
    assert code == 2 and "401" in err  # no token
    monkeypatch.setenv("KVMESH_ADMIN_TOKEN", TOKEN)
    code, out, _ = run(capsys, "pin", *base, "--tokens-file", str(f))
    assert code == 0 and "cpu,disk" in out
    code, out, _ = run(capsys, "clear", *base, "--tier", "cpu")
    assert code == 0 and out.splitlines()[2].split()[:2] == ["a", "0"]
    run(capsys, "unpin", *base, "--tokens-file", str(f))
    code, out, _ = run(capsys, "compress", *base, "--tokens-file", str(f), "--tier", "disk")
    assert code == 0 and " disk " in out
    code, out, _ = run(capsys, "decompress", *base, "--tokens-file", str(f), "--tier", "disk")
    assert code == 0
    code, out, _ = run(capsys, "move", *base, "--tokens-file", str(f), "--tier", "cpu")
    assert code == 0 and "a" in out
    code, out, _ = run(capsys, "clear", *base, "--force")
    assert code == 0 and eng.lookup(IDS) == 0


def test_health_wait_stats(
    setup: tuple[str, CacheEngine], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = setup
    monkeypatch.setenv("KVMESH_ADMIN_TOKEN", TOKEN)
    code, out, _ = run(capsys, "health", "--controller", url)
    assert code == 1
    assert any(line.split()[:3] == ["a", "up", "up"] for line in out.splitlines())
    assert "dead" in out and "down" in out
    code, out, _ = run(capsys, "wait", "--controller", url, "--replica", "a", "--timeout", "5")
    assert code == 0 and out.splitlines()[2].split()[:2] == ["a", "yes"]
    code, out, _ = run(capsys, "stats", "--controller", url, "--replica", "a")
    assert code == 0
    assert {line.split()[1] for line in out.splitlines()[2:]} == {"cpu", "disk", "remote"}


def test_errors(
    setup: tuple[str, CacheEngine], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = setup
    monkeypatch.setenv("KVMESH_ADMIN_TOKEN", TOKEN)
    code, _, err = run(capsys, "lookup", "--controller", url, "--tokens", "1,-2")
    assert code == 2 and "422" in err and "tokens.1" in err
    code, _, err = run(capsys, "lookup", "--controller", url, "--prompt", "hi")
    assert code == 2 and "tokenizer" in err
    code, _, err = run(capsys, "lookup", "--controller", url, "--tokens", "1,x")
    assert code == 2
    code, _, err = run(capsys, "health", "--controller", "http://127.0.0.1:1")
    assert code == 2 and "cannot reach" in err


def test_parser_and_request_shapes() -> None:
    op, body = build_request(parse("wait", "--timeout", "7", "--replica", "a"))
    assert op == "check_finish" and body == {"replicas": ["a"], "wait": True, "timeout_s": 7.0}
    op, body = build_request(parse("wait", "--no-wait"))
    assert body["wait"] is False
    op, body = build_request(parse("compress", "--tokens", "1 2 3", "--codec", "raw", "--tier", "disk"))
    assert body == {"tokens": [1, 2, 3], "codec": "raw", "tier": "disk"}
    op, body = build_request(parse("clear", "--force"))
    assert op == "clear" and body == {"force": True}
    with pytest.raises(SystemExit):
        parse("lookup")  # tokens or a prompt are required
    with pytest.raises(SystemExit):
        parse("move", "--tokens", "1")  # --tier is required


def test_render_error_rows_and_empty() -> None:
    data: dict[str, Any] = {"replicas": {"x": {"ok": False, "status": "down", "error": "boom"}}}
    out = render("stats", data)
    assert "boom" in out and "x" in out
    assert render("stats", {"replicas": {}}) == "(no replicas)"
    assert table(["a", "b"], [[1, None]]).splitlines()[2].split() == ["1", "-"]
    np.testing.assert_equal(len(IDS), 40)
