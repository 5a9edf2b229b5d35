"""Page layouts: copies between vLLM's paged KV tensors and kvmesh's token-major chunks.

One seam, :class:`PageLayout`, with ``gather(layers, block_ids, out)`` (pages -> chunk) and
``scatter(chunk, layers, block_ids)`` (chunk -> pages), and one small adapter per layout
family. Chunks are always token-major, ``[num_layers, planes, tokens, heads, head_size]``
(``planes`` = 2 for K/V, 1 for an MLA latent with ``heads`` = 1), so a chunk is the same
bytes whichever replica, backend or page layout wrote it.

What vLLM 0.32 hands the connector (``vllm/v1/kv_cache_interface.py::create_kv_cache_views``):
one tensor per attention layer, the *logical* page ``[B, H, N, C]`` (blocks, head slots,
tokens per kernel block, content), whose strides follow the resolved
``vllm/v1/kv_cache_layout.py::KVCacheLayout`` (LBNHC = FlashInfer's "NHD", LBHNC = "HND",
the block-outermost cross-layer layouts, ...). Content ``C`` is ``K || V``
(``head_size + head_size_v``) for regular attention and the latent
(``kv_lora_rank + rope_dim``) for MLA, with ``H`` = 1. Indexing that logical view is
therefore right for every stride order, which is what the backends themselves do
(FlashAttention, Triton, FlexAttention: ``kv_cache.transpose(1, 2).split(head_size, -1)``;
the MLA backends: ``kv_cache.squeeze(1)``). A backend may cut a manager block into
``block_size // N`` kernel blocks (``group_kernel_blocks``): manager block ``b`` is kernel
blocks ``b * r .. b * r + r - 1``.

vLLM-CPU is the exception: its "vec" kernel reinterprets each head's page bytes as the
keys transposed, ``[head_size, block_size]``, then the values (see paged.py), so it has
its own adapter.

This module imports torch only (no vLLM): scripts/gpu_check.py round-trips the adapters on
a GPU machine without vLLM. Which adapter a vLLM deployment gets is decided by
:func:`choose_page_layout` from the names vLLM reports, and anything it does not know is
refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvmesh.errors import ConfigError
from kvmesh.integrations.vllm.paged import chunk_to_paged, paged_to_chunk

# Attention backends (``AttentionBackend.get_name()``) whose per-layer KV is the logical
# [B, H, N, K||V] view, split as above (read in vllm/v1/attention/backends/*.py).
KV_BACKENDS = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"})
# Dense (non-sparse) MLA backends: [B, 1, N, latent], squeezed to [B, N, latent] by the layer.
MLA_BACKENDS = frozenset({"TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "CUTLASS_MLA", "FLASHINFER_MLA"})
CPU_BACKENDS = frozenset({"CPU_ATTN"})
# KVCacheLayout members (stride orders over logical [L, B, H, N, C]); the strided adapters
# index the logical view, so every order works. CPU attention only runs LBHNC.
STRIDED_LAYOUTS = frozenset({"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"})
CPU_LAYOUTS = frozenset({"LBHNC"})
# kv_cache_dtype values whose bytes are plain elements, no scales or packing inside the page.
PLAIN_CACHE_DTYPES = frozenset({"auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"})


def _index_into(src: torch.Tensor, index: list[torch.Tensor | None], out: torch.Tensor) -> None:
    """``out[...] = src[index]`` without a temporary where torch allows it (aten's
    ``index.out`` writes the gathered elements straight into ``out``, strided or not)."""
    try:
        torch.ops.aten.index.Tensor_out(src, index, out=out)
    except RuntimeError:
        out.copy_(src[tuple(slice(None) if i is None else i for i in index)])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 and other 1-byte KV copied as bytes: the copy must never convert values."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _words(page: torch.Tensor, chunk: torch.Tensor, unit: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``page`` and ``chunk`` (same dtype, the content axis last and contiguous)
    reinterpreted as the widest integer words that divide ``unit`` bytes (default: the
    content axis; a plane's bytes where the caller splits planes) and that both allow. The
    copy moves bits and never converts values, and a copy kernel's cost goes with its
    element count: 8-byte words are 4x fewer elements than bf16."""
    size = page.element_size()
    unit = unit or page.shape[-1] * size
    for word in _WORDS:
        if word.itemsize < size or unit % word.itemsize:
            continue
        try:
            return page.view(word), chunk.view(word)
        except RuntimeError:  # an offset or stride not a whole number of words
            continue
    return _bytes(page), _bytes(chunk)


