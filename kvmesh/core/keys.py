"""Chunk identity: KV layouts, chunk keys and chained prefix hashing.

Pure functions, no torch: the router imports this module to hash prompts exactly like the
engine does.

A chunk key names ``chunk_size`` tokens *and everything before them*: the prefix hash of
chunk ``i`` is ``sha256(hash[i-1] || le_u32(tokens of chunk i))``, and the chain starts
from a namespace hash (``sha256`` of canonical JSON) over the model id, the KV layout, the
chunk size, the cache salt and, for a LoRA request, the adapter's weights fingerprint.
Two replicas compute the same keys for the same model and tokens on any machine, in any
process, whatever ``PYTHONHASHSEED`` is; two different salts (or adapters, or an adapter
and the base model) never produce a shared key.

The chain is a cryptographic hash, so a key names its whole prefix: finding two prefixes
with one key is a SHA-256 collision. (Version ``kvm1`` chained xxh3-128, which is not
collision-resistant: one could craft two prompts that end in the same tokens under the same
key and be served the other's KV; chunks named ``kvm1-...`` are never read now.) SHA-256
because it is the cheapest cryptographic hash for one 128-256-token block here (SHA-NI):
~1.0 us a 128-token block against 1.2 for BLAKE3 and 1.3 for BLAKE2b through their Python
bindings, 0.27 for xxh3 (the router's block index keeps xxh3: see
:mod:`kvmesh.index.prefix`).

String form (used as file name and Redis key), documented and stable::

    kvm2-<namespace:16 hex>-r<shard>-<prefix hash:64 hex>[-p<tokens>]

The ``-p<tokens>`` suffix appears only on a partial (unfull) final chunk.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

KEY_VERSION = "kvm2"
HASH_BYTES = 32  # sha256: the prefix hash is its whole digest (64 hex in a key)
_DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}
_KEY_RE = re.compile(
    r"kvm2-(?P<ns>[0-9a-f]{16})-r(?P<shard>0|[1-9][0-9]*)-(?P<h>[0-9a-f]{64})(?:-p(?P<p>[1-9][0-9]*))?"
)
_EMPTY_TOKENS = np.zeros(0, dtype=np.uint32)


def dtype_name(dtype: object) -> str:
    """Canonical dtype name for a ``torch.dtype``, ``numpy.dtype`` or string."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_SIZES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; supported: {', '.join(sorted(_DTYPE_SIZES))}")
    return name


