"""The ``Codec`` seam, the ``raw`` and ``zstd`` codecs, and the codec registry.

A codec turns a chunk's raw KV bytes into its stored payload and back (see
:mod:`kvmesh.core.serde` for the envelope around it). Decoding never trusts a size the
payload states: every codec is bounded by what the chunk's layout and token count imply,
checked before anything is allocated (:meth:`Codec.max_encoded` bounds the payload,
:func:`zstd_decompress` the output of every zstd frame, and no codec allocates more than a
small multiple of the chunk's raw size).

Codecs:

* ``raw``  — the bytes as they are.
* ``zstd`` — zstd over byte planes: every element's bytes are split into planes (high and low
  bytes of 16-bit values apart) before compressing, which compresses KV far better than
  plain zstd because exponent bytes repeat and mantissa bytes do not. The planes are made
  and undone by compiled kernels (:mod:`kvmesh.core.codecs.planes`); level 1 by default:
  on KV it compresses as well as level 3 or better, at twice the speed or more.
* ``safetensors`` — the KV as a safetensors blob (:mod:`kvmesh.core.codecs.safetensors_codec`).
* ``cachegen`` — lossy, opt-in: CacheGen-style delta quantisation + entropy coding
  (:mod:`kvmesh.core.codecs.cachegen`).

LMCache's names are accepted: ``naive`` / ``torch`` = raw, ``safetensor`` = safetensors;
``kivi`` (a stub in LMCache) is refused with a message.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Protocol

import numpy as np
import zstandard

from kvmesh.core.keys import KVLayout
from kvmesh.errors import ConfigError, CorruptChunkError

Buffer = bytes | bytearray | memoryview


def empty_buffer(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` whose contents are undefined.

    ``bytearray(n)`` zero-fills every byte first, which here costs more than reading the
    same bytes from disk; this buffer's pages are only touched by whoever fills it.
    """
    return np.empty(nbytes, dtype=np.uint8).data


class _Recycler:
    """Large buffers that go back to a free list when their last view dies, up to ``limit``
    idle bytes, so the next one of a similar size needs no fresh pages. A chunk of a large
    model is 32 MiB: glibc serves that from a fresh ``mmap`` every time, and faulting the
    pages in cost more than decrypting the bytes (a copy into fresh memory runs at 1-2 GB/s
    here, into touched memory at 12-17). Thread-safe."""

    MIN_BYTES = 1 << 20  # below this malloc reuses memory by itself

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> memoryview:
        if nbytes < self.MIN_BYTES:
            return empty_buffer(nbytes)
        with self._lock:
            fits = [b for b in self._free if nbytes <= b.size <= 2 * nbytes]
            base = min(fits, key=lambda b: b.size) if fits else None
            if base is not None:
                self._free.remove(base)
        if base is None:
            base = np.empty(nbytes, dtype=np.uint8)
        view = base[:nbytes]
        weakref.finalize(view, self._put, base)  # the view dies with the caller's last reference
        return view.data

    def _put(self, base: np.ndarray) -> None:
        with self._lock:
            if sum(b.size for b in self._free) + base.size <= self.limit:
                self._free.append(base)


# 80 MiB: a Redis transaction's worth of sealed chunks (64 MiB of payload, each sealed chunk
# a few bytes over its 16 or 32 MiB, so a 64 MiB limit kept three of four) with room to spare.
_RECYCLER = _Recycler(limit=80 << 20)


def reused_buffer(nbytes: int) -> memoryview:
    """Like :func:`empty_buffer`, from memory recently given back (see :class:`_Recycler`)."""
    return _RECYCLER.get(nbytes)


def zstd_bound(nbytes: int) -> int:
    """The most bytes zstd's output can take for ``nbytes`` of input (``ZSTD_COMPRESSBOUND``,
    plus room for a frame header)."""
    return nbytes + (nbytes >> 8) + ((128 << 10) - nbytes >> 11 if nbytes < 128 << 10 else 0) + 64


def zstd_decompress(data: Buffer, size: int, what: str = "zstd payload") -> bytes:
    """One zstd frame that must decode to exactly ``size`` bytes.

    The frame's declared content size is checked against ``size`` *before* decompressing:
    python-zstandard's ``decompress`` allocates whatever a frame declares and ignores
    ``max_output_size`` when a size is declared (a 25 KB frame declaring 768 MiB cost 768 MiB
    and 5 s here). Our writers always declare the size, so a frame without one is refused
    too (it would decode through a window buffer the frame also chooses)."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise CorruptChunkError(f"{what} is not a zstd frame: {exc}") from None
    if declared != size:
        said = "no content size" if declared < 0 else f"{declared} bytes"
        raise CorruptChunkError(f"{what} declares {said}; the chunk's layout and tokens make {size}")
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptChunkError(f"{what} does not decompress: {exc}") from None
    if len(out) != size:
        raise CorruptChunkError(f"{what} decoded to {len(out)} bytes, expected {size}")
    return out


class Codec(Protocol):
    """Bytes in, bytes out, for ``n_tokens`` tokens of KV in ``layout``.

    ``decode`` raises :class:`CorruptChunkError` for input it cannot decode, and allocates no
    more than a small multiple of ``raw_len`` whatever the input says; a lossless codec
    (``lossless``) gives back exactly the bytes it was given. ``max_encoded`` bounds what
    ``encode`` can produce: a stored payload larger than that is refused unread."""

    name: str
    lossless: bool

    def encode(self, data: memoryview, layout: KVLayout, n_tokens: int) -> Buffer: ...

    def decode(self, data: memoryview, layout: KVLayout, n_tokens: int, raw_len: int) -> Buffer: ...

    def max_encoded(self, layout: KVLayout, n_tokens: int) -> int: ...


class RawCodec:
    name = "raw"
    lossless = True

    def encode(self, data: memoryview, layout: KVLayout, n_tokens: int) -> Buffer:
        return data

    def decode(self, data: memoryview, layout: KVLayout, n_tokens: int, raw_len: int) -> Buffer:
        return data

    def max_encoded(self, layout: KVLayout, n_tokens: int) -> int:
        return n_tokens * layout.bytes_per_token


class ZstdPlaneCodec:
    """zstd over byte planes (see module docstring)."""

    name = "zstd"
    lossless = True

    def __init__(self, level: int = 1) -> None:
        from kvmesh.core.codecs import planes  # numba: loaded when a zstd codec is made

        self.level = level
        self._planes = planes
        planes.warm_up()

    def encode(self, data: memoryview, layout: KVLayout, n_tokens: int) -> Buffer:
        itemsize = layout.itemsize
        arr = np.frombuffer(data, dtype=np.uint8)
        if itemsize > 1 and arr.size % itemsize == 0:
            arr = self._planes.split_planes(arr, itemsize)
        # write_content_size (the default) declares the size a reader checks before decoding
        return zstandard.ZstdCompressor(level=self.level).compress(arr.data)

    def decode(self, data: memoryview, layout: KVLayout, n_tokens: int, raw_len: int) -> Buffer:
        itemsize = layout.itemsize
        out = zstd_decompress(data, raw_len)
        if itemsize > 1 and raw_len % itemsize == 0:
            return self._planes.merge_planes(np.frombuffer(out, dtype=np.uint8), itemsize).data
        return out

    def max_encoded(self, layout: KVLayout, n_tokens: int) -> int:
        return zstd_bound(n_tokens * layout.bytes_per_token)


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
