"""Copies between vLLM-CPU's paged KV tensors and kvmesh's token-major chunks.

vLLM hands the connector one tensor per attention layer, ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]``, but that 4-D shape is only a page size: the CPU attention
kernel ("vec" ISA: fp32 / AVX2) splits each head's page into the keys stored TRANSPOSED,
``[head_size, block_size]``, followed by the values, ``[block_size, head_size]`` (see
docs/vllm-connector-notes.md). Indexing ``[block, head, offset]`` therefore mixes K and V.

kvmesh stores chunks token-major, ``[num_layers, 2, tokens, num_kv_heads, head_size]``, so a
chunk means the same thing whatever page layout wrote it. The two functions below convert
whole blocks, vectorised per layer (one gather/scatter per layer and K/V half, no per-token
Python loop).

On the host the copies go through numpy views of the same memory: a run of consecutive
blocks is one strided slice copy, scattered blocks one fancy-indexed copy, about twice as
fast as torch's ``index_copy_`` / ``index_select`` on a transposed source (the keys).
Other devices keep torch's kernels with device-side indices.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvmesh.core.keys import KVLayout

# CPU attention ISAs whose page layout is the one described above (checked against
# transformers' K/V in scripts/try_example_connector.py --probe). Others (amx for bf16,
# neon, vec16, ...) may pack pages differently: refuse them rather than cache wrong KV.
VERIFIED_ISAS = frozenset({"vec"})
_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def ordered_layers(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The per-layer tensors in model order (layer index in the name, not dict order),
    so every process and replica lays chunks out alike."""
    return [kv_caches[name] for name in ordered_names(kv_caches)]


def ordered_names(kv_caches: Mapping[str, torch.Tensor]) -> list[str]:
    """The layer names of ``kv_caches`` in model order (see :func:`ordered_layers`)."""

    def index(name: str) -> int:
        m = _LAYER_INDEX.search(name)
        if m is None:
            raise ValueError(f"cannot find a layer index in KV cache name {name!r}")
        return int(m.group(1))

    return sorted(kv_caches, key=index)


def check_layers(layers: Sequence[torch.Tensor], layout: KVLayout, block_size: int) -> None:
    """Raise a clear error unless every layer has the CPU paged shape this module copies."""
    if len(layers) != layout.num_layers:
        raise ValueError(
            f"vLLM registered {len(layers)} KV cache layers but the model config says "
            f"{layout.num_layers}; kvmesh supports one KV tensor per attention layer "
            "(no cross-layer KV sharing)"
        )
    want = (layout.num_kv_heads, block_size, 2 * layout.head_size)
    for i, t in enumerate(layers):
        if t.device.type != "cpu":
            raise NotImplementedError(
                f"kvmesh's vLLM connector supports vLLM-CPU only; layer {i} KV is on {t.device}"
            )
        if t.dim() != 4 or tuple(t.shape[1:]) != want or not t.is_contiguous():
            raise NotImplementedError(
                f"layer {i} KV cache has shape {tuple(t.shape)} (contiguous={t.is_contiguous()}); "
                f"kvmesh expects vLLM-CPU's contiguous [num_blocks, {want[0]}, {want[1]}, {want[2]}] "
                "(num_kv_heads, block_size, 2 * head_size)"
            )
        if str(t.dtype).removeprefix("torch.") != layout.dtype:
            raise ValueError(f"layer {i} KV dtype {t.dtype} differs from the layout dtype {layout.dtype}")


