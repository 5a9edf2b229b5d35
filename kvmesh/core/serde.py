"""Chunk wire format: a versioned, checksummed header followed by a payload.

Every byte that leaves the process (disk, Redis, shared filesystem) uses this format, and
nothing read back is trusted before its header and checksums pass. No pickle.

Layout (all integers little-endian)::

    offset  size  field
    0       4     magic  b"KVMC"
    4       2     format version (1)
    6       2     flags (0)
    8       4     header_len  (H): bytes of the JSON header
    12      8     payload_len (P): bytes of the stored (encoded) payload
    20      H     JSON header: key, layout, shape, codec, raw_len, tokens (base64 LE u32),
                  payload checksum (xxh3-128 hex of the stored payload)
    20+H    8     xxh3-64 of bytes [0, 20+H)  (header checksum)
    28+H    P     payload: the KV bytes, ``[layers, 2, tokens, kv_heads, head_size]``, encoded

Codecs (the ``Codec`` seam, chosen by name from a registry):

* ``raw``  — the bytes as they are.
* ``zstd`` — zstd over byte planes: every element's bytes are split into planes (high and low
  bytes of 16-bit values apart) before compressing, which compresses KV far better than
  plain zstd because exponent bytes repeat and mantissa bytes do not.
* ``safetensors`` — the KV as a safetensors blob (:mod:`kvmesh.core.codecs.safetensors_codec`).
* ``cachegen`` — lossy, opt-in: CacheGen-style delta quantisation + entropy coding
  (:mod:`kvmesh.core.codecs.cachegen`).

LMCache's names are accepted: ``naive`` / ``torch`` = raw, ``safetensor`` = safetensors;
``kivi`` (a stub in LMCache) is refused with a message.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash
import zstandard

from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.errors import ConfigError, CorruptChunkError

MAGIC = b"KVMC"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHHIQ")
PREFIX_SIZE = _PREFIX.size  # 20
HEADER_CHECKSUM_SIZE = 8
MAX_HEADER_LEN = 1 << 20  # a header is a few KiB; anything larger is corruption

Buffer = bytes | bytearray | memoryview


def empty_buffer(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` whose contents are undefined.

    ``bytearray(n)`` zero-fills every byte first, which here costs more than reading the
    same bytes from disk; this buffer's pages are only touched by whoever fills it.
    """
    return np.empty(nbytes, dtype=np.uint8).data


class Codec(Protocol):
    """Bytes in, bytes out, for ``n_tokens`` tokens of KV in ``layout``.

    ``decode`` raises :class:`CorruptChunkError` for input it cannot decode; a lossless
    codec (``lossless``) gives back exactly the bytes it was given."""

    name: str
    lossless: bool

    def encode(self, data: memoryview, layout: KVLayout, n_tokens: int) -> Buffer: ...

    def decode(self, data: memoryview, layout: KVLayout, n_tokens: int, raw_len: int) -> Buffer: ...


class RawCodec:
    name = "raw"
    lossless = True

    def encode(self, data: memoryview, layout: KVLayout, n_tokens: int) -> Buffer:
        return data

    def decode(self, data: memoryview, layout: KVLayout, n_tokens: int, raw_len: int) -> Buffer:
        return data


