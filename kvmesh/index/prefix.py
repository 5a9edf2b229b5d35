"""The block index's pure parts: match results and its own chained block hashes.

Index keys are ``xxh3_128(parent key || le_u32 tokens [|| extra keys])``, chained from a root
over the block size and LoRA name (see :func:`kvmesh.core.keys.chain_hashes`), so the router
and every replica agree on them whatever the engine's hash algorithm or ``PYTHONHASHSEED``.

xxh3, not the chunk keys' SHA-256: an index key only steers routing (a crafted collision
sends a request to a replica that lacks the prefix, which then computes it); the KV served
is always found under the engine's SHA-256 chunk keys. Hashing is the router's largest
index cost, and per 16-token block xxh3 costs ~0.2 us against ~0.9 us for SHA-256 or
BLAKE2b and ~1.1 us for BLAKE3 here (a 32k-token prompt: 0.56 against 1.1-2.1 ms).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import xxhash

from kvmesh.core.keys import as_token_array, chain_hashes
from kvmesh.index.media import AnyMedium, rank

Range = tuple[int, int, AnyMedium]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """One replica's match: contiguous token ranges ``(start, end, medium)`` from token 0."""

    ranges: tuple[Range, ...]

    @property
    def tokens(self) -> int:
        """Matched prefix length in tokens."""
        return self.ranges[-1][1] if self.ranges else 0

    def tokens_by_medium(self) -> dict[AnyMedium, int]:
        out: dict[AnyMedium, int] = {}
        for start, end, med in self.ranges:
            out[med] = out.get(med, 0) + end - start
        return out

    def block_mediums(self, block_size: int) -> list[AnyMedium]:
        """Medium of each whole ``block_size`` block of the match (a split block gets its worst)."""
        out: list[AnyMedium] = []
        ends = [r[1] for r in self.ranges]
        for start in range(0, self.tokens - block_size + 1, block_size):
            first = bisect.bisect_right(ends, start)
            last = bisect.bisect_left(ends, start + block_size)
            out.append(min((r[2] for r in self.ranges[first : last + 1]), key=rank))
        return out


def combine_ranges(parts: Sequence[Sequence[Range]]) -> tuple[Range, ...]:
    """Merge per-block-size matches: the union of coverage, best medium on every token."""
    parts = [p for p in parts if p]
    if len(parts) == 1:
        return tuple(parts[0])
    bounds = sorted({b for p in parts for r in p for b in r[:2]})
    part_ends = [[r[1] for r in p] for p in parts]
    out: list[Range] = []
    for a, b in itertools.pairwise(bounds):
        best: AnyMedium | None = None
        for p, ends in zip(parts, part_ends, strict=True):
            if a < ends[-1]:
                med = p[bisect.bisect_right(ends, a)][2]
                best = med if best is None or rank(med) > rank(best) else best
        if best is None:
            break  # every part ends before a: coverage is contiguous from 0, so we are done
        if out and out[-1][2] == best:
            out[-1] = (out[-1][0], b, best)
        else:
            out.append((a, b, best))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def chain_root(block_size: int, lora_name: str | None) -> bytes:
    """Root of a chain: blocks of different sizes or adapters never share a key."""
    seed = f"kvmesh-index-v1|{block_size}|{'' if lora_name is None else 'lora:' + lora_name}"
    return xxhash.xxh3_128(seed.encode()).digest()


def extra_bytes(keys: tuple[Any, ...] | None) -> bytes | None:
    """Canonical bytes of one block's extra hash keys (msgpack: stable across processes)."""
    return msgspec.msgpack.encode(keys) if keys else None


def chain(
    tokens: np.ndarray, block_size: int, prev: bytes, extras: Sequence[bytes | None] | None
) -> list[bytes]:
    """Keys of consecutive full blocks after ``prev``; ``extras`` (one per block) if any."""
    if extras is None:
        return chain_hashes(tokens, block_size, prev, digest=xxhash.xxh3_128_digest)
    data = tokens.tobytes()
    step = block_size * tokens.itemsize
    digest = xxhash.xxh3_128_digest
    out: list[bytes] = []
    for i, extra in enumerate(extras):
        block = prev + data[i * step : (i + 1) * step]
        prev = digest(block if extra is None else block + b"\x00extra\x00" + extra)
        out.append(prev)
    return out


