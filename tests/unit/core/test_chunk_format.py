"""Chunk format 2 (kvmesh.core.serde.ChunkFormat): keyed MAC and AEAD round trips, every
kind of tampering, rotation, which reader refuses what, and the bounds checked before
anything is allocated."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import xxhash
import zstandard

from kvmesh.core import fleetkey, serde
from kvmesh.core.codecs.base import zstd_decompress
from kvmesh.core.fleetkey import FleetKey
from kvmesh.core.keys import ChunkKey, KeyBuilder, KVLayout
from kvmesh.core.serde import ChunkFormat, Mode
from kvmesh.errors import ConfigError, CorruptChunkError, UnauthenticatedChunkError

LAYOUT = KVLayout(2, 2, 8, "float16")
N = 16
K1, K2 = FleetKey([b"a" * 40]), FleetKey([b"b" * 40])


def _chunk(seed: int = 0) -> tuple[ChunkKey, np.ndarray, bytes]:
    tokens = np.arange(1000 + seed, 1000 + seed + N, dtype=np.uint32)
    key = KeyBuilder("m", LAYOUT, N).keys(tokens)[0]
    raw = np.random.default_rng(seed).integers(0, 255, N * LAYOUT.bytes_per_token, dtype=np.uint8).tobytes()
    return key, tokens, raw


@pytest.mark.parametrize("encrypt", [False, True])
@pytest.mark.parametrize("codec", ["raw", "zstd", "safetensors"])
def test_keyed_round_trip(encrypt: bool, codec: str) -> None:
    key, tokens, raw = _chunk()
    fmt = ChunkFormat(K1, encrypt, LAYOUT)
    blob = fmt.encode_bytes(key, LAYOUT, tokens, raw, codec)
    header, out = fmt.decode(blob, key)
    assert bytes(out) == raw
    np.testing.assert_array_equal(header.tokens, tokens)
    assert header.mode == (Mode.AEAD if encrypt else Mode.MAC)
    assert (raw in blob) is (codec in ("raw", "safetensors") and not encrypt)  # a MAC hides nothing


def test_encrypted_raw_payload_is_decrypted_into_the_callers_buffer() -> None:
    key, tokens, raw = _chunk()
    fmt = ChunkFormat(K1, True, LAYOUT)
    head, body = fmt.encode(key, LAYOUT, tokens, raw)
    header = fmt.decode_header(head, key)
    slot = np.empty(len(raw), dtype=np.uint8)
    asked: list[int] = []

    def into(n: int) -> memoryview:
        asked.append(n)
        return slot.data

    out = fmt.decode_payload(header, body, into)
    assert asked == [len(raw)] and np.shares_memory(np.frombuffer(out, dtype=np.uint8), slot)
    assert slot.tobytes() == raw


def _regions(blob: bytes) -> dict[str, int]:
    """An offset inside each part of a serialized chunk."""
    hlen = struct.unpack_from("<I", blob, 8)[0]
    return {"prefix": 7, "json": 20 + hlen // 2, "tag": 20 + hlen + 20, "payload": len(blob) - 5}


@pytest.mark.parametrize("encrypt", [False, True])
@pytest.mark.parametrize("where", ["prefix", "json", "tag", "payload"])
def test_any_flipped_byte_is_refused(encrypt: bool, where: str) -> None:
    key, tokens, raw = _chunk()
    fmt = ChunkFormat(K1, encrypt, LAYOUT)
    blob = bytearray(fmt.encode_bytes(key, LAYOUT, tokens, raw))
    blob[_regions(bytes(blob))[where]] ^= 0x01
    with pytest.raises(CorruptChunkError):
        fmt.decode(bytes(blob), key)


def test_rotation_and_foreign_keys() -> None:
    key, tokens, raw = _chunk()
    old = ChunkFormat(K1, layout=LAYOUT).encode_bytes(key, LAYOUT, tokens, raw)
    rotated = ChunkFormat(FleetKey([b"b" * 40, b"a" * 40]), layout=LAYOUT)
    assert bytes(rotated.decode(old, key)[1]) == raw
    with pytest.raises(UnauthenticatedChunkError) as err:
        ChunkFormat(K2, layout=LAYOUT).decode(old, key)
    assert err.value.discard  # not the fleet's: a keyed reader may delete it


def test_who_refuses_what() -> None:
    key, tokens, raw = _chunk()
    plain = serde.PLAIN.encode_bytes(key, LAYOUT, tokens, raw)
    keyed = ChunkFormat(K1).encode_bytes(key, LAYOUT, tokens, raw)
    with pytest.raises(UnauthenticatedChunkError) as err:
        ChunkFormat(K1).decode(plain, key)
    assert err.value.discard
    with pytest.raises(UnauthenticatedChunkError) as err:
        serde.PLAIN.decode(keyed, key)
    assert not err.value.discard  # a reader without a key leaves the fleet's chunks alone


def test_encrypt_without_a_key_names_both_settings() -> None:
    with pytest.raises(ConfigError, match=r"encrypt_at_rest.*fleet_key_file"):
        ChunkFormat(None, encrypt=True)


def _resealed(blob: bytes, edit: Callable[[dict[str, Any]], object], payload: bytes | None = None) -> bytes:
    """A mode-0 chunk with its JSON edited and checksums recomputed (a writer without a key)."""
    _m, _v, mode, hlen, _plen = struct.unpack_from("<4sHHIQ", blob)
    meta = json.loads(blob[20 : 20 + hlen])
    body = blob[20 + hlen + 8 :] if payload is None else payload
    edit(meta)
    meta["checksum"] = xxhash.xxh3_128_hexdigest(body)
    hjson = json.dumps(meta).encode()
    head = struct.pack("<4sHHIQ", b"KVMC", 2, mode, len(hjson), len(body)) + hjson
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + body


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(n_tokens=N * 4),  # more tokens than the key names
        lambda m: m.update(layout={**LAYOUT.to_dict(), "num_layers": 4096}, raw_len=N * 4096 * 64),
        lambda m: m.update(raw_len=m["raw_len"] + 2),
        lambda m: m.update(codec="lz4"),
        lambda m: m.update(tokens="!!!"),
        lambda m: m.pop("n_tokens"),
    ],
)
def test_header_claims_are_bounded_before_anything_is_allocated(
    edit: Callable[[dict[str, Any]], object],
) -> None:
    key, tokens, raw = _chunk()
    fmt = ChunkFormat(None, layout=LAYOUT)
    blob = _resealed(fmt.encode_bytes(key, LAYOUT, tokens, raw), edit)
    with pytest.raises(CorruptChunkError):
        fmt.decode_header(blob, key)


def test_a_payload_larger_than_its_codec_can_make_is_refused_unread() -> None:
    key, tokens, raw = _chunk()
    fmt = ChunkFormat(None, layout=LAYOUT)
    blob = fmt.encode_bytes(key, LAYOUT, tokens, raw, "zstd")
    big = _resealed(blob, lambda m: None, payload=bytes(3 * len(raw)))
    with pytest.raises(CorruptChunkError, match="makes <="):
        fmt.decode_header(big, key)


def test_zstd_frames_must_declare_exactly_the_raw_length() -> None:
    data = bytes(4096)
    with pytest.raises(CorruptChunkError, match="declares 4096 bytes"):
        zstd_decompress(zstandard.ZstdCompressor().compress(data), 1024)
    undeclared = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    with pytest.raises(CorruptChunkError, match="no content size"):
        zstd_decompress(undeclared, 4096)
    assert zstd_decompress(zstandard.ZstdCompressor().compress(data), 4096) == data


def test_cachegen_refuses_a_group_that_would_inflate_its_arrays() -> None:
    import torch

    from kvmesh.core.codecs.cachegen import _HEAD, CacheGenCodec

    layout = KVLayout(2, 2, 8, "bfloat16")
    codec = CacheGenCodec()
    raw = torch.randn(layout.shape(N)).to(torch.bfloat16).view(torch.uint8).reshape(-1).numpy().tobytes()
    enc = bytearray(codec.encode(memoryview(raw), layout, N))
    magic, ent, _g, q, s, t, c = _HEAD.unpack_from(enc)
    _HEAD.pack_into(enc, 0, magic, ent, 65535, q, s, t, c)  # a 65535-token group for 16 tokens
    with pytest.raises(CorruptChunkError, match="invalid parameters"):
        codec.decode(memoryview(bytes(enc)), layout, N, len(raw))
    assert len(enc) <= codec.max_encoded(layout, N)


def test_recycled_buffers_come_back_only_when_no_view_is_left() -> None:
    from kvmesh.core.codecs.base import _Recycler

    def addr(mv: memoryview) -> int:
        return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)

    pool = _Recycler(limit=8 << 20)
    a = pool.get(2 << 20)
    first = addr(a)
    b = pool.get(2 << 20)  # a is still held: b is other memory
    assert addr(b) != first
    kept = np.frombuffer(a, dtype=np.uint8)[10:20]  # a view derived from a keeps it alive
    del a
    c = pool.get(2 << 20)
    assert addr(c) not in (first, addr(b))
    del kept  # now nothing reaches a's memory: it goes back to the pool ...
    assert addr(pool.get(2 << 20)) == first  # ... and is handed out again
    assert addr(pool.get(1 << 10)) not in (first, addr(b), addr(c))  # small: plain memory


@pytest.mark.parametrize("encrypt", [None, False, True], ids=["plain", "mac", "aead"])
def test_max_stored_holds_a_chunk_of_every_codec_and_mode(encrypt: bool | None) -> None:
    """``max_stored`` (what a reader takes from a store before it verifies anything: the Redis
    tier's reply bound) holds a real chunk of every codec and mode."""
    fmt = ChunkFormat(None, layout=LAYOUT) if encrypt is None else ChunkFormat(K1, encrypt, LAYOUT)
    most = fmt.max_stored(N)
    assert most is not None
    key, tokens, raw = _chunk()
    for codec in serde.CODECS:
        head, body = fmt.encode(key, LAYOUT, tokens, raw, codec)
        assert len(head) + memoryview(body).nbytes <= most, codec
    assert ChunkFormat().max_stored(N) is None  # no layout: the reader's own default bound


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16", "float32"])
@pytest.mark.parametrize("chunk_size", [1, 7, 16, 100, 256, 1024])
def test_max_stored_is_above_what_every_codec_may_store(dtype: str, chunk_size: int) -> None:
    """It is computed without making a codec; every codec's own ``max_encoded`` (the most a
    reader accepts of it, cachegen's ANS entropy coder too), a header as large as a header may
    be and the largest tags stay under it, for any chunk size and dtype."""
    from kvmesh.core.codecs.cachegen import CacheGenCodec

    layout = KVLayout(3, 5, 12, dtype)
    most = ChunkFormat(K1, True, layout).max_stored(chunk_size)
    assert most is not None
    codecs = [serde.get_codec(name) for name in serde.CODECS] + [CacheGenCodec(entropy="ans")]
    for codec in codecs:
        worst = codec.max_encoded(layout, chunk_size) + fleetkey.AEAD_OVERHEAD
        assert worst + serde.PREFIX_SIZE + serde.MAX_HEADER_LEN + 2 * fleetkey.TAG_BYTES <= most, codec.name