class ZstdPlaneCodec:
    """zstd over byte planes (see module docstring)."""

    name = "zstd"
    lossless = True

    def __init__(self, level: int = 3) -> None:
        self.level = level

    def encode(self, data: memoryview, layout: KVLayout, n_tokens: int) -> Buffer:
        itemsize = layout.itemsize
        arr = np.frombuffer(data, dtype=np.uint8)
        if itemsize > 1 and arr.size % itemsize == 0:
            arr = np.ascontiguousarray(arr.reshape(-1, itemsize).T)
        return zstandard.ZstdCompressor(level=self.level).compress(arr.tobytes())

    def decode(self, data: memoryview, layout: KVLayout, n_tokens: int, raw_len: int) -> Buffer:
        itemsize = layout.itemsize
        try:
            out = zstandard.ZstdDecompressor().decompress(bytes(data), max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            raise CorruptChunkError(f"zstd payload does not decompress: {exc}") from None
        if len(out) != raw_len:
            raise CorruptChunkError(f"zstd payload decoded to {len(out)} bytes, expected {raw_len}")
        if itemsize > 1 and raw_len % itemsize == 0:
            planes = np.frombuffer(out, dtype=np.uint8).reshape(itemsize, -1)
            return np.ascontiguousarray(planes.T).reshape(-1).data
        return out


def _safetensors() -> Codec:
    from kvmesh.core.codecs.safetensors_codec import SafetensorsCodec

    return SafetensorsCodec()


def _cachegen() -> Codec:
    from kvmesh.core.codecs.cachegen import CacheGenCodec

    return CacheGenCodec()


# Codecs load on first use: raw and zstd never import torch or constriction.
CODECS: dict[str, Callable[[], Codec]] = {
    "raw": RawCodec,
    "zstd": ZstdPlaneCodec,
    "safetensors": _safetensors,
    "cachegen": _cachegen,
}
# LMCache's serde names (v1 and v0), accepted so its config files work unchanged.
CODEC_ALIASES = {"naive": "raw", "kv": "raw", "torch": "raw", "safetensor": "safetensors"}
REFUSED_CODECS = {
    "kivi": "LMCache's kivi serde is a stub there (it stores the KV unchanged); use raw, zstd, "
    "or cachegen for a smaller lossy encoding",
}
_INSTANCES: dict[str, Codec] = {}


def check_codec_name(name: str) -> str:
    """The canonical name of codec ``name`` (LMCache's names allowed), or ConfigError."""
    if name in REFUSED_CODECS:
        raise ConfigError(f"codec {name!r} is not supported: {REFUSED_CODECS[name]}")
    canonical = CODEC_ALIASES.get(name, name)
    if canonical not in CODECS:
        raise ConfigError(
            f"unknown codec {name!r}; valid codecs: {', '.join(sorted(CODECS))} "
            f"(LMCache names: {', '.join(f'{k} = {v}' for k, v in sorted(CODEC_ALIASES.items()))})"
        )
    return canonical


def get_codec(name: str) -> Codec:
    canonical = check_codec_name(name)
    codec = _INSTANCES.get(canonical)
    if codec is None:  # codecs hold no per-call state: one instance each is enough
        codec = _INSTANCES[canonical] = CODECS[canonical]()
    return codec


@dataclass(frozen=True)
class ChunkHeader:
    key: str
    layout: KVLayout
    shape: tuple[int, ...]
    codec: str
    raw_len: int
    payload_len: int
    payload_checksum: str
    tokens: np.ndarray

    @property
    def header_size(self) -> int:
        """Bytes before the payload; set by :func:`decode_header`."""
        return self._size  # type: ignore[attr-defined, no-any-return]


def encode(
    key: ChunkKey | str,
    layout: KVLayout,
    tokens: np.ndarray,
    payload: Buffer,
    codec: str = "raw",
) -> tuple[bytes, Buffer]:
    """Encode a chunk. Returns ``(header_bytes, payload_bytes)`` so a writer can send both
    without concatenating a large payload."""
    raw = memoryview(payload).cast("B")
    cod = get_codec(codec)
    n_tokens = len(tokens)
    if raw.nbytes != n_tokens * layout.bytes_per_token:
        raise ValueError(
            f"payload is {raw.nbytes} bytes, expected {n_tokens * layout.bytes_per_token} "
            f"for {n_tokens} tokens of layout {layout}"
        )
    body = cod.encode(raw, layout, n_tokens)
    meta = {
        "key": str(key),
        "layout": layout.to_dict(),
        "shape": list(layout.shape(n_tokens)),
        "codec": cod.name,
        "raw_len": raw.nbytes,
        "tokens": base64.b64encode(np.ascontiguousarray(tokens, dtype="<u4").tobytes()).decode(),
        "checksum": xxhash.xxh3_128_hexdigest(body),
    }
    hjson = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    body_len = memoryview(body).nbytes
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(hjson), body_len) + hjson
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)), body


