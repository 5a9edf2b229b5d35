"""Every page-layout adapter against a token-by-token reference on tensors that vLLM's own
allocation code lays out (so a vLLM change to a layout fails here, not in production)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.utils import _FLASHINFER_LAYOUT_NAMES
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvmesh.errors import ConfigError
from kvmesh.integrations.vllm.layouts import (
    CPU_BACKENDS,
    KV_BACKENDS,
    MLA_BACKENDS,
    Choice,
    CpuPackedPages,
    KVPages,
    LatentPages,
    PageLayout,
    choose_page_layout,
)
from tests.unit.integrations.vllm_pages import (
    DTYPES,
    as_bytes,
    reference_cpu_gather,
    reference_gather,
    vllm_layers,
)

BS = 16
FLASHINFER = {v: KVCacheLayout[k] for k, v in reversed(list(_FLASHINFER_LAYOUT_NAMES.items()))}
ALL = list(KVCacheLayout)


def _layouts(backend: type) -> list[KVCacheLayout]:
    """What vLLM says the backend runs (None: any layout)."""
    return list(backend.supported_kv_cache_layouts() or ALL)


# (name, backend name, layouts, adapter class, mla)
CASES = [
    *[
        ("flash_attn", FlashAttentionBackend.get_name(), lay, KVPages, False)
        for lay in _layouts(FlashAttentionBackend)
    ],
    ("flashinfer_nhd", "FLASHINFER", FLASHINFER["NHD"], KVPages, False),
    ("flashinfer_hnd", "FLASHINFER", FLASHINFER["HND"], KVPages, False),
    *[
        ("triton", TritonAttentionBackend.get_name(), lay, KVPages, False)
        for lay in _layouts(TritonAttentionBackend)[:2]
    ],
    *[
        ("flex", FlexAttentionBackend.get_name(), lay, KVPages, False)
        for lay in _layouts(FlexAttentionBackend)
    ],
    *[
        ("triton_mla", TritonMLABackend.get_name(), lay, LatentPages, True)
        for lay in _layouts(TritonMLABackend)
    ],
    ("flashmla", FlashMLABackend.get_name(), KVCacheLayout.LBHNC, LatentPages, True),
    *[
        ("cpu", CPUAttentionBackend.get_name(), lay, CpuPackedPages, False)
        for lay in _layouts(CPUAttentionBackend)
    ],
]
IDS = [f"{c[0]}-{c[2].name}" for c in CASES]


def _table(num_blocks: int, tokens: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(num_blocks), -(-tokens // BS))


def _build(
    case: tuple, dtype: str, kernel: int | None = None, seed: int = 0
) -> tuple[PageLayout, list[torch.Tensor], int]:
    _, backend, layout, cls, mla = case
    device = "cpu" if backend == "CPU_ATTN" else "cuda"
    adapter = choose_page_layout(Choice(frozenset({backend}), layout.name, mla, device=device), BS)
    assert type(adapter) is cls
    heads, d = (1, 24) if mla else (2, 8)
    layers = vllm_layers(
        3, 12, BS, heads, d, DTYPES[dtype], layout, mla=mla, kernel_block_size=kernel, seed=seed
    )
    adapter.check(layers, heads, d)
    return adapter, layers, adapter.planes


def _reference(adapter: PageLayout, layers: list[torch.Tensor], ids: list[int], tokens: int) -> torch.Tensor:
    if isinstance(adapter, CpuPackedPages):
        return reference_cpu_gather(layers, ids, tokens, BS)
    return reference_gather(layers, ids, tokens, BS, adapter.planes)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("tokens", [BS, 3 * BS, 2 * BS + 5])  # whole blocks and a partial last block
def test_gather_matches_token_by_token_reference(case: tuple, dtype: str, tokens: int) -> None:
    if case[4] is False and case[3] is CpuPackedPages and dtype == "float8_e4m3fn":
        pytest.skip("vLLM-CPU attention has no fp8 KV")
    adapter, layers, _ = _build(case, dtype, seed=tokens)
    ids = _table(12, tokens, tokens)
    ref = _reference(adapter, layers, ids, tokens)
    out = torch.empty(ref.shape, dtype=ref.dtype)
    adapter.gather(layers, ids, out)
    assert torch.equal(as_bytes(out), as_bytes(ref))


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_scatter_writes_exactly_the_chunk_tokens(case: tuple, dtype: str) -> None:
    adapter, layers, _ = _build(case, dtype, seed=1)
    tokens = 2 * BS + 7
    ids = _table(12, tokens, 7)
    before = [as_bytes(t).clone() for t in layers]
    src_layers = vllm_layers(
        3, 12, BS, *(1, 24) if case[4] else (2, 8), DTYPES[dtype], case[2], mla=case[4], seed=99
    )
    chunk = _reference(adapter, src_layers, ids, tokens)
    adapter.scatter(chunk, layers, ids)
    assert torch.equal(as_bytes(_reference(adapter, layers, ids, tokens)), as_bytes(chunk))
    # Nothing else changed: the blocks not in the table, and the partial block's tail slots.
    after = [as_bytes(t) for t in layers]
    untouched = [b for b in range(12) if b not in ids]
    for b0, a0 in zip(before, after, strict=True):
        assert torch.equal(b0[untouched], a0[untouched])
    orig = vllm_layers(
        3, 12, BS, *(1, 24) if case[4] else (2, 8), DTYPES[dtype], case[2], mla=case[4], seed=1
    )
    tail_now = _reference(adapter, layers, [ids[2]], BS)[:, :, 7:]
    assert torch.equal(as_bytes(tail_now), as_bytes(_reference(adapter, orig, [ids[2]], BS)[:, :, 7:]))


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC], ids=lambda x: x.name)
@pytest.mark.parametrize("mla", [False, True])
def test_kernel_blocks_smaller_than_vllm_blocks(layout: KVCacheLayout, mla: bool) -> None:
    """A backend that splits a 16-token manager block into two 8-token kernel blocks."""
    case = ("split", "TRITON_MLA" if mla else "FLASH_ATTN", layout, LatentPages if mla else KVPages, mla)
    adapter, layers, _ = _build(case, "bfloat16", kernel=8, seed=3)
    assert layers[0].shape[2] == 8 and layers[0].shape[0] == 24
    tokens = 3 * BS + 9
    ids = _table(12, tokens, 5)
    ref = reference_gather(layers, ids, tokens, BS, adapter.planes)
    out = torch.empty_like(ref)
    adapter.gather(layers, ids, out)
    assert torch.equal(as_bytes(out), as_bytes(ref))
    fresh = vllm_layers(
        3, 12, BS, *(1, 24) if mla else (2, 8), torch.bfloat16, layout, mla=mla, kernel_block_size=8, seed=4
    )
    adapter.scatter(out, fresh, ids)
    assert torch.equal(as_bytes(reference_gather(fresh, ids, tokens, BS, adapter.planes)), as_bytes(ref))


def test_mla_accepts_the_squeezed_view() -> None:
    layers = vllm_layers(2, 6, BS, 1, 24, torch.float16, KVCacheLayout.LBHNC, mla=True, seed=2)
    adapter = LatentPages(BS)
    squeezed = [t.squeeze(1) for t in layers]
    adapter.check(squeezed, 1, 24)
    out = torch.empty((2, 1, 20, 1, 24), dtype=torch.float16)
    adapter.gather(squeezed, [4, 1], out)
    assert torch.equal(as_bytes(out), as_bytes(reference_gather(layers, [4, 1], 20, BS, 1)))


def test_block_count_must_match_tokens() -> None:
    layers = vllm_layers(1, 4, BS, 2, 8, torch.bfloat16, KVCacheLayout.LBNHC)
    with pytest.raises(ValueError, match="need 2 blocks"):
        KVPages(BS).gather(layers, [0], torch.empty((1, 2, 20, 2, 8), dtype=torch.bfloat16))


def test_check_refuses_shapes_it_does_not_copy() -> None:
    layers = vllm_layers(1, 4, BS, 2, 8, torch.bfloat16, KVCacheLayout.LBNHC)
    with pytest.raises(NotImplementedError, match="expects vLLM's logical page"):
        KVPages(BS).check(layers, 4, 8)  # wrong head count
    with pytest.raises(NotImplementedError, match="contiguous"):
        CpuPackedPages(BS).check([layers[0].transpose(1, 2)], 2, 8)
    with pytest.raises(NotImplementedError, match="does not divide"):
        KVPages(24).check(layers, 2, 8)


@pytest.mark.parametrize(
    ("choice", "err", "match"),
    [
        (Choice(frozenset({"ROCM_ATTN"}), "LBHNC", False), NotImplementedError, "ROCM_ATTN"),
        (Choice(frozenset({"FLASHMLA_SPARSE"}), "LBHNC", True), NotImplementedError, "FLASHMLA_SPARSE"),
        (Choice(frozenset({"FLASH_ATTN"}), "LBHNC", True), NotImplementedError, "MLA backend"),
        (Choice(frozenset(), "LBHNC", False), NotImplementedError, "none reported"),
        (Choice(frozenset({"CPU_ATTN"}), "LBNHC", False, device="cpu"), NotImplementedError, "'LBNHC'"),
        (Choice(frozenset({"CPU_ATTN", "FLASH_ATTN"}), "LBHNC", False), NotImplementedError, "KV on cuda"),
        (Choice(frozenset({"CPU_ATTN"}), "LBHNC", False), NotImplementedError, "KV on cuda"),
        (
            Choice(frozenset({"FLEX_ATTENTION"}), "LBNHC", False, device="cpu"),
            NotImplementedError,
            "KV on cpu",
        ),
        (Choice(frozenset({"FLASH_ATTN"}), "XYZ", False), NotImplementedError, "'XYZ'"),
        (Choice(frozenset({"FLASH_ATTN"}), "LBHNC", False, cache_dtype="nvfp4"), ConfigError, "nvfp4"),
        (
            Choice(frozenset({"FLASH_ATTN"}), "LBHNC", False, cache_dtype="int8_per_token_head"),
            ConfigError,
            "scales",
        ),
    ],
)
def test_unknown_backends_layouts_and_dtypes_are_refused_by_name(
    choice: Choice, err: type, match: str
) -> None:
    with pytest.raises(err, match=match):
        choose_page_layout(choice, BS)


def test_every_claimed_backend_is_a_vllm_backend_name() -> None:
    """The names kvmesh claims are names vLLM's registry knows (a rename fails here)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    names = {m.name for m in AttentionBackendEnum}
    assert names >= (KV_BACKENDS | MLA_BACKENDS | CPU_BACKENDS)