@dataclass(frozen=True)
class KVLayout:
    """Shape of one model's KV cache: ``[num_layers, kv_planes, tokens, num_kv_heads, head_size]``.

    ``kv_planes`` is 2 (keys, values) except for MLA, whose page holds one latent vector
    per token: ``KVLayout(L, 1, latent, dtype, kv_planes=1)``.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    kv_planes: int = 2

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        dtype: object = "bfloat16",
        kv_planes: int = 2,
    ):
        if kv_planes not in (1, 2):
            raise ValueError(f"KVLayout.kv_planes must be 1 (MLA latent) or 2 (K and V), got {kv_planes!r}")
        for field, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_size", head_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{field} must be a positive int, got {value!r}")
        object.__setattr__(self, "num_layers", num_layers)
        object.__setattr__(self, "num_kv_heads", num_kv_heads)
        object.__setattr__(self, "head_size", head_size)
        object.__setattr__(self, "dtype", dtype_name(dtype))
        object.__setattr__(self, "kv_planes", kv_planes)

    @property
    def itemsize(self) -> int:
        return _DTYPE_SIZES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.kv_planes * self.num_kv_heads * self.head_size * self.itemsize

    def shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.kv_planes, num_tokens, self.num_kv_heads, self.head_size)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": self.dtype,
        }
        if self.kv_planes != 2:  # absent for K/V layouts: their namespaces (keys) stay as they were
            d["kv_planes"] = self.kv_planes
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        return cls(
            int(d["num_layers"]),
            int(d["num_kv_heads"]),
            int(d["head_size"]),
            str(d["dtype"]),
            int(d.get("kv_planes", 2)),
        )


@dataclass(frozen=True)
class ChunkKey:
    """Identity of one chunk. Build keys with :class:`KeyBuilder`, not by hand."""

    namespace: str  # 16 hex: model id, layout, chunk size, salt
    shard: int
    prefix_hash: str  # 64 hex
    num_tokens: int  # tokens in this chunk (== chunk_size unless it is the final partial one)
    chunk_size: int

    @cached_property
    def text(self) -> str:
        base = f"{KEY_VERSION}-{self.namespace}-r{self.shard}-{self.prefix_hash}"
        return base if self.num_tokens == self.chunk_size else f"{base}-p{self.num_tokens}"

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, text: str, chunk_size: int) -> ChunkKey:
        """Inverse of ``str(key)``; raises ``ValueError`` on anything else.

        Only the canonical form parses (ASCII digits without leading zeros, a partial length
        below ``chunk_size``, nothing after the key — not even a newline): two different
        strings never name the same chunk, so a file or Redis key cannot alias another.
        """
        m = _KEY_RE.fullmatch(text)
        if m is None:
            raise ValueError(f"not a kvmesh chunk key: {text!r}")
        partial = m.group("p")
        if partial is not None and int(partial) >= chunk_size:
            raise ValueError(f"not a kvmesh chunk key for chunk_size {chunk_size}: {text!r}")
        return cls(
            namespace=m.group("ns"),
            shard=int(m.group("shard")),
            prefix_hash=m.group("h"),
            num_tokens=int(partial) if partial is not None else chunk_size,
            chunk_size=chunk_size,
        )


def as_token_array(tokens: object) -> np.ndarray:
    """Validate ``tokens`` and return them as a contiguous little-endian uint32 array.

    Accepts a sequence of ints, a 1-D integer numpy array or a 1-D integer torch tensor.
    Raises ``TypeError`` for anything else and ``ValueError`` for ids outside ``[0, 2**32)``.
    """
    if isinstance(tokens, (str, bytes, bytearray)):
        raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    if hasattr(tokens, "numpy") and hasattr(tokens, "dim"):  # torch.Tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()  # type: ignore[attr-defined]
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(
                f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}"
            )
        arr = tokens
    else:
        if not isinstance(tokens, Sequence):
            raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
        if len(tokens) == 0:
            return _EMPTY_TOKENS
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"tokens must be ints, found {type(t).__name__} ({t!r})")
        try:
            arr = np.asarray(tokens, dtype=np.int64)
        except OverflowError as exc:
            raise ValueError(f"token id out of range [0, 2**32): {exc}") from None
    # uint8/16/32 ids are in range by their type: no need to look at them (the router's case).
    in_range = arr.dtype.kind == "u" and arr.dtype.itemsize <= 4
    if arr.size and not in_range and (int(arr.min()) < 0 or int(arr.max()) >= 2**32):
        raise ValueError("token ids must lie in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype="<u4")


def sha256(data: bytes) -> bytes:
    """The chain's hash (see the module docstring)."""
    return hashlib.sha256(data).digest()


def chain_hashes(
    tokens: np.ndarray,
    block_size: int,
    root: bytes,
    partial: bool = False,
    digest: Callable[[bytes], bytes] = sha256,
) -> list[bytes]:
    """Chained hashes ``digest(parent || le_u32 block)``, one per ``block_size`` tokens (plus
    the tail if ``partial``). Chunk keys use :func:`sha256`; the router's block index passes
    its own (xxh3) ``digest``."""
    # One bytes copy of the whole array, then one-shot digests of (parent || block bytes):
    # the same value as updating a hasher with both, at a third of the cost per block.
    data = tokens.tobytes()
    step = block_size * tokens.itemsize
    full = len(tokens) // block_size * step
    out: list[bytes] = []
    prev = root
    for start in range(0, full, step):
        prev = digest(prev + data[start : start + step])
        out.append(prev)
    if partial and full < len(data):
        out.append(digest(prev + data[full:]))
    return out