def encode_bytes(
    key: ChunkKey | str, layout: KVLayout, tokens: np.ndarray, payload: Buffer, codec: str = "raw"
) -> bytes:
    head, body = encode(key, layout, tokens, payload, codec)
    return head + bytes(body)


def header_length(prefix: Buffer) -> int:
    """Total header size (prefix + JSON + header checksum) from the first 20 bytes."""
    if len(prefix) < PREFIX_SIZE:
        raise CorruptChunkError(f"chunk shorter than its {PREFIX_SIZE}-byte prefix")
    magic, version, _flags, hlen, _plen = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptChunkError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptChunkError(f"unsupported chunk format version {version}")
    if hlen > MAX_HEADER_LEN:
        raise CorruptChunkError(f"header length {hlen} exceeds {MAX_HEADER_LEN}")
    return int(PREFIX_SIZE + hlen + HEADER_CHECKSUM_SIZE)


def decode_header(data: Buffer, expected_key: str | None = None) -> ChunkHeader:
    """Parse and verify a header (``data`` may hold more bytes after it)."""
    mv = memoryview(data).cast("B")
    size = header_length(mv[:PREFIX_SIZE])
    if mv.nbytes < size:
        raise CorruptChunkError(f"chunk truncated inside its header ({mv.nbytes} < {size} bytes)")
    _magic, _v, _f, hlen, plen = _PREFIX.unpack_from(mv)
    (want,) = struct.unpack_from("<Q", mv, PREFIX_SIZE + hlen)
    if xxhash.xxh3_64_intdigest(mv[: PREFIX_SIZE + hlen]) != want:
        raise CorruptChunkError("header checksum mismatch")
    try:
        meta = json.loads(bytes(mv[PREFIX_SIZE : PREFIX_SIZE + hlen]))
        layout = KVLayout.from_dict(meta["layout"])
        tokens = np.frombuffer(base64.b64decode(meta["tokens"]), dtype="<u4")
        header = ChunkHeader(
            key=str(meta["key"]),
            layout=layout,
            shape=tuple(int(x) for x in meta["shape"]),
            codec=str(meta["codec"]),
            raw_len=int(meta["raw_len"]),
            payload_len=int(plen),
            payload_checksum=str(meta["checksum"]),
            tokens=tokens,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptChunkError(f"unreadable chunk header: {exc}") from None
    if expected_key is not None and header.key != expected_key:
        raise CorruptChunkError(f"chunk holds key {header.key}, expected {expected_key}")
    if header.raw_len != len(tokens) * layout.bytes_per_token:
        raise CorruptChunkError("header's raw length does not match its tokens and layout")
    object.__setattr__(header, "_size", size)
    return header


def decode_payload(header: ChunkHeader, body: Buffer) -> Buffer:
    """Verify the stored payload against the header and return the raw KV bytes."""
    mv = memoryview(body).cast("B")
    if mv.nbytes != header.payload_len:
        raise CorruptChunkError(f"payload is {mv.nbytes} bytes, header says {header.payload_len}")
    if xxhash.xxh3_128_hexdigest(mv) != header.payload_checksum:
        raise CorruptChunkError("payload checksum mismatch")
    if header.codec not in CODECS:
        raise CorruptChunkError(f"unknown codec {header.codec!r} in chunk header")
    raw = get_codec(header.codec).decode(mv, header.layout, len(header.tokens), header.raw_len)
    if memoryview(raw).nbytes != header.raw_len:
        raise CorruptChunkError("decoded payload has the wrong length")
    return raw


def decode(data: Buffer, expected_key: str | None = None) -> tuple[ChunkHeader, Buffer]:
    """Verify and decode a whole serialized chunk held in memory."""
    header = decode_header(data, expected_key)
    mv = memoryview(data).cast("B")
    return header, decode_payload(header, mv[header.header_size :])