@pytest.mark.parametrize("layout", ALL, ids=lambda x: x.name)
def test_vllm_layers_are_copied_as_one_stack_and_loose_layers_one_by_one(layout: KVCacheLayout) -> None:
    """vLLM's views of one allocation take the one-kernel-per-plane path; layers in
    separate tensors the per-layer path; both give the reference bytes."""
    views = vllm_layers(4, 12, BS, 2, 8, torch.float16, layout, seed=11)
    loose = [t.clone() for t in views]
    tokens, ids = 3 * BS + 3, [9, 0, 4, 7]
    ref = reference_gather(views, ids, tokens, BS, 2)
    for layers, stacked in ((views, True), (loose, False)):
        adapter = KVPages(BS)
        out = torch.empty_like(ref)
        adapter.gather(layers, ids, out)
        assert (adapter._stacked(layers) is not None) is stacked
        assert torch.equal(as_bytes(out), as_bytes(ref))
        fresh = (
            [torch.zeros_like(t) for t in loose]
            if not stacked
            else vllm_layers(4, 12, BS, 2, 8, torch.float16, layout, seed=12)
        )
        adapter.scatter(out, fresh, ids)
        assert torch.equal(as_bytes(reference_gather(fresh, ids, tokens, BS, 2)), as_bytes(ref))


