"""``kvmesh config check`` reports the fleet key as the engine will load it, refuses what the
engine would refuse, and says plainly when a shared tier has no key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.cli import main
from kvmesh.core.fleetkey import FleetKey

PLANT = "anyone who can write to it can plant KV"


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVMESH_FLEET_KEY_FILE", raising=False)


def _check(tmp_path: Path, body: str) -> int:
    cfg = tmp_path / "kvmesh.yaml"
    cfg.write_text(body)
    return main(["config", "check", str(cfg)])


def test_a_shared_tier_without_a_key_is_flagged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _check(tmp_path, "remote_url: redis://:pw@cache:6379/0\n") == 0
    out = capsys.readouterr().out
    assert f"warning: the shared remote tier redis://***@cache:6379/0 has no fleet key: {PLANT}" in out
    assert _check(tmp_path, "local_disk: /tmp/x\n") == 0  # no shared tier: nothing to say
    assert PLANT not in capsys.readouterr().out


def test_a_key_is_loaded_and_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    key = tmp_path / "fleet.key"
    key.write_text(FleetKey.generate() + "\n")
    key.chmod(0o600)
    assert _check(tmp_path, f"remote_url: fs:///shared\nfleet_key_file: {key}\nencrypt_at_rest: true\n") == 0
    out = capsys.readouterr().out
    assert "fleet key: FleetKey(1 key(s)" in out and "encrypted (AES-256-GCM)" in out and PLANT not in out
    monkeypatch.setenv("KVMESH_FLEET_KEY_FILE", str(key))
    assert _check(tmp_path, "remote_url: fs:///shared\n") == 0
    out = capsys.readouterr().out
    assert "from $KVMESH_FLEET_KEY_FILE" in out and "authenticated (keyed MAC)" in out


def test_what_the_engine_refuses_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _check(tmp_path, "remote_url: fs:///shared\nencrypt_at_rest: true\n") == 1
    err = capsys.readouterr().err
    assert "encrypt_at_rest" in err and "fleet_key_file" in err
    assert _check(tmp_path, f"fleet_key_file: {tmp_path / 'missing.key'}\n") == 1
    assert "cannot be read" in capsys.readouterr().err