def query_chain(
    tokens: np.ndarray, block_size: int, lora_name: str | None, cache_salt: str | None
) -> list[bytes]:
    """Keys of a prompt's full blocks, as the engine's events would produce them."""
    root = chain_root(block_size, lora_name)
    if not cache_salt or len(tokens) < block_size:
        return chain_hashes(tokens, block_size, root, digest=xxhash.xxh3_128_digest)
    extras: list[bytes | None] = [None] * (len(tokens) // block_size)
    extras[0] = extra_bytes((cache_salt,))  # vLLM puts the salt into the first block's keys only
    return chain(tokens, block_size, root, extras)


class PromptKeys:
    """A prompt's block keys, hashed once per block size and shared by every index call.

    The router asks the index for a request's matches and then adds a speculative entry for
    the replica it picked: both need the same keys, and hashing is most of their work. Pass
    a ``PromptKeys`` instead of the tokens to :meth:`BlockIndex.match` and
    :meth:`BlockIndex.add_speculative` and each block size is hashed once per request.
    Tokens are validated when it is made. Owned by one request: not for sharing between
    threads (nothing breaks, a block size may be hashed twice).
    """

    __slots__ = ("_chains", "cache_salt", "lora_name", "tokens")

    def __init__(self, tokens: object, lora_name: str | None = None, cache_salt: str | None = None) -> None:
        self.tokens = query_tokens(tokens)
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self._chains: dict[int, tuple[bytes, ...]] = {}

    @classmethod
    def of(cls, tokens: object, lora_name: str | None = None, cache_salt: str | None = None) -> PromptKeys:
        """``tokens`` itself if it is a ``PromptKeys`` for the same LoRA and salt, else a new one.

        ``None`` means "not given" for a ``PromptKeys``: it keeps its own LoRA name and salt.
        """
        if not isinstance(tokens, PromptKeys):
            return cls(tokens, lora_name, cache_salt)
        if (lora_name is not None and lora_name != tokens.lora_name) or (
            cache_salt is not None and cache_salt != tokens.cache_salt
        ):
            raise ValueError(
                f"the PromptKeys were made for lora_name={tokens.lora_name!r}, "
                f"cache_salt={tokens.cache_salt!r}, not {lora_name!r}, {cache_salt!r}"
            )
        return tokens

    @classmethod
    def precomputed(cls, num_tokens: int, chains: dict[int, tuple[bytes, ...]]) -> PromptKeys:
        """A prompt known only by its length and its block keys per block size (for callers
        that name blocks themselves, see :meth:`BlockIndex.store_keys`); other block sizes
        match nothing."""
        self = cls.__new__(cls)
        # A zero-copy stand-in of the right length: scorers need len(), never the values.
        self.tokens = np.broadcast_to(np.uint32(0), (num_tokens,))
        self.lora_name = None
        self.cache_salt = None
        self._chains = dict(chains)
        return self

    def __len__(self) -> int:
        return len(self.tokens)

    def chain(self, block_size: int) -> tuple[bytes, ...]:
        """Keys of the prompt's full ``block_size`` blocks (see :func:`query_chain`)."""
        keys = self._chains.get(block_size)
        if keys is None:
            if self.tokens.strides == (0,):  # precomputed(): no tokens to hash, so no keys
                return ()
            keys = self._chains[block_size] = _RECENT.chain(
                self.tokens, block_size, self.lora_name, self.cache_salt
            )
        return keys


class _RecentChains:
    """The block keys of recent long prompts, by their first block's key, to extend.

    Prompts that share a beginning (a system prompt, a growing chat, an agent's transcript)
    are what a prefix router sees most, and hashing is its biggest index cost (~0.5 ms at
    32k tokens). Key ``i`` depends only on the first ``(i + 1) * block_size`` tokens and the
    chain's root (block size, LoRA, salt, all in the first key), so the keys of a common
    prefix with the last prompt that began with the same block are reused and only the rest
    is hashed: the same keys, at the cost of one comparison of the token arrays.
    """

    def __init__(self, capacity: int, min_blocks: int) -> None:
        self.capacity = capacity
        self.min_blocks = min_blocks
        self.reused = 0  # keys taken from an earlier prompt (for tests and curiosity)
        self._lock = threading.Lock()  # prompts are hashed on the loop and in worker threads
        self._d: OrderedDict[bytes, tuple[np.ndarray, tuple[bytes, ...]]] = OrderedDict()

    def chain(
        self, tokens: np.ndarray, block_size: int, lora_name: str | None, cache_salt: str | None
    ) -> tuple[bytes, ...]:
        n = len(tokens) // block_size
        if n < self.min_blocks:
            return tuple(query_chain(tokens, block_size, lora_name, cache_salt))
        first = query_chain(tokens[:block_size], block_size, lora_name, cache_salt)[0]
        with self._lock:
            hit = self._d.get(first)
            if hit is not None:
                self._d.move_to_end(first)
        reuse = 0
        if hit is not None:
            old_tokens, old_keys = hit
            m = min(len(old_tokens), n * block_size)
            diff = np.flatnonzero(old_tokens[:m] != tokens[:m])
            reuse = min(int(diff[0]) if len(diff) else m, len(old_keys) * block_size) // block_size
        if reuse:
            # Past the first block nothing but the parent key and the tokens goes into a key.
            rest = chain_hashes(
                tokens[reuse * block_size :], block_size, old_keys[reuse - 1], digest=xxhash.xxh3_128_digest
            )
            keys = old_keys[:reuse] + tuple(rest)
            self.reused += reuse
        else:
            keys = tuple(query_chain(tokens, block_size, lora_name, cache_salt))
        # A copy unless nobody can change it (the tokenizer's cached arrays are read-only).
        kept = tokens if not tokens.flags.writeable else tokens.copy()
        with self._lock:
            self._d[first] = (kept, keys)
            self._d.move_to_end(first)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)
        return keys


# ~200 KB a 32k-token prompt (tokens and keys): 32 of them are a few MB. Below 64 blocks
# (~1k tokens at 16 a block) hashing costs less than the comparison.
_RECENT = _RecentChains(capacity=32, min_blocks=64)


def query_tokens(tokens: object) -> np.ndarray:
    """``as_token_array``, with lists converted by numpy first (same checks, ~30x faster)."""
    if isinstance(tokens, (list, tuple)) and tokens:
        # ragged or huge: leave it to as_token_array to say what is wrong
        with contextlib.suppress(ValueError, OverflowError):
            tokens = np.asarray(tokens)
    return as_token_array(tokens)