def test_mla_chunk_layout_and_unchanged_kv_namespaces() -> None:
    from kvmesh.core.keys import KVLayout, namespace_hash

    mla = KVLayout(3, 1, 576, "bfloat16", kv_planes=1)
    assert mla.shape(10) == (3, 1, 10, 1, 576) and mla.bytes_per_token == 3 * 576 * 2
    assert KVLayout.from_dict(mla.to_dict()) == mla
    kv = KVLayout(3, 8, 128, "bfloat16")
    assert "kv_planes" not in kv.to_dict() and KVLayout.from_dict(kv.to_dict()) == kv
    # The K/V namespace is what it was before kv_planes existed (keys stay valid).
    legacy = {"num_layers": 3, "num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16"}
    assert kv.to_dict() == legacy
    assert namespace_hash("m", kv, 256, None) != namespace_hash(
        "m", KVLayout(3, 8, 128, "bfloat16", 1), 256, None
    )
    with pytest.raises(ValueError, match="kv_planes"):
        KVLayout(3, 8, 128, "bfloat16", kv_planes=3)


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(list(KVCacheLayout)),
    dtype=st.sampled_from(list(DTYPES)),
    head_size=st.integers(1, 40),
    heads=st.integers(1, 3),
    mla=st.booleans(),
    tokens=st.integers(1, 3 * BS),
    stacked=st.booleans(),
    kernel=st.sampled_from([None, 8, 4]),
    consecutive=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_word_wide_copies_move_exact_bits_for_any_head_size(
    layout: KVCacheLayout,
    dtype: str,
    head_size: int,
    heads: int,
    mla: bool,
    tokens: int,
    stacked: bool,
    kernel: int | None,
    consecutive: bool,
    seed: int,
) -> None:
    """The strided adapters copy content as the widest integer words its byte size allows
    (8, 4, 2 or 1 bytes: a head of 3 bf16 values is three 2-byte words, of 64 is sixteen
    8-byte ones). For any head size, dtype and layout the chunk is bit-identical to the
    token-by-token reference, and scattering it into other blocks reads back the same.
    ``stacked``: all layers as one strided view (whole blocks selected at once), else layer
    by layer; ``kernel``: the backend's kernel block, a divisor of vLLM's block_size;
    ``consecutive``: block ids in one run (copied as a slice, no index)."""
    h = 1 if mla else heads
    if layout not in (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC):
        kernel = None  # vLLM splits blocks into kernel blocks in layer-compact layouts only
    layers = vllm_layers(
        3, 8, BS, h, head_size, DTYPES[dtype], layout, mla=mla, kernel_block_size=kernel, seed=seed
    )
    if not stacked:
        layers = [t.clone() for t in layers]  # separate storages: the per-layer path
    adapter: PageLayout = LatentPages(BS) if mla else KVPages(BS)
    rng = random.Random(seed)
    nb = -(-tokens // BS)
    if consecutive:
        first = rng.randrange(8 - nb + 1)
        ids = list(range(first, first + nb))
    else:
        ids = rng.sample(range(8), nb)
    want = reference_gather(layers, ids, tokens, BS, adapter.planes)
    got = torch.empty_like(want)
    adapter.gather(layers, ids, got)
    assert torch.equal(as_bytes(got), as_bytes(want))
    others = rng.sample(range(8), len(ids))
    adapter.scatter(got, layers, others)
    assert torch.equal(as_bytes(reference_gather(layers, others, tokens, BS, adapter.planes)), as_bytes(want))


def test_block_ids_out_of_range_are_refused_on_the_host() -> None:
    """An id past the cache is an IndexError before any copy is queued (an index kernel
    would fail on the device, taking the CUDA context with it)."""
    layers = vllm_layers(2, 4, BS, 2, 8, DTYPES["bfloat16"], KVCacheLayout.LBNHC)
    chunk = torch.empty((2, 2, 2 * BS, 2, 8), dtype=DTYPES["bfloat16"])
    for ids in ([1, 4], [-1, 2]):
        with pytest.raises(IndexError, match="out of range for 4 blocks"):
            KVPages(BS).gather(layers, ids, chunk)
        with pytest.raises(IndexError, match="out of range"):
            KVPages(BS).scatter(chunk, layers, ids)
