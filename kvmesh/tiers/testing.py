"""In-memory and fault-injecting tiers, shipped in the package for tests.

``mem://NAME`` stores serialized chunks in a process-wide dict (tiers opened with the same
name share it, like replicas sharing a Redis). ``faulty://NAME`` is the same store with
switches to make it fail: ``down`` (every call raises ``TierUnavailableError``),
``corrupt_next`` (the next ``put`` flips a payload byte) and ``latency_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.errors import CorruptChunkError, TierUnavailableError
from kvmesh.tiers.base import ChunkData, Feature, Into, TierOptions, count_rejected, register_tier

_STORES: dict[str, dict[str, bytes]] = {}
_STORES_LOCK = threading.Lock()


class MemoryTier:
    """A dict of serialized chunks. Verifies on read like every real tier."""

    features = Feature.NONE

    def __init__(self, store_name: str, options: TierOptions) -> None:
        self.name = options.name or "mem"
        self.metrics = options.metrics
        self.codec = options.codec
        self.chunk_format = options.chunk_format
        self._lock = threading.Lock()
        with _STORES_LOCK:
            self._data = _STORES.setdefault(store_name, {})

    def _check(self) -> None:
        """Hook for fault injection."""

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._check()
        with self._lock:
            return [k.text in self._data for k in keys]

    def get(self, keys: Sequence[ChunkKey], into: Into | None = None) -> list[ChunkData | None]:
        self._check()
        out: list[ChunkData | None] = []
        for k in keys:
            with self._lock:
                blob = self._data.get(k.text)
            if blob is None:
                self.metrics.inc("misses")
                out.append(None)
                continue
            try:
                header, raw = self.chunk_format.decode(blob, expected_key=k)
            except CorruptChunkError as exc:
                if count_rejected(self.metrics, exc):
                    with self._lock:
                        self._data.pop(k.text, None)
                out.append(None)
                continue
            self.metrics.inc("hits")
            self.metrics.inc("bytes_out", len(blob))
            out.append(ChunkData(k, header.layout, header.tokens, bytearray(raw), header.codec, len(blob)))
        return out

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[ChunkData]) -> list[bool]:
        self._check()
        for k, c in zip(keys, chunks, strict=True):
            blob = self._encode(k, c)
            with self._lock:
                self._data[k.text] = blob
            self.metrics.inc("stores")
            self.metrics.inc("bytes_in", len(blob))
        return [True] * len(keys)

    def _encode(self, key: ChunkKey, chunk: ChunkData) -> bytes:
        return self.chunk_format.encode_bytes(key, chunk.layout, chunk.tokens, chunk.data, self.codec)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        self._check()
        with self._lock:
            return sum(self._data.pop(k.text, None) is not None for k in keys)

    def clear(self) -> int:
        self._check()
        with self._lock:
            n = len(self._data)
            self._data.clear()
            return n

    def health(self) -> str:
        return "up"

    def close(self) -> None:
        pass

    def raw_store(self) -> dict[str, bytes]:
        """The underlying dict, for tests that tamper with stored bytes."""
        return self._data


class FaultyTier(MemoryTier):
    """A :class:`MemoryTier` that fails on demand."""

    def __init__(self, store_name: str, options: TierOptions) -> None:
        super().__init__(store_name, options)
        self.down = False
        self.corrupt_next = False
        self.latency_s = 0.0
        # Set: every call waits until it is set, past any deadline (a tier that hangs: a stat
        # on a hung network filesystem, a wedged client library).
        self.hold: threading.Event | None = None
        self.calls = 0

    def _check(self) -> None:
        self.calls += 1
        if self.hold is not None:
            self.hold.wait()
        if self.latency_s:
            time.sleep(self.latency_s)
        if self.down:
            self.metrics.set("up", 0)
            raise TierUnavailableError(f"tier {self.name} is down (fault injected)")
        self.metrics.set("up", 1)

    def _encode(self, key: ChunkKey, chunk: ChunkData) -> bytes:
        blob = super()._encode(key, chunk)
        if self.corrupt_next:
            self.corrupt_next = False
            flipped = bytearray(blob)
            flipped[-1] ^= 0xFF
            return bytes(flipped)
        return blob

    def health(self) -> str:
        return "down" if self.down else "up"


@register_tier("mem")
def _open_mem(url: str, options: TierOptions) -> MemoryTier:
    return MemoryTier(urlsplit(url).netloc or "default", options)


@register_tier("faulty")
def _open_faulty(url: str, options: TierOptions) -> FaultyTier:
    return FaultyTier(urlsplit(url).netloc or "default", options)


def reset_memory_stores() -> None:
    """Forget every ``mem://`` / ``faulty://`` store (call between tests)."""
    with _STORES_LOCK:
        _STORES.clear()


def random_chunks(
    n: int, layout: KVLayout, tokens: int = 32, seed: int = 0
) -> tuple[list[ChunkKey], list[ChunkData]]:
    """``n`` chunks of ``tokens`` tokens with random KV (seeded) and their keys, for tier tests."""
    import numpy as np
    import torch

    from kvmesh.core.keys import KeyBuilder
    from kvmesh.core.memory import torch_dtype

    toks = np.arange(seed * 100000, seed * 100000 + n * tokens, dtype=np.uint32)
    keys = KeyBuilder("m", layout, tokens).keys(toks)
    gen = torch.Generator().manual_seed(seed)
    chunks = []
    for i, k in enumerate(keys):
        kv = torch.randn(layout.shape(tokens), generator=gen).to(torch_dtype(layout.dtype))
        raw = kv.view(torch.uint8).reshape(-1).numpy().copy().data
        chunks.append(ChunkData(k, layout, toks[i * tokens : (i + 1) * tokens], raw))
    return keys, chunks
