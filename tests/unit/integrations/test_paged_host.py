"""The host copies of paged.py (numpy views) against its torch kernels, which the GPU path
keeps: both must move the same bits for any block table, block size, dtype and partial
last block, and a bad block id must fail before anything is written."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvmesh.integrations.vllm.paged as paged
from tests.unit.integrations.vllm_pages import as_bytes

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _layers(
    n: int, blocks: int, heads: int, bs: int, d: int, dtype: torch.dtype, seed: int
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        -128, 128, (n * blocks * heads * bs * 2 * d * dtype.itemsize,), dtype=torch.int8, generator=gen
    )
    return list(raw.view(dtype).view(n, blocks, heads, bs, 2 * d).unbind(0))


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    heads = draw(st.integers(1, 3))
    d = draw(st.sampled_from([1, 4, 8]))
    blocks = draw(st.integers(2, 12))
    tokens = draw(st.integers(1, blocks * bs))
    need = -(-tokens // bs)
    if draw(st.booleans()):  # consecutive (a slice), else any table (an index array)
        first = draw(st.integers(0, blocks - need))
        ids = list(range(first, first + need))
    else:
        ids = draw(st.permutations(range(blocks)))[:need]
    dtype = draw(st.sampled_from(DTYPES))
    return bs, heads, d, blocks, tokens, ids, dtype, draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(cases())
def test_host_copies_equal_the_torch_kernels(case: tuple) -> None:
    bs, heads, d, blocks, tokens, ids, dtype, as_tensor = case
    table = torch.tensor(ids) if as_tensor else ids
    src = _layers(2, blocks, heads, bs, d, dtype, seed=1)
    host_out = torch.empty(2, 2, tokens, heads, d, dtype=dtype)
    torch_out = torch.empty_like(host_out)
    paged._host_gather(src, table, host_out)
    _torch_gather(src, table, torch_out)
    assert torch.equal(as_bytes(host_out), as_bytes(torch_out))

    host_dst = _layers(2, blocks, heads, bs, d, dtype, seed=2)
    torch_dst = [t.clone() for t in host_dst]
    paged._host_scatter(host_out, host_dst, table)
    _torch_scatter(host_out, torch_dst, table)
    for a, b in zip(host_dst, torch_dst, strict=True):
        assert torch.equal(as_bytes(a), as_bytes(b))  # same tokens written, the rest untouched


def _torch_gather(layers: list[torch.Tensor], ids: object, out: torch.Tensor) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paged, "_on_host", lambda *a: False)
        paged.paged_to_chunk(layers, ids, out)  # type: ignore[arg-type]


def _torch_scatter(chunk: torch.Tensor, layers: list[torch.Tensor], ids: object) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paged, "_on_host", lambda *a: False)
        paged.chunk_to_paged(chunk, layers, ids)  # type: ignore[arg-type]


def test_host_path_is_taken_for_host_tensors() -> None:
    layers = _layers(1, 4, 1, 2, 2, torch.float32, seed=0)
    assert paged._on_host(layers, torch.empty(1))


@pytest.mark.parametrize("ids", [[0, 4], [-1, 0], [3, 5]], ids=["past-end", "negative", "past-end-last"])
def test_a_block_outside_the_cache_fails_before_writing(ids: list[int]) -> None:
    layers = _layers(2, 4, 1, 2, 2, torch.float32, seed=0)
    before = [t.clone() for t in layers]
    with pytest.raises(IndexError, match="out of range for a KV cache of 4 blocks"):
        paged.chunk_to_paged(torch.ones(2, 2, 4, 1, 2), layers, ids)
    with pytest.raises(IndexError, match="out of range"):
        paged.paged_to_chunk(layers, ids, torch.empty(2, 2, 4, 1, 2))
    assert all(torch.equal(a, b) for a, b in zip(layers, before, strict=True))


def test_a_block_count_that_does_not_fit_the_tokens_is_refused() -> None:
    layers = _layers(1, 4, 1, 2, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="5 tokens need 3 blocks of 2, got 2"):
        paged.chunk_to_paged(torch.ones(1, 2, 5, 1, 2), layers, [0, 1])
