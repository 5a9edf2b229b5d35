"""Paged KV tensors built by vLLM's own code (shapes and strides as vLLM 0.32 allocates
them), and token-by-token references that index the logical ``[B, H, N, C]`` page."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def vllm_layers(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_size: int,
    dtype: torch.dtype,
    layout: KVCacheLayout,
    mla: bool = False,
    kernel_block_size: int | None = None,
    seed: int = 0,
) -> list[torch.Tensor]:
    """One view per layer over one random backing buffer, exactly as vLLM's
    ``allocate_kv_cache`` lays it out for ``layout``."""
    if mla:
        spec: FullAttentionSpec = MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=head_size, dtype=dtype
        )
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    strides = compute_layout_strides(spec, num_blocks, num_layers, layout)
    size = num_layers * num_blocks * spec.page_size_bytes
    tensor = KVCacheTensor(
        size=size,
        layers=[f"model.layers.{i}.self_attn.attn" for i in range(num_layers)],
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=gen)
    return create_kv_cache_views(raw, spec, num_blocks, layout, tensor, kernel_block_size=kernel_block_size)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _page(layer: torch.Tensor) -> torch.Tensor:
    return layer if layer.dim() == 4 else layer.unsqueeze(1)


def reference_gather(
    layers: Sequence[torch.Tensor], block_ids: Sequence[int], tokens: int, block_size: int, planes: int
) -> torch.Tensor:
    """Token by token from the logical view: ``chunk[l, p, t, h] = page[kb, h, off, p*D:(p+1)*D]``."""
    first = _page(layers[0])
    heads, d = first.shape[1], first.shape[3] // planes
    out = torch.empty((len(layers), planes, tokens, heads, d), dtype=first.dtype)
    for li, layer in enumerate(layers):
        page = _page(layer)
        n = page.shape[2]
        for t in range(tokens):
            kb = block_ids[t // block_size] * (block_size // n) + (t % block_size) // n
            for p in range(planes):
                out[li, p, t] = page[kb, :, t % n, p * d : (p + 1) * d]
    return out


def reference_cpu_gather(
    layers: Sequence[torch.Tensor], block_ids: Sequence[int], tokens: int, block_size: int
) -> torch.Tensor:
    """vLLM-CPU's page, token by token: per head, K transposed ``[D, N]`` then V ``[N, D]``."""
    nb, heads, n, c = layers[0].shape
    d = c // 2
    out = torch.empty((len(layers), 2, tokens, heads, d), dtype=layers[0].dtype)
    for li, layer in enumerate(layers):
        flat = layer.reshape(nb, heads, 2 * n * d)
        for t in range(tokens):
            b, off = block_ids[t // block_size], t % block_size
            for h in range(heads):
                out[li, 0, t, h] = flat[b, h, : n * d].view(d, n)[:, off]
                out[li, 1, t, h] = flat[b, h, n * d :].view(n, d)[off]
    return out
