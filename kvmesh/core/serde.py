"""Chunk wire format: a versioned header, authenticated or checksummed, then a payload.

Every byte that leaves the process (disk, Redis, shared filesystem, S3, Mooncake) uses this
format, and nothing read back is trusted before its tags pass and its sizes are bounded. No
pickle. Layout (all integers little-endian)::

    offset   size  field
    0        4     magic  b"KVMC"
    4        2     format version (2)
    6        2     mode: 0 checksums (no fleet key), 1 keyed MAC, 2 AEAD (encrypt_at_rest)
    8        4     header_len  (H): bytes of the JSON header
    12       8     payload_len (P): bytes of the stored payload
    20       H     JSON header: key, layout, codec, raw_len, n_tokens, tokens, and the
                   payload's check (mode 0 ``checksum``: xxh3-128 hex; mode 1 ``mac``: hex
                   AES-256-GMAC tag of the payload; mode 2: none, the payload is sealed)
    20+H     T     header tag over bytes [0, 20+H): mode 0 xxh3-64 (T = 8); modes 1 and 2
                   the fleet key's 8-byte key id + keyed BLAKE3 (T = 40)
    20+H+T   P     payload: the KV ``[layers, 2, tokens, kv_heads, head_size]``, encoded by
                   the codec; mode 2: sealed, key id || nonce || AES-256-GCM ciphertext || tag

**With a fleet key** (:mod:`kvmesh.core.fleetkey`) the header tag is a keyed BLAKE3 MAC,
checked before the JSON is parsed, and the payload is covered by an AES-256-GMAC tag that
the header carries (mode 1: ~10 GB/s here against ~12 for xxh3 and ~4.6 for keyed BLAKE3,
so authenticating costs the read next to nothing) or by AES-256-GCM whose associated data
is the header tag (mode 2), checked before the codec runs: a chunk written without the key
(or with a key not listed) is an :class:`~kvmesh.errors.UnauthenticatedChunkError`, never
decoded. In mode 2 the token ids are sealed too (their own GCM, inside the authenticated
header), so the stored bytes hold neither prompts nor KV; the key (a hash of the prefix),
layout, codec and sizes stay readable. The MAC replaces the xxh3 payload checksum rather
than adding to it, and the GCM tag replaces the MAC. A keyed reader refuses unkeyed chunks;
an unkeyed reader cannot check keyed ones and leaves them alone (``discard=False``).

**Bounds before allocation.** After the tag and before anything is allocated, the header's
claims are checked: tokens equal the key's (and so at most ``chunk_size``), layout equal to
the engine's (:attr:`ChunkFormat.layout`), ``raw_len`` equal to what they imply, and the
stored payload at most what the codec can produce for them (``Codec.max_encoded``). Codecs
decode within those bounds (see :mod:`kvmesh.core.codecs.base`).

Version 1 (``kvm1`` keys, xxh3 chain) chunks are misses: their keys are never asked for, and
a version-1 file found under a version-2 name is corrupt.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvmesh.core import fleetkey
from kvmesh.core.codecs.base import (
    CODEC_ALIASES,
    CODECS,
    REFUSED_CODECS,
    Buffer,
    Codec,
    RawCodec,
    ZstdPlaneCodec,
    check_codec_name,
    empty_buffer,
    get_codec,
    reused_buffer,
    zstd_bound,
)
from kvmesh.core.fleetkey import CHUNK_AEAD, CHUNK_GMAC, CHUNK_MAC, FleetKey
from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.errors import ConfigError, CorruptChunkError, UnauthenticatedChunkError

__all__ = [
    "CODECS",
    "CODEC_ALIASES",
    "PLAIN",
    "REFUSED_CODECS",
    "Buffer",
    "ChunkFormat",
    "ChunkHeader",
    "Codec",
    "Mode",
    "RawCodec",
    "ZstdPlaneCodec",
    "check_codec_name",
    "decode",
    "decode_header",
    "decode_payload",
    "empty_buffer",
    "encode",
    "encode_bytes",
    "get_codec",
    "header_length",
    "reused_buffer",
]

MAGIC = b"KVMC"
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<4sHHIQ")
PREFIX_SIZE = _PREFIX.size  # 20
HEADER_CHECKSUM_SIZE = 8  # the mode-0 header tag
MAX_HEADER_LEN = 1 << 20  # a header is a few KiB; anything larger is corruption
_TOKENS_AAD = b"kvmesh chunk tokens"
ENCRYPT_NEEDS_KEY = (
    "encrypt_at_rest: true needs a fleet key: set fleet_key_file (or KVMESH_FLEET_KEY_FILE) "
    "to a key file (`kvmesh config fleet-key --out FILE` makes one), or set encrypt_at_rest: false"
)


class Mode(enum.IntEnum):
    CHECKSUM = 0  # xxh3: finds accidents, not forgeries
    MAC = 1  # keyed BLAKE3 over the header, AES-GMAC over the payload
    AEAD = 2  # keyed BLAKE3 over the header, AES-256-GCM over tokens and payload


_TAG_SIZE = {Mode.CHECKSUM: HEADER_CHECKSUM_SIZE, Mode.MAC: fleetkey.TAG_BYTES, Mode.AEAD: fleetkey.TAG_BYTES}


@dataclass(frozen=True)
class ChunkHeader:
    key: str
    layout: KVLayout
    shape: tuple[int, ...]
    codec: str
    raw_len: int
    payload_len: int
    payload_checksum: str  # mode 0: xxh3-128 hex; mode 1: the payload's MAC tag (hex); mode 2: ""
    tokens: np.ndarray
    mode: Mode = Mode.CHECKSUM
    header_size: int = 0  # bytes before the payload
    tag: bytes = field(default=b"", repr=False)  # the header tag (mode 2: the payload's AAD)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


class ChunkFormat:
    """How chunks are written and what a read accepts: the fleet key (``None``: checksums
    only), whether to encrypt, and the layout every chunk must have (``None``: any; the
    engine always sets it, so a header cannot make a reader allocate more than its chunks).
    Immutable and thread-safe."""

    def __init__(
        self, fleet_key: FleetKey | None = None, encrypt: bool = False, layout: KVLayout | None = None
    ) -> None:
        if encrypt and fleet_key is None:
            raise ConfigError(ENCRYPT_NEEDS_KEY)
        self.fleet_key = fleet_key
        self.encrypt = encrypt
        self.layout = layout
        self.mode = Mode.CHECKSUM if fleet_key is None else Mode.AEAD if encrypt else Mode.MAC

    def __repr__(self) -> str:
        return f"ChunkFormat(mode={self.mode.name}, layout={self.layout})"

    def with_layout(self, layout: KVLayout | None) -> ChunkFormat:
        return ChunkFormat(self.fleet_key, self.encrypt, layout)

    def max_stored(self, chunk_size: int) -> int | None:
        """An upper bound on one stored chunk of this format's layout (header and payload, of
        any codec: a store is shared with replicas that may write another), for a reader to
        bound what it takes from a store before verifying it; ``None`` without a layout.

        Computed without making a codec (a zstd codec warms numba kernels, cachegen imports
        numba: seconds of a replica's start): four bytes a value (or the dtype's size: no
        codec stores a value in more) over the chunk padded by a cachegen group, plus 16 bytes
        of side information a value of one token and 64 KiB; a unit test holds it above every
        codec's own ``max_encoded``, the most a reader accepts."""
        if self.layout is None:
            return None
        item = self.layout.itemsize
        values = self.layout.bytes_per_token // item  # a token's values, K and V
        payload = zstd_bound(max(4, item) * values * (chunk_size + 16)) + 16 * values + (64 << 10)
        tags = 2 * fleetkey.TAG_BYTES + fleetkey.AEAD_OVERHEAD + HEADER_CHECKSUM_SIZE
        return payload + PREFIX_SIZE + MAX_HEADER_LEN + tags

    # -- writing -------------------------------------------------------------------------------
    def encode(
        self, key: ChunkKey | str, layout: KVLayout, tokens: np.ndarray, payload: Buffer, codec: str = "raw"
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
        tok = np.ascontiguousarray(tokens, dtype="<u4").tobytes()
        meta: dict[str, Any] = {
            "key": str(key),
            "layout": layout.to_dict(),
            "codec": cod.name,
            "raw_len": raw.nbytes,
            "n_tokens": n_tokens,
        }
        fk, mode = self.fleet_key, self.mode
        body_len = memoryview(body).nbytes
        if fk is None:
            meta["tokens"] = base64.b64encode(tok).decode()
            meta["checksum"] = xxhash.xxh3_128_hexdigest(body)
        elif mode == Mode.MAC:
            meta["tokens"] = base64.b64encode(tok).decode()
            meta["mac"] = fk.gmac(CHUNK_GMAC, body).hex()
        else:
            meta["tokens"] = base64.b64encode(fk.seal(CHUNK_AEAD, tok, _TOKENS_AAD)).decode()
            body_len += fleetkey.AEAD_OVERHEAD
        hjson = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
        head = _PREFIX.pack(MAGIC, FORMAT_VERSION, mode, len(hjson), body_len) + hjson
        if fk is None:
            tag = struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
        else:
            tag = fk.mac(CHUNK_MAC, b"header", head)
        if fk is not None and mode == Mode.AEAD:
            sealed = reused_buffer(body_len)
            fk.seal_into(CHUNK_AEAD, body, sealed, aad=tag)
            body = sealed
        return head + tag, body

    def encode_bytes(
        self, key: ChunkKey | str, layout: KVLayout, tokens: np.ndarray, payload: Buffer, codec: str = "raw"
    ) -> bytes:
        head, body = self.encode(key, layout, tokens, payload, codec)
        return head + bytes(body)

    # -- reading -------------------------------------------------------------------------------
    def header_length(self, prefix: Buffer) -> int:
        """Total header size (prefix + JSON + tag) from the first 20 bytes; refuses a
        chunk this reader cannot accept before any more of it is read."""
        if len(prefix) < PREFIX_SIZE:
            raise CorruptChunkError(f"chunk shorter than its {PREFIX_SIZE}-byte prefix")
        magic, version, mode, hlen, _plen = _PREFIX.unpack_from(prefix)
        if magic != MAGIC:
            raise CorruptChunkError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
        if version != FORMAT_VERSION:
            raise CorruptChunkError(
                f"chunk format version {version}, this kvmesh reads {FORMAT_VERSION} "
                "(chunks of older versions are misses)"
            )
        if mode not in _TAG_SIZE:
            raise CorruptChunkError(f"unknown chunk mode {mode}")
        if self.fleet_key is not None and mode == Mode.CHECKSUM:
            raise UnauthenticatedChunkError("chunk carries no fleet-key MAC (written without the key)")
        if self.fleet_key is None and mode != Mode.CHECKSUM:
            raise UnauthenticatedChunkError(
                "chunk is authenticated with a fleet key and this process has none (set fleet_key_file)",
                discard=False,
            )
        if hlen > MAX_HEADER_LEN:
            raise CorruptChunkError(f"header length {hlen} exceeds {MAX_HEADER_LEN}")
        return int(PREFIX_SIZE + hlen + _TAG_SIZE[Mode(mode)])

    def decode_header(self, data: Buffer, expected_key: ChunkKey | str | None = None) -> ChunkHeader:
        """Verify and parse a header (``data`` may hold more bytes after it). The tag is
        checked before the JSON is parsed; the claims are bounded before anything is
        allocated. With a :class:`ChunkKey` the tokens must be the key's."""
        mv = memoryview(data).cast("B")
        size = self.header_length(mv[:PREFIX_SIZE])
        if mv.nbytes < size:
            raise CorruptChunkError(f"chunk truncated inside its header ({mv.nbytes} < {size} bytes)")
        _magic, _v, mode, hlen, plen = _PREFIX.unpack_from(mv)
        head, tag = mv[: PREFIX_SIZE + hlen], bytes(mv[PREFIX_SIZE + hlen : size])
        fk = self.fleet_key
        if fk is None:
            if xxhash.xxh3_64_intdigest(head) != struct.unpack("<Q", tag)[0]:
                raise CorruptChunkError("header checksum mismatch")
        elif not fk.verify(CHUNK_MAC, tag, b"header", head):
            raise UnauthenticatedChunkError("chunk header's fleet-key MAC does not verify")
        try:
            meta = json.loads(bytes(mv[PREFIX_SIZE : PREFIX_SIZE + hlen]))
            if not isinstance(meta, dict):
                raise TypeError("header is not a JSON object")
            layout = KVLayout.from_dict(meta["layout"])
            n_tokens, raw_len, codec = _int(meta["n_tokens"]), _int(meta["raw_len"]), str(meta["codec"])
            token_bytes = base64.b64decode(str(meta["tokens"]), validate=True)
            check = str(meta.get("mac" if mode == Mode.MAC else "checksum", ""))
            key = str(meta["key"])
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            raise CorruptChunkError(f"unreadable chunk header: {exc}") from None
        want = expected_key.text if isinstance(expected_key, ChunkKey) else expected_key
        if want is not None and key != want:
            raise CorruptChunkError(f"chunk holds key {key}, expected {want}")
        self._bound(expected_key, layout, n_tokens, raw_len, codec, plen, Mode(mode))
        tokens = self._tokens(token_bytes, n_tokens, Mode(mode))
        return ChunkHeader(
            key=key,
            layout=layout,
            shape=layout.shape(n_tokens),
            codec=codec,
            raw_len=raw_len,
            payload_len=int(plen),
            payload_checksum=check,
            tokens=tokens,
            mode=Mode(mode),
            header_size=size,
            tag=tag,
        )

    def _bound(
        self,
        key: ChunkKey | str | None,
        layout: KVLayout,
        n_tokens: int,
        raw_len: int,
        codec: str,
        plen: int,
        mode: Mode,
    ) -> None:
        if isinstance(key, ChunkKey) and n_tokens != key.num_tokens:
            raise CorruptChunkError(f"header claims {n_tokens} tokens, key {key} names {key.num_tokens}")
        if self.layout is not None and layout != self.layout:
            raise CorruptChunkError(f"chunk layout {layout} is not this engine's {self.layout}")
        if n_tokens < 0 or raw_len != n_tokens * layout.bytes_per_token:
            raise CorruptChunkError("header's raw length does not match its tokens and layout")
        if codec not in CODECS:
            raise CorruptChunkError(f"unknown codec {codec!r} in chunk header")
        cod = get_codec(codec)
        extra = fleetkey.AEAD_OVERHEAD if mode == Mode.AEAD else 0
        limit = cod.max_encoded(layout, n_tokens) + extra
        if plen > limit or (isinstance(cod, RawCodec) and plen != limit):
            raise CorruptChunkError(f"stored payload of {plen} bytes; {codec} of this chunk makes <= {limit}")

    def _tokens(self, data: bytes, n_tokens: int, mode: Mode) -> np.ndarray:
        if mode == Mode.AEAD:
            opened = self._key().open(CHUNK_AEAD, data, _TOKENS_AAD)
            if opened is None:
                raise UnauthenticatedChunkError("chunk's sealed token ids do not open")
            data = opened
        if len(data) != 4 * n_tokens:
            raise CorruptChunkError(f"header holds {len(data) // 4} token ids, claims {n_tokens}")
        return np.frombuffer(data, dtype="<u4")

    def _key(self) -> FleetKey:
        if self.fleet_key is None:  # header_length refuses keyed chunks first; a header made elsewhere
            raise UnauthenticatedChunkError("a keyed chunk and no fleet key to check it", discard=False)
        return self.fleet_key

    def decode_payload(
        self, header: ChunkHeader, body: Buffer, into: Callable[[int], memoryview | None] | None = None
    ) -> Buffer:
        """Verify the stored payload against the header (tag before codec) and return the
        raw KV bytes: ``body`` itself for a raw payload of modes 0 and 1. In mode 2 a raw
        payload is decrypted into ``into(raw_len)`` when it offers a buffer (the tiers'
        ``Into``: a pool slot), else into fresh memory."""
        mv = memoryview(body).cast("B")
        if mv.nbytes != header.payload_len:
            raise CorruptChunkError(f"payload is {mv.nbytes} bytes, header says {header.payload_len}")
        if header.mode == Mode.CHECKSUM:
            if self.fleet_key is not None:
                raise UnauthenticatedChunkError("chunk carries no fleet-key MAC (written without the key)")
            if xxhash.xxh3_128_hexdigest(mv) != header.payload_checksum:
                raise CorruptChunkError("payload checksum mismatch")
        elif header.mode == Mode.MAC:
            if not self._key().verify_gmac(CHUNK_GMAC, _unhex(header.payload_checksum), mv):
                raise UnauthenticatedChunkError("chunk payload's fleet-key MAC does not verify")
        else:
            fk = self._key()
            n = mv.nbytes - fleetkey.AEAD_OVERHEAD
            out = into(n) if into is not None and header.codec == "raw" else None
            plain = out if out is not None else reused_buffer(n)
            if not fk.open_into(CHUNK_AEAD, mv, plain, aad=header.tag):
                raise UnauthenticatedChunkError("chunk payload does not decrypt under the fleet key")
            mv = memoryview(plain).cast("B")
            if header.codec == "raw":
                return plain
        if header.codec == "raw":
            return body
        raw = get_codec(header.codec).decode(mv, header.layout, header.n_tokens, header.raw_len)
        if memoryview(raw).nbytes != header.raw_len:
            raise CorruptChunkError("decoded payload has the wrong length")
        return raw

    def decode(self, data: Buffer, expected_key: ChunkKey | str | None = None) -> tuple[ChunkHeader, Buffer]:
        """Verify and decode a whole serialized chunk held in memory."""
        header = self.decode_header(data, expected_key)
        mv = memoryview(data).cast("B")
        return header, self.decode_payload(header, mv[header.header_size :])


def _int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {v!r}")
    return v


def _unhex(text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        return b""


# The format of processes without a fleet key, and of the PD transfer path (which
# authenticates its connections instead, see kvmesh.transport).
PLAIN = ChunkFormat()
encode = PLAIN.encode
encode_bytes = PLAIN.encode_bytes
header_length = PLAIN.header_length
decode_header = PLAIN.decode_header
decode_payload = PLAIN.decode_payload
decode = PLAIN.decode
