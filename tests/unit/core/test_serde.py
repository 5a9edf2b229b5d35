"""Chunk wire format: round trips, compression, and detection of every kind of damage."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from kvmesh.core import serde
from kvmesh.core.keys import KeyBuilder, KVLayout
from kvmesh.errors import ConfigError, CorruptChunkError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _chunk(dtype: str, num_tokens: int = 16, layout: KVLayout | None = None, seed: int = 0):
    layout = layout or KVLayout(2, 2, 8, dtype)
    tokens = np.arange(100, 100 + num_tokens, dtype=np.uint32)
    key = KeyBuilder("m", layout, num_tokens).keys(tokens)[0]
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(layout.shape(num_tokens), generator=gen).to(DTYPES[layout.dtype])
    return key, layout, tokens, kv


def _bytes_of(kv: torch.Tensor) -> np.ndarray:
    return kv.contiguous().view(torch.uint8).reshape(-1).numpy()


@pytest.mark.parametrize("codec", ["raw", "zstd", "safetensors"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip(codec: str, dtype: str) -> None:
    key, layout, tokens, kv = _chunk(dtype)
    blob = serde.encode_bytes(key, layout, tokens, _bytes_of(kv), codec)
    header, raw = serde.decode(blob, expected_key=key.text)
    assert header.key == key.text
    assert header.layout == layout
    assert header.codec == codec
    assert header.shape == layout.shape(16)
    assert header.raw_len == kv.numel() * kv.element_size()
    assert header.header_size + header.payload_len == len(blob)
    np.testing.assert_array_equal(header.tokens, tokens)
    assert bytes(raw) == _bytes_of(kv).tobytes()
    back = torch.frombuffer(bytearray(raw), dtype=DTYPES[dtype]).view(layout.shape(16))
    assert torch.equal(back, kv)


@pytest.mark.parametrize("codec", ["raw", "zstd", "safetensors"])
def test_round_trip_of_special_values(codec: str) -> None:
    layout = KVLayout(1, 1, 8, "float16")
    tokens = np.arange(4, dtype=np.uint32)
    kv = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 65504.0, 6e-8, -1.0] * 8, dtype=torch.float16
    ).view(layout.shape(4))
    blob = serde.encode_bytes("k", layout, tokens, _bytes_of(kv), codec)
    _, raw = serde.decode(blob, expected_key="k")
    assert bytes(raw) == _bytes_of(kv).tobytes()


def test_encode_returns_header_and_payload_without_copying_a_raw_payload() -> None:
    key, layout, tokens, kv = _chunk("float32")
    payload = _bytes_of(kv)
    head, body = serde.encode(key, layout, tokens, payload, "raw")
    assert bytes(body) == payload.tobytes()
    assert serde.header_length(head[: serde.PREFIX_SIZE]) == len(head)
    header = serde.decode_header(head, expected_key=key.text)
    assert bytes(serde.decode_payload(header, body)) == payload.tobytes()


def test_zstd_byte_planes_beat_plain_zstd_on_smooth_float16() -> None:
    layout = KVLayout(4, 2, 64, "float16")
    n = 64
    t = torch.linspace(0, 8, n).view(1, 1, n, 1, 1)
    d = torch.linspace(0, 3, 64).view(1, 1, 1, 1, 64)
    gen = torch.Generator().manual_seed(1)
    noise = 0.01 * torch.randn(layout.shape(n), generator=gen)
    kv = (torch.sin(t + d) + noise).to(torch.float16).contiguous()
    raw = _bytes_of(kv)
    planes = serde.ZstdPlaneCodec(level=3).encode(memoryview(raw), layout, n)
    plain = zstandard.ZstdCompressor(level=3).compress(raw.tobytes())
    assert len(planes) < 0.9 * len(plain), (len(planes), len(plain), raw.nbytes)
    blob = serde.encode_bytes("k", layout, np.arange(n, dtype=np.uint32), raw, "zstd")
    assert len(blob) < raw.nbytes
    assert bytes(serde.decode(blob)[1]) == raw.tobytes()


def _small_blob(codec: str) -> tuple[bytes, str]:
    layout = KVLayout(1, 1, 2, "float16")
    tokens = np.array([5, 6, 7, 8], dtype=np.uint32)
    key = KeyBuilder("m", layout, 4).keys(tokens)[0]
    kv = torch.arange(layout.shape(4)[0] * 2 * 4 * 2, dtype=torch.float16).view(layout.shape(4))
    return serde.encode_bytes(key, layout, tokens, _bytes_of(kv), codec), key.text


@pytest.mark.parametrize("codec", ["raw", "zstd", "safetensors", "cachegen"])
@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_single_byte_flip_is_detected(codec: str, mask: int) -> None:
    blob, key = _small_blob(codec)
    assert len(blob) < 2048  # small enough to try every position
    serde.decode(blob, expected_key=key)  # the intact blob decodes
    undetected = []
    for pos in range(len(blob)):
        bad = bytearray(blob)
        bad[pos] ^= mask
        for expected in (key, None):
            try:
                serde.decode(bytes(bad), expected_key=expected)
            except CorruptChunkError:
                continue
            undetected.append((pos, expected))
    assert not undetected, f"flips not detected at {undetected[:10]} of {len(blob)} bytes"


@pytest.mark.parametrize("codec", ["raw", "zstd", "safetensors", "cachegen"])
def test_truncation_is_detected(codec: str) -> None:
    blob, key = _small_blob(codec)
    for n in range(len(blob)):
        with pytest.raises(CorruptChunkError):
            serde.decode(blob[:n], expected_key=key)
        with pytest.raises(CorruptChunkError):
            serde.decode(memoryview(blob)[:n])


def test_trailing_garbage_is_detected() -> None:
    blob, key = _small_blob("raw")
    with pytest.raises(CorruptChunkError):
        serde.decode(blob + b"\x00", expected_key=key)


def test_wrong_expected_key_is_detected() -> None:
    blob, key = _small_blob("raw")
    other = key[:-1] + ("0" if key[-1] != "0" else "1")
    with pytest.raises(CorruptChunkError, match="expected"):
        serde.decode(blob, expected_key=other)
    with pytest.raises(CorruptChunkError):
        serde.decode_header(blob, expected_key=other)


def test_garbage_is_detected() -> None:
    rng = np.random.default_rng(0)
    for n in (0, 3, 19, 20, 64, 4096):
        with pytest.raises(CorruptChunkError):
            serde.decode(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
    with pytest.raises(CorruptChunkError, match="magic"):
        serde.decode(b"PKL\x00" + bytes(100))


@pytest.mark.parametrize("name", ["lz4", "pickle", "", "ZSTD"])
def test_unknown_codec_is_a_config_error(name: str) -> None:
    with pytest.raises(ConfigError, match="unknown codec"):
        serde.get_codec(name)
    key, layout, tokens, kv = _chunk("float32")
    with pytest.raises(ConfigError, match="raw"):
        serde.encode(key, layout, tokens, _bytes_of(kv), name)


def test_lmcache_codec_names_map_to_raw() -> None:
    assert serde.get_codec("naive").name == "raw"
    key, layout, tokens, kv = _chunk("float32")
    header, raw = serde.decode(serde.encode_bytes(key, layout, tokens, _bytes_of(kv), "naive"))
    assert header.codec == "raw"
    assert bytes(raw) == _bytes_of(kv).tobytes()


def test_payload_of_the_wrong_size_is_refused_on_encode() -> None:
    key, layout, tokens, kv = _chunk("float32")
    with pytest.raises(ValueError, match="expected"):
        serde.encode(key, layout, tokens, _bytes_of(kv)[:-4], "raw")


def test_lmcache_v0_and_v1_codec_names() -> None:
    assert serde.get_codec("safetensor").name == "safetensors"
    assert serde.get_codec("torch").name == "raw"
    assert serde.get_codec("cachegen").lossless is False
    assert all(serde.get_codec(n).lossless for n in ("raw", "zstd", "safetensors"))


def test_kivi_is_refused_with_a_reason() -> None:
    with pytest.raises(ConfigError, match=r"kivi.*not supported.*stub"):
        serde.get_codec("kivi")


def test_safetensors_payload_is_a_safetensors_file() -> None:
    from safetensors.torch import load

    key, layout, tokens, kv = _chunk("bfloat16")
    _head, body = serde.encode(key, layout, tokens, _bytes_of(kv), "safetensors")
    tensors = load(bytes(body))
    assert torch.equal(tensors["kv"], kv)


def test_cachegen_is_smaller_and_close_on_smooth_kv() -> None:
    layout = KVLayout(4, 2, 64, "bfloat16")
    n = 256
    t = torch.linspace(0, 8, n).view(1, 1, n, 1, 1)
    d = torch.linspace(0, 3, 64).view(1, 1, 1, 1, 64)
    gen = torch.Generator().manual_seed(1)
    kv = (torch.sin(t + d) + 0.01 * torch.randn(layout.shape(n), generator=gen)).to(torch.bfloat16)
    blob = serde.encode_bytes("k", layout, np.arange(n, dtype=np.uint32), _bytes_of(kv), "cachegen")
    header, raw = serde.decode(blob, expected_key="k")
    assert header.codec == "cachegen"
    back = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).view(layout.shape(n))
    assert len(blob) * 6 < kv.numel() * 2
    rel = (back.float() - kv.float()).norm() / kv.float().norm()
    assert rel < 0.1, rel