def namespace_hash(
    model_id: str,
    layout: KVLayout | None,
    chunk_size: int,
    salt: str | None,
    adapter: str | None = None,
) -> bytes:
    """Root of the hash chain; differs for every model, layout, chunk size, salt and LoRA
    adapter (``adapter``: its weights' fingerprint, :func:`kvmesh.core.fingerprint.adapter_fingerprint`;
    ``None`` for the base model, whose namespaces stay what they were before adapters)."""
    fields: dict[str, Any] = {
        "v": KEY_VERSION,
        "model": model_id,
        "layout": layout.to_dict() if layout is not None else None,
        "chunk_size": chunk_size,
        "salt": salt,
    }
    if adapter is not None:
        fields["adapter"] = adapter
    return sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())


class KeyBuilder:
    """Cuts token sequences into chunks and names them. Cheap to build, safe to share."""

    def __init__(
        self,
        model_id: str,
        layout: KVLayout,
        chunk_size: int = 256,
        shard: int = 0,
        salt: str | None = None,
        save_unfull_chunk: bool = False,
        adapter: str | None = None,
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if shard < 0:
            raise ValueError(f"shard must be >= 0, got {shard}")
        self.model_id = model_id
        self.layout = layout
        self.chunk_size = chunk_size
        self.shard = shard
        self.salt = salt
        self.save_unfull_chunk = save_unfull_chunk
        self.adapter = adapter
        self._root = namespace_hash(model_id, layout, chunk_size, salt, adapter)
        self.namespace = self._root.hex()[:16]
        self._adapters: dict[str | None, KeyBuilder] = {}

    def for_adapter(self, adapter: str | None) -> KeyBuilder:
        """This builder's keys for requests with LoRA adapter ``adapter`` (its fingerprint;
        ``None``: the base model). Built once per adapter."""
        if adapter == self.adapter:
            return self
        found = self._adapters.get(adapter)
        if found is None:
            found = KeyBuilder(
                self.model_id,
                self.layout,
                self.chunk_size,
                self.shard,
                self.salt,
                self.save_unfull_chunk,
                adapter,
            )
            self._adapters[adapter] = found
        return found

    def chunk_bounds(self, num_tokens: int) -> list[tuple[int, int]]:
        """``(start, end)`` of every cacheable chunk of a ``num_tokens`` prompt."""
        cs = self.chunk_size
        bounds = [(s, s + cs) for s in range(0, num_tokens - cs + 1, cs)]
        if self.save_unfull_chunk and num_tokens % cs:
            bounds.append((num_tokens - num_tokens % cs, num_tokens))
        return bounds

    def keys(self, tokens: object) -> list[ChunkKey]:
        arr = as_token_array(tokens)
        return self.keys_for_array(arr)

    def keys_for_array(self, arr: np.ndarray) -> list[ChunkKey]:
        hashes = chain_hashes(arr, self.chunk_size, self._root, partial=self.save_unfull_chunk)
        bounds = self.chunk_bounds(len(arr))
        return [
            ChunkKey(self.namespace, self.shard, h.hex(), end - start, self.chunk_size)
            for h, (start, end) in zip(hashes, bounds, strict=True)
        ]

    def owns(self, key: ChunkKey) -> bool:
        """Whether ``key`` belongs to this builder's model, layout, chunk size, salt, adapter
        and shard."""
        return key.namespace == self.namespace and key.shard == self.shard

    def parse(self, text: str) -> ChunkKey:
        return ChunkKey.parse(text, self.chunk_size)


def keys_text(keys: Iterable[ChunkKey]) -> list[str]:
    return [k.text for k in keys]