def _halves(layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer: keys ``[blocks, heads, head_size, block_size]`` (transposed)
    and values ``[blocks, heads, block_size, head_size]``."""
    nb, nh, bs, c2 = layer.shape
    d = c2 // 2
    page = layer.view(nb, nh, 2, bs * d)
    return page[:, :, 0].view(nb, nh, d, bs), page[:, :, 1].view(nb, nh, bs, d)


def _index(block_ids: Sequence[int] | torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Block ids as an index on the pages' device (an index left on the host makes CUDA's
    ``index_select`` / ``index_copy_`` refuse, or copy it synchronously)."""
    return torch.as_tensor(block_ids, dtype=torch.long).to(device or "cpu", non_blocking=True)


# numpy has no bfloat16 or fp8: the copies move bits, so a host tensor is viewed as the
# unsigned integer of its element size
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _host(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor's elements (the same memory)."""
    return t.view(_BITS[t.element_size()]).numpy()


def _host_halves(layer: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_halves` as numpy views."""
    nb, nh, bs, c2 = layer.shape
    d = c2 // 2
    page = _host(layer).reshape(nb, nh, 2, bs * d)
    return page[:, :, 0].reshape(nb, nh, d, bs), page[:, :, 1].reshape(nb, nh, bs, d)


def _host_blocks(block_ids: Sequence[int] | torch.Tensor, num_blocks: int) -> slice | np.ndarray:
    """The full blocks as a numpy index: a slice when they are consecutive (the usual case
    for a fresh allocation), else an index array. Raises ``IndexError`` for an id outside
    the cache (numpy would wrap a negative one, and a slice would silently stop short)."""
    ids = np.asarray(block_ids.cpu() if isinstance(block_ids, torch.Tensor) else block_ids, dtype=np.int64)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        bad = next(int(b) for b in ids if not 0 <= b < num_blocks)
        raise IndexError(f"block id {bad} is out of range for a KV cache of {num_blocks} blocks")
    if len(ids) and int(ids[-1]) - int(ids[0]) == len(ids) - 1 and bool(np.all(np.diff(ids) == 1)):
        return slice(int(ids[0]), int(ids[0]) + len(ids))
    return ids


def _host_index(
    layers: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor, n_tok: int
) -> tuple[slice | np.ndarray, int]:
    """The full blocks' index and the partial last block (-1: none) for ``n_tok`` tokens,
    checked once for all layers (they share block size and block count)."""
    nb, _, bs, _ = layers[0].shape
    for layer in layers:
        if layer.shape[0] != nb or layer.shape[2] != bs:
            raise ValueError(
                f"layers differ in block count or size: {tuple(layer.shape)} vs {tuple(layers[0].shape)}"
            )
    full, rem = divmod(n_tok, bs)
    if len(block_ids) != full + (rem > 0):
        raise ValueError(f"{n_tok} tokens need {full + (rem > 0)} blocks of {bs}, got {len(block_ids)}")
    at = _host_blocks(block_ids, nb)
    if not rem:
        return at, -1
    if isinstance(at, slice):
        return slice(at.start, at.stop - 1), at.stop - 1
    return at[:full], int(at[full])


def _on_host(layers: Sequence[torch.Tensor], chunk: torch.Tensor) -> bool:
    return bool(layers) and layers[0].device.type == "cpu" and chunk.device.type == "cpu"


def _host_gather(
    layers: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor, out: torch.Tensor
) -> None:
    n_tok = out.shape[2]
    at, last = _host_index(layers, block_ids, n_tok)
    dst = _host(out)
    for li, layer in enumerate(layers):
        _, nh, bs, c2 = layer.shape
        d = c2 // 2
        full, rem = divmod(n_tok, bs)
        k, v = _host_halves(layer)
        ok, ov = dst[li, 0], dst[li, 1]
        if full:  # [full, nh, d, bs] -> tokens [full * bs, nh, d]
            ok[: full * bs].reshape(full, bs, nh, d)[...] = k[at].transpose(0, 3, 1, 2)
            ov[: full * bs].reshape(full, bs, nh, d)[...] = v[at].transpose(0, 2, 1, 3)
        if rem:
            ok[full * bs :] = k[last, :, :, :rem].transpose(2, 0, 1)
            ov[full * bs :] = v[last, :, :rem, :].transpose(1, 0, 2)


def _host_scatter(
    chunk: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor
) -> None:
    n_tok = chunk.shape[2]
    at, last = _host_index(layers, block_ids, n_tok)
    src = _host(chunk)
    for li, layer in enumerate(layers):
        _, nh, bs, c2 = layer.shape
        d = c2 // 2
        full, rem = divmod(n_tok, bs)
        k, v = _host_halves(layer)
        sk, sv = src[li, 0], src[li, 1]
        if full:
            k[at] = sk[: full * bs].reshape(full, bs, nh, d).transpose(0, 2, 3, 1)
            v[at] = sv[: full * bs].reshape(full, bs, nh, d).transpose(0, 2, 1, 3)
        if rem:
            k[last, :, :, :rem] = sk[full * bs :].transpose(1, 2, 0)
            v[last, :, :rem, :] = sv[full * bs :].transpose(1, 0, 2)


def paged_to_chunk(
    layers: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor, out: torch.Tensor
) -> None:
    """Gather blocks into ``out`` ``[num_layers, 2, tokens, num_kv_heads, head_size]`` (``out``
    may be a pool view). ``tokens`` fills whole blocks except, for a prompt's tail chunk, the
    last one, of which only the first ``tokens % block_size`` slots are read."""
    if _on_host(layers, out):
        return _host_gather(layers, block_ids, out)
    idx = _index(block_ids, layers[0].device if layers else None)
    n_tok = out.shape[2]
    for li, layer in enumerate(layers):
        _, nh, bs, c2 = layer.shape
        d = c2 // 2
        full, rem = divmod(n_tok, bs)
        if len(block_ids) != full + (rem > 0):
            raise ValueError(f"out holds {n_tok} tokens but {len(block_ids)} blocks of {bs} were given")
        k, v = _halves(layer)
        if full:
            fi = idx[:full]
            out[li, 0, : full * bs].view(full, bs, nh, d).copy_(k.index_select(0, fi).permute(0, 3, 1, 2))
            out[li, 1, : full * bs].view(full, bs, nh, d).copy_(v.index_select(0, fi).permute(0, 2, 1, 3))
        if rem:
            last = int(block_ids[full])  # a host int: no device sync
            out[li, 0, full * bs :].copy_(k[last, :, :, :rem].permute(2, 0, 1))
            out[li, 1, full * bs :].copy_(v[last, :, :rem, :].permute(1, 0, 2))


def chunk_to_paged(
    chunk: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor
) -> None:
    """Scatter ``chunk`` ``[num_layers, 2, tokens, heads, head_size]`` into the given blocks of
    every layer (the inverse of :func:`paged_to_chunk`; a partial last block is written only
    in its first ``tokens % block_size`` slots, the rest of it is left as it was)."""
    if _on_host(layers, chunk):
        return _host_scatter(chunk, layers, block_ids)
    idx = _index(block_ids, layers[0].device if layers else None)
    n_tok = chunk.shape[2]
    for li, layer in enumerate(layers):
        _, nh, bs, c2 = layer.shape
        d = c2 // 2
        full, rem = divmod(n_tok, bs)
        if len(block_ids) != full + (rem > 0):
            raise ValueError(f"chunk holds {n_tok} tokens but {len(block_ids)} blocks of {bs} were given")
        k, v = _halves(layer)
        if full:
            fi = idx[:full]
            k.index_copy_(0, fi, chunk[li, 0, : full * bs].reshape(full, bs, nh, d).permute(0, 2, 3, 1))
            v.index_copy_(0, fi, chunk[li, 1, : full * bs].reshape(full, bs, nh, d).permute(0, 2, 1, 3))
        if rem:
            last = int(block_ids[full])  # a host int: no device sync
            k[last, :, :, :rem].copy_(chunk[li, 0, full * bs :].permute(1, 2, 0))
            v[last, :, :rem, :].copy_(chunk[li, 1, full * bs :].permute(1, 0, 2))
