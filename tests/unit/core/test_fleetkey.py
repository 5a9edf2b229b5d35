"""The fleet key: loading, rotation, MACs, AEAD, signed values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.core import fleetkey
from kvmesh.core.fleetkey import CHUNK_AEAD, CHUNK_MAC, TRANSFER_PARAMS, FleetKey
from kvmesh.errors import ConfigError

A = b"a" * 32
B = b"b" * 40


def _file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    p = tmp_path / "fleet.key"
    p.write_text(text)
    p.chmod(mode)
    return p


def test_load_skips_comments_and_blank_lines(tmp_path: Path) -> None:
    k = FleetKey.load(_file(tmp_path, "# rotated 2026-12\n\n  " + A.decode() + "  \n" + B.decode() + "\n"))
    assert len(k.key_ids) == 2
    assert k.key_id == FleetKey([A]).key_id
    assert "a" * 32 not in repr(k)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "no key found"),
        ("# only a comment\n", "no key found"),
        ("short\n", "at least 32"),
        (A.decode() + "\n" + A.decode() + "\n", "listed twice"),
    ],
)
def test_bad_files_are_config_errors(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        FleetKey.load(_file(tmp_path, text))


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.key"):
        FleetKey.load(tmp_path / "nope.key")


def test_world_readable_file_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    FleetKey.load(_file(tmp_path, A.decode(), mode=0o644))
    assert "chmod 600" in caplog.text


def test_from_config_prefers_the_path_then_the_environment(tmp_path: Path) -> None:
    p = _file(tmp_path, A.decode())
    assert FleetKey.from_config(None, {}) is None
    env_key = FleetKey.from_config(None, {fleetkey.ENV_VAR: str(p)})
    assert env_key is not None and env_key.key_id == FleetKey([A]).key_id


def test_rotation_first_signs_all_verify() -> None:
    old, new_first, old_only = FleetKey([A]), FleetKey([B, A]), FleetKey([A])
    tag_old = old.mac(CHUNK_MAC, b"payload")
    tag_new = new_first.mac(CHUNK_MAC, b"payload")
    assert new_first.verify(CHUNK_MAC, tag_old, b"payload")  # step 2 reads what step 1 wrote
    assert not old_only.verify(CHUNK_MAC, tag_new, b"payload")  # a key nobody lists: refused
    assert FleetKey([A, B]).verify(CHUNK_MAC, tag_new, b"payload")


def test_purposes_are_separated() -> None:
    k = FleetKey([A])
    tag = k.mac(CHUNK_MAC, b"x")
    assert not k.verify(TRANSFER_PARAMS, tag, b"x")
    with pytest.raises(ValueError, match="unknown fleet key purpose"):
        k.mac("made up", b"x")


def test_parts_are_length_framed() -> None:
    k = FleetKey([A])
    assert not k.verify(CHUNK_MAC, k.mac(CHUNK_MAC, b"ab", b"c"), b"a", b"bc")


@given(
    st.binary(max_size=256), st.integers(min_value=0, max_value=fleetkey.TAG_BYTES - 1), st.integers(1, 255)
)
def test_any_flipped_tag_byte_fails(data: bytes, pos: int, flip: int) -> None:
    k = FleetKey([A])
    tag = bytearray(k.mac(CHUNK_MAC, data))
    assert k.verify(CHUNK_MAC, bytes(tag), data)
    tag[pos] ^= flip
    assert not k.verify(CHUNK_MAC, bytes(tag), data)


@given(st.binary(max_size=64))
def test_malformed_tags_are_false_not_errors(tag: bytes) -> None:
    assert FleetKey([A]).verify(CHUNK_MAC, tag, b"x") is False


def test_aead_round_trip_and_tamper() -> None:
    k = FleetKey([A])
    sealed = k.seal(CHUNK_AEAD, b"secret tokens", aad=b"key-1")
    assert b"secret tokens" not in sealed
    assert k.open(CHUNK_AEAD, sealed, aad=b"key-1") == b"secret tokens"
    assert k.open(CHUNK_AEAD, sealed, aad=b"key-2") is None
    bad = bytearray(sealed)
    bad[-1] ^= 1
    assert k.open(CHUNK_AEAD, bytes(bad), aad=b"key-1") is None
    assert k.open(CHUNK_AEAD, sealed[:10]) is None
    assert FleetKey([B]).open(CHUNK_AEAD, sealed, aad=b"key-1") is None
    assert FleetKey([B, A]).open(CHUNK_AEAD, sealed, aad=b"key-1") == b"secret tokens"


def test_signed_values() -> None:
    k = FleetKey([A])
    params = {"host": "10.0.0.5", "port": 7000, "keys": ["k1", "k2"], "exp": 123.5}
    sig = k.sign_value(TRANSFER_PARAMS, params)
    assert k.verify_value(TRANSFER_PARAMS, dict(reversed(list(params.items()))), sig)
    assert not k.verify_value(TRANSFER_PARAMS, {**params, "port": 7001}, sig)
    for junk in (None, 5, "zz", sig[:-2], sig.upper() + "g"):
        assert not k.verify_value(TRANSFER_PARAMS, params, junk)
    assert not k.verify_value(TRANSFER_PARAMS, {"x": float("nan")}, sig)


def test_cli_writes_a_private_key_file(tmp_path: Path) -> None:
    out = tmp_path / "k"
    cmd = [sys.executable, "-m", "kvmesh.cli", "config", "fleet-key", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    assert out.stat().st_mode & 0o777 == 0o600
    assert len(FleetKey.load(out).key_ids) == 1
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 1 and "cannot create" in again.stderr
    printed = subprocess.run(cmd[:-2], check=True, capture_output=True, text=True).stdout.strip()
    assert len(printed) == 64 and int(printed, 16) >= 0
    os.unlink(out)


def test_seal_into_and_open_into_match_seal_and_open() -> None:
    import numpy as np

    k = FleetKey([A])
    plain = np.arange(5000, dtype=np.uint16).view(np.uint8)
    out = np.empty(plain.nbytes + fleetkey.AEAD_OVERHEAD, dtype=np.uint8)
    k.seal_into(CHUNK_AEAD, plain, out, aad=b"h")
    assert k.open(CHUNK_AEAD, out.tobytes(), aad=b"h") == plain.tobytes()
    back = np.empty(plain.nbytes, dtype=np.uint8)
    assert k.open_into(CHUNK_AEAD, out, back, aad=b"h") and back.tobytes() == plain.tobytes()
    assert not k.open_into(CHUNK_AEAD, out, back, aad=b"other")
    assert not k.open_into(CHUNK_AEAD, out, back[:-1], aad=b"h")  # wrong size: refused, not raised
    with pytest.raises(ValueError, match="needs"):
        k.seal_into(CHUNK_AEAD, plain, out[:-1])


def test_gmac_tags_large_buffers_without_hiding_them() -> None:
    import numpy as np

    from kvmesh.core.fleetkey import CHUNK_GMAC

    k = FleetKey([A])
    data = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8)
    tag = k.gmac(CHUNK_GMAC, data)
    assert len(tag) == fleetkey.GMAC_BYTES and tag[:8] == k.key_id
    assert k.verify_gmac(CHUNK_GMAC, tag, data)
    assert tag != k.gmac(CHUNK_GMAC, data)  # a fresh nonce every tag
    data[12345] ^= 1
    assert not k.verify_gmac(CHUNK_GMAC, tag, data)
    data[12345] ^= 1
    assert not k.verify_gmac(CHUNK_AEAD, tag, data)  # another purpose, another key
    assert not FleetKey([B]).verify_gmac(CHUNK_GMAC, tag, data)
    assert FleetKey([B, A]).verify_gmac(CHUNK_GMAC, tag, data)
    assert not k.verify_gmac(CHUNK_GMAC, tag[:-1], data)
