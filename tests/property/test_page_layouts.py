"""Properties of the page-layout adapters over random layouts, dtypes, block tables and
lengths: ``scatter(gather(x)) == x``, and a chunk means the same logical KV whichever
layout wrote it (FlashAttention gather -> FlashInfer-HND scatter reads back the same)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvmesh.integrations.vllm.layouts import Choice, CpuPackedPages, choose_page_layout
from tests.unit.integrations.vllm_pages import DTYPES, as_bytes, reference_gather, vllm_layers

BS = 16
NUM_BLOCKS = 10
STRIDED = [("FLASH_ATTN", lay) for lay in KVCacheLayout] + [
    ("FLASHINFER", KVCacheLayout.LBNHC),
    ("FLASHINFER", KVCacheLayout.LBHNC),
]


@st.composite
def tables(draw: st.DrawFn) -> tuple[list[int], int]:
    tokens = draw(st.integers(1, 5 * BS))
    ids = draw(st.permutations(range(NUM_BLOCKS)))[: -(-tokens // BS)]
    return list(ids), tokens


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(
        STRIDED + [("TRITON_MLA", lay) for lay in KVCacheLayout] + [("CPU_ATTN", KVCacheLayout.LBHNC)]
    ),
    st.sampled_from(list(DTYPES)),
    tables(),
    st.integers(0, 2**16),
)
def test_scatter_of_gather_is_identity(backend_layout: tuple, dtype: str, table: tuple, seed: int) -> None:
    backend, layout = backend_layout
    if backend == "CPU_ATTN" and dtype == "float8_e4m3fn":
        dtype = "float32"
    mla = backend.endswith("MLA")
    device = "cpu" if backend == "CPU_ATTN" else "cuda"
    adapter = choose_page_layout(Choice(frozenset({backend}), layout.name, mla, device=device), BS)
    heads, d = (1, 16) if mla else (2, 8)
    ids, tokens = table
    src = vllm_layers(2, NUM_BLOCKS, BS, heads, d, DTYPES[dtype], layout, mla=mla, seed=seed)
    chunk = torch.empty((2, adapter.planes, tokens, heads, d), dtype=DTYPES[dtype])
    adapter.gather(src, ids, chunk)
    dst = vllm_layers(2, NUM_BLOCKS, BS, heads, d, DTYPES[dtype], layout, mla=mla, seed=seed + 1)
    adapter.scatter(chunk, dst, ids)
    again = torch.empty_like(chunk)
    adapter.gather(dst, ids, again)
    assert torch.equal(as_bytes(again), as_bytes(chunk))
    if not isinstance(adapter, CpuPackedPages):  # whole blocks are byte-identical pages
        full = tokens // BS
        for s, t in zip(src, dst, strict=True):
            assert torch.equal(as_bytes(s[ids[:full]]), as_bytes(t[ids[:full]]))


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(STRIDED),
    st.sampled_from(STRIDED),
    st.sampled_from(["bfloat16", "float16", "float8_e4m3fn"]),
    tables(),
    tables(),
    st.integers(0, 2**16),
)
def test_a_chunk_is_the_same_logical_kv_in_every_layout(
    a: tuple, b: tuple, dtype: str, ta: tuple, tb: tuple, seed: int
) -> None:
    tokens = min(ta[1], tb[1])
    ids_a, ids_b = ta[0][: -(-tokens // BS)], tb[0][: -(-tokens // BS)]
    pa = choose_page_layout(Choice(frozenset({a[0]}), a[1].name, False), BS)
    pb = choose_page_layout(Choice(frozenset({b[0]}), b[1].name, False), BS)
    src = vllm_layers(3, NUM_BLOCKS, BS, 2, 8, DTYPES[dtype], a[1], seed=seed)
    chunk = torch.empty((3, 2, tokens, 2, 8), dtype=DTYPES[dtype])
    pa.gather(src, ids_a, chunk)
    dst = vllm_layers(3, NUM_BLOCKS, BS, 2, 8, DTYPES[dtype], b[1], seed=seed + 7)
    pb.scatter(chunk, dst, ids_b)
    # The destination's own logical view, read token by token, holds the source's KV.
    assert torch.equal(
        as_bytes(reference_gather(dst, ids_b, tokens, BS, 2)),
        as_bytes(reference_gather(src, ids_a, tokens, BS, 2)),
    )