class PageLayout:
    """Moves whole chunks between paged layer tensors and token-major chunk tensors.

    ``block_ids`` are vLLM's (manager) block ids covering the chunk's tokens; the last block
    may be partial: only its first ``tokens % block_size`` slots are read or written.
    ``out`` / ``chunk`` live on the layers' device (the host-device copy is the caller's).
    """

    name = "abstract"
    planes = 2

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size

    def check(self, layers: Sequence[torch.Tensor], heads: int, head_size: int) -> None:
        """Raise a clear error unless every layer is what this adapter copies."""
        raise NotImplementedError

    def prepare(self, layers: Sequence[torch.Tensor], block_ids: Sequence[int], tokens: int) -> Any:
        """Per-chunk state shared by its layers' copies (passed back as ``prep``)."""
        return None

    def gather_layer(
        self, layer: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor, prep: Any = None
    ) -> None:
        """One layer's pages into ``out`` ``[planes, tokens, heads, head_size]``."""
        raise NotImplementedError

    def scatter_layer(
        self, chunk: torch.Tensor, layer: torch.Tensor, block_ids: Sequence[int], prep: Any = None
    ) -> None:
        """``chunk`` ``[planes, tokens, heads, head_size]`` into one layer's pages."""
        raise NotImplementedError

    def gather(self, layers: Sequence[torch.Tensor], block_ids: Sequence[int], out: torch.Tensor) -> None:
        self._count(block_ids, out.shape[2])
        prep = self.prepare(layers, block_ids, out.shape[2])
        for li, layer in enumerate(layers):
            self.gather_layer(layer, block_ids, out[li], prep)

    def scatter(self, chunk: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: Sequence[int]) -> None:
        self._count(block_ids, chunk.shape[2])
        prep = self.prepare(layers, block_ids, chunk.shape[2])
        for li, layer in enumerate(layers):
            self.scatter_layer(chunk[li], layer, block_ids, prep)

    def _count(self, block_ids: Sequence[int], tokens: int) -> None:
        if len(block_ids) != -(-tokens // self.block_size):
            raise ValueError(
                f"{tokens} tokens need {-(-tokens // self.block_size)} blocks of "
                f"{self.block_size}, got {len(block_ids)}"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"


class StridedPages(PageLayout):
    """The logical ``[B, H, N, planes * head_size]`` view, any stride order, kernel blocks
    of ``N`` <= block_size tokens.

    vLLM places a group's layers in one allocation at a fixed layer stride
    (``KVCacheTensor.layer_stride``), so all layers are one ``[L, B, H, N, C]`` strided
    view: a whole chunk is then one gather (or scatter) kernel per plane, whatever the
    number of layers. Layers that are not evenly spaced are copied one by one.
    """

    name = "strided"

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self._stack_key: tuple[object, ...] | None = None
        self._stack: torch.Tensor | None = None

    @staticmethod
    def _four(t: torch.Tensor) -> torch.Tensor:
        return t

    def check(self, layers: Sequence[torch.Tensor], heads: int, head_size: int) -> None:
        for i, t in enumerate(self._four(x) for x in layers):
            want = f"[num_blocks, {heads}, block_size or a divisor of it, {self.planes * head_size}]"
            if t.dim() != 4 or t.shape[1] != heads or t.shape[3] != self.planes * head_size:
                raise NotImplementedError(
                    f"layer {i} KV cache has shape {tuple(t.shape)}; the {self.name} layout "
                    f"expects vLLM's logical page {want}"
                )
            if self.block_size % t.shape[2]:
                raise NotImplementedError(
                    f"layer {i} KV pages hold {t.shape[2]} tokens, which does not divide "
                    f"vLLM's block_size {self.block_size}"
                )
            if t.stride(3) != 1:
                raise NotImplementedError(f"layer {i} KV content is not contiguous (strides {t.stride()})")

    def prepare(self, layers: Sequence[torch.Tensor], block_ids: Sequence[int], tokens: int) -> Any:
        """(kernel block, offset) of every token, on the layers' device: computed once per
        chunk and shared by its layers."""
        layer = self._four(layers[0])
        n = int(layer.shape[2])
        r = self.block_size // n
        # Computed on the host (a few microseconds of numpy) and sent in one small copy: on
        # an H200 the copy path is bound by the host's time to queue work, and this was
        # seven kernel launches. The copy is from pageable memory, which CUDA stages before
        # returning, so the array may go at once.
        t = np.arange(tokens, dtype=np.int64)
        both = np.empty((2, tokens), dtype=np.int64)
        both[0] = np.asarray(block_ids, dtype=np.int64)[t // self.block_size] * r + (t % self.block_size) // n
        both[1] = t % n
        dev = torch.from_numpy(both).to(layer.device, non_blocking=True)
        return dev[0], dev[1]

    def _stacked(self, layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """All layers as one ``[L, B, H, N, C]`` view, or ``None`` if they are not evenly
        spaced views of one storage with the same strides."""
        four = [self._four(t) for t in layers]
        first = four[0]
        key = (len(four), first.data_ptr(), four[-1].data_ptr(), tuple(first.shape), first.stride())
        if key == self._stack_key:
            return self._stack
        stack: torch.Tensor | None = None
        esz = first.element_size()
        step = four[1].data_ptr() - first.data_ptr() if len(four) > 1 else first.numel() * esz
        storage = first.untyped_storage().data_ptr()
        if (
            step > 0
            and step % esz == 0
            and all(
                t.shape == first.shape
                and t.stride() == first.stride()
                and t.dtype == first.dtype
                and t.untyped_storage().data_ptr() == storage
                and t.data_ptr() - first.data_ptr() == i * step
                for i, t in enumerate(four)
            )
        ):
            stack = first.as_strided(
                (len(four), *first.shape), (step // esz, *first.stride()), first.storage_offset()
            )
        self._stack_key, self._stack = key, stack
        return stack

    def gather(self, layers: Sequence[torch.Tensor], block_ids: Sequence[int], out: torch.Tensor) -> None:
        self._count(block_ids, out.shape[2])
        stack = self._stacked(layers)
        if stack is None:
            prep = self.prepare(layers, block_ids, out.shape[2])
            for li, layer in enumerate(layers):
                self.gather_layer(layer, block_ids, out[li], prep)
            return
        self._gather_blocks(stack, block_ids, out)

    def _gather_blocks(self, stack: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor) -> None:
        whole, tail, pages = self._blocks(stack, block_ids, out)
        if whole is not None:
            where, into = whole
            if isinstance(where, slice):  # consecutive blocks: a plain strided copy, no index
                into.copy_(pages[:, :, where])
            else:
                _index_into(pages, [None, None, where], into)
        if tail is not None:
            tail[1].copy_(pages[:, :, tail[0], : tail[1].shape[2]])

    def scatter(self, chunk: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: Sequence[int]) -> None:
        self._count(block_ids, chunk.shape[2])
        stack = self._stacked(layers)
        if stack is None:
            prep = self.prepare(layers, block_ids, chunk.shape[2])
            for li, layer in enumerate(layers):
                self.scatter_layer(chunk[li], layer, block_ids, prep)
            return
        self._scatter_blocks(chunk, stack, block_ids)

    def _scatter_blocks(self, chunk: torch.Tensor, stack: torch.Tensor, block_ids: Sequence[int]) -> None:
        whole, tail, pages = self._blocks(stack, block_ids, chunk)
        if whole is not None:
            pages[:, :, whole[0]] = whole[1]  # a strided copy for a slice, index_put_ for an index
        if tail is not None:  # only the tokens the chunk has: the rest of the block is not ours
            pages[:, :, tail[0], : tail[1].shape[2]].copy_(tail[1])

    def _blocks(self, stack: torch.Tensor, block_ids: Sequence[int], chunk: torch.Tensor) -> tuple[Any, ...]:
        """The block-wise copy between all layers' pages and a chunk, in few kernels (on an
        H200 the copy path is bound by the host's time to queue work, and the per-token
        index kernels this replaced took a copy of indices and two launches per plane).

        The pages are viewed as ``[L, planes, blocks, N, H, words]`` (a permutation of the
        logical ``[L, B, H, N, C]``, no copy) and the chunk's whole kernel blocks as the
        same shape, so they move in one indexed copy along the block axis (a plain strided
        copy when the blocks are consecutive, as fresh allocations mostly are), plus one
        copy for a partial last block. Returns ``(where, chunk view)`` of the whole blocks
        (``where``: a slice of the block axis when they are consecutive, else a device
        index), ``(block, chunk view)`` of the partial one, and the pages view, all in words."""
        tokens = chunk.shape[2]
        n = int(stack.shape[3])
        r = self.block_size // n
        kblocks = np.add.outer(np.asarray(block_ids, dtype=np.int64) * r, np.arange(r)).ravel()[
            : -(-tokens // n)
        ]
        if len(kblocks) and (int(kblocks.min()) < 0 or int(kblocks.max()) >= stack.shape[1]):
            # checked here: an index kernel would fail on the device, and take the context with it
            raise IndexError(f"block ids {list(block_ids)} are out of range for {stack.shape[1] // r} blocks")
        src, dst = _words(stack, chunk, chunk.shape[-1] * chunk.element_size())  # words within a plane
        layers, blocks, heads, _, c = src.shape
        dw = c // self.planes
        pages = src.view(layers, blocks, heads, n, self.planes, dw).permute(0, 4, 1, 3, 2, 5)
        full, rem = divmod(tokens, n)
        whole: tuple[slice | torch.Tensor, torch.Tensor] | None = None
        tail = None
        if full:
            ks = kblocks[:full]
            view = dst[:, :, : full * n].view(layers, self.planes, full, n, heads, dw)
            if int(ks[-1]) - int(ks[0]) == full - 1 and bool(np.all(np.diff(ks) == 1)):
                whole = (slice(int(ks[0]), int(ks[0]) + full), view)
            else:
                whole = (torch.from_numpy(ks).to(stack.device, non_blocking=True), view)
        if rem:
            tail = (int(kblocks[full]), dst[:, :, full * n :])
        return whole, tail, pages

    def gather_layer(
        self, layer: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor, prep: Any = None
    ) -> None:
        layer = self._four(layer)
        kb, off = prep if prep is not None else self.prepare([layer], block_ids, out.shape[1])
        d = out.shape[-1]
        for p in range(self.planes):
            src, dst = _words(layer[..., p * d : (p + 1) * d], out[p])
            _index_into(src, [kb, None, off], dst)

    def scatter_layer(
        self, chunk: torch.Tensor, layer: torch.Tensor, block_ids: Sequence[int], prep: Any = None
    ) -> None:
        layer = self._four(layer)
        kb, off = prep if prep is not None else self.prepare([layer], block_ids, chunk.shape[1])
        d = chunk.shape[-1]
        for p in range(self.planes):
            dst, src = _words(layer[..., p * d : (p + 1) * d], chunk[p])
            dst[kb, :, off] = src


class KVPages(StridedPages):
    """K and V side by side in each token's content: FlashAttention, FlashInfer (NHD and
    HND), Triton, FlexAttention."""

    name = "kv"
    planes = 2


class LatentPages(StridedPages):
    """MLA: one latent vector per token, ``[B, 1, N, latent]`` (a 3-D ``[B, N, latent]``
    view is accepted too); chunks ``[num_layers, 1, tokens, 1, latent]``."""

    name = "mla"
    planes = 1

    @staticmethod
    def _four(t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(1) if t.dim() == 3 else t

    def check(self, layers: Sequence[torch.Tensor], heads: int, head_size: int) -> None:
        super().check(layers, 1, head_size)


class CpuPackedPages(PageLayout):
    """vLLM-CPU's "vec" kernel: per head, keys transposed ``[head_size, block_size]`` then
    values ``[block_size, head_size]`` (paged.py, vectorised per layer)."""

    name = "cpu"
    planes = 2

    def check(self, layers: Sequence[torch.Tensor], heads: int, head_size: int) -> None:
        want = (heads, self.block_size, 2 * head_size)
        for i, t in enumerate(layers):
            if t.dim() != 4 or tuple(t.shape[1:]) != want or not t.is_contiguous():
                raise NotImplementedError(
                    f"layer {i} KV cache has shape {tuple(t.shape)} (contiguous={t.is_contiguous()}); "
                    f"vLLM-CPU's page is a contiguous [num_blocks, {want[0]}, {want[1]}, {want[2]}]"
                )

    def gather_layer(
        self, layer: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor, prep: Any = None
    ) -> None:
        paged_to_chunk([layer], block_ids, out.unsqueeze(0))

    def scatter_layer(
        self, chunk: torch.Tensor, layer: torch.Tensor, block_ids: Sequence[int], prep: Any = None
    ) -> None:
        chunk_to_paged(chunk.unsqueeze(0), [layer], block_ids)

    def gather(self, layers: Sequence[torch.Tensor], block_ids: Sequence[int], out: torch.Tensor) -> None:
        paged_to_chunk(layers, block_ids, out)  # the tuned all-layer loop of paged.py

    def scatter(self, chunk: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: Sequence[int]) -> None:
        chunk_to_paged(chunk, layers, block_ids)


@dataclass(frozen=True)
class Choice:
    """What the connector learned from vLLM, reduced to names (no vLLM objects)."""

    backends: frozenset[str]
    layout: str | None  # KVCacheLayout member name, None if vLLM did not resolve one
    mla: bool
    cache_dtype: str = "auto"
    device: str = "cuda"


def choose_page_layout(c: Choice, block_size: int) -> PageLayout:
    """The adapter for what vLLM reports, or a clear error naming what kvmesh lacks."""
    if c.cache_dtype not in PLAIN_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype {c.cache_dtype!r} packs scales or sub-byte values into the page; "
            f"kvmesh stores plain KV only: {', '.join(sorted(PLAIN_CACHE_DTYPES))}"
        )
    known = MLA_BACKENDS if c.mla else KV_BACKENDS | CPU_BACKENDS
    unknown = sorted(c.backends - known)
    if unknown or not c.backends:
        kind = "MLA" if c.mla else "attention"
        raise NotImplementedError(
            f"kvmesh's connector does not support the vLLM {kind} backend(s) "
            f"{', '.join(unknown) or '(none reported)'}; supported: {', '.join(sorted(known))} "
            "(choose one with VLLM_ATTENTION_BACKEND / --attention-backend)"
        )
    adapter: PageLayout
    if (c.device == "cpu") != bool(c.backends & CPU_BACKENDS) or (
        c.backends & CPU_BACKENDS and c.backends - CPU_BACKENDS
    ):
        raise NotImplementedError(
            f"KV on {c.device} with attention backend(s) {', '.join(sorted(c.backends))}: kvmesh "
            f"supports {', '.join(sorted(CPU_BACKENDS))} for KV in CPU memory and "
            f"{', '.join(sorted(KV_BACKENDS | MLA_BACKENDS))} for KV on a GPU"
        )
    if c.backends & CPU_BACKENDS:
        allowed, adapter = CPU_LAYOUTS, CpuPackedPages(block_size)
    else:
        allowed = STRIDED_LAYOUTS
        adapter = LatentPages(block_size) if c.mla else KVPages(block_size)
    if c.layout is not None and c.layout not in allowed:
        raise NotImplementedError(
            f"vLLM resolved the KV cache layout {c.layout!r} for backend(s) "
            f"{', '.join(sorted(c.backends))}; kvmesh supports {', '.join(sorted(allowed))} there"
        )
    return adapter
