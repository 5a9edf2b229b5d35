"""PromptKeys reuses the keys of a recent prompt's common prefix: always the keys of a full hash."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.index import prefix
from kvmesh.index.prefix import PromptKeys, query_chain


def _full(tokens: np.ndarray, bs: int, lora: str | None, salt: str | None) -> tuple[bytes, ...]:
    return tuple(query_chain(tokens, bs, lora, salt))


@settings(max_examples=150, deadline=None)
@given(
    shared=st.integers(0, 3000),
    tails=st.lists(st.integers(0, 1500), min_size=1, max_size=4),
    bs=st.sampled_from([16, 32, 64]),
    lora=st.sampled_from([None, "a"]),
    salt=st.sampled_from([None, "s1", "s2"]),
    seed=st.integers(0, 2**16),
)
def test_keys_equal_a_full_hash(
    shared: int, tails: list[int], bs: int, lora: str | None, salt: str | None, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 50, shared, dtype=np.uint32)  # few values: long common runs
    for tail in tails:
        tokens = np.concatenate([head, rng.integers(0, 50, tail, dtype=np.uint32)])
        assert PromptKeys(tokens, lora, salt).chain(bs) == _full(tokens, bs, lora, salt)
        # other salts and LoRAs with the same tokens never share a key with these
        assert PromptKeys(tokens, "b", salt).chain(bs) == _full(tokens, bs, "b", salt)
        assert PromptKeys(tokens, lora, "other").chain(bs) == _full(tokens, bs, lora, "other")


def test_a_growing_prompt_hashes_only_its_new_blocks() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 4096, 20_000, dtype=np.uint32)
    PromptKeys(tokens[:10_000]).chain(16)
    before = prefix._RECENT.reused
    assert PromptKeys(tokens).chain(16) == _full(tokens, 16, None, None)
    assert prefix._RECENT.reused - before == 10_000 // 16


def test_a_changed_array_does_not_change_later_keys() -> None:
    """The cache keeps a copy of a writeable array: the caller may reuse its buffer."""
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 4096, 5_000, dtype=np.uint32)
    PromptKeys(tokens).chain(16)
    tokens[3_000] += 1  # the same buffer, another prompt
    assert PromptKeys(tokens).chain(16) == _full(tokens, 16, None, None)
    tokens[5] += 1  # now even its second block differs from the cached prompt
    assert PromptKeys(tokens).chain(16) == _full(tokens, 16, None, None)


def test_short_prompts_are_not_kept() -> None:
    n = len(prefix._RECENT._d)
    tokens = np.arange(16 * (prefix._RECENT.min_blocks - 1), dtype=np.uint32) + 777
    assert PromptKeys(tokens).chain(16) == _full(tokens, 16, None, None)
    assert len(prefix._RECENT._d) == n
