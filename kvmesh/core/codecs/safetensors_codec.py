"""``safetensors``: the chunk's KV as a safetensors blob (one tensor ``kv`` of the chunk's
shape and dtype), for tools that read safetensors. Lossless; it sits inside kvmesh's
verified envelope like every payload, so the envelope's checksums still guard it."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from kvmesh.core.keys import KVLayout
from kvmesh.core.memory import torch_dtype
from kvmesh.errors import CorruptChunkError

TENSOR_NAME = "kv"
HEADER_ROOM = 4096  # safetensors' JSON header of one tensor, padded: ~100 bytes


class SafetensorsCodec:
    name = "safetensors"
    lossless = True

    def encode(self, data: memoryview, layout: KVLayout, n_tokens: int) -> bytes:
        from safetensors.torch import save

        with warnings.catch_warnings():  # a read-only payload: save() only reads the tensor
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            kv = torch.frombuffer(data, dtype=torch.uint8).view(torch_dtype(layout.dtype))
        return save({TENSOR_NAME: kv.view(layout.shape(n_tokens))})

    def max_encoded(self, layout: KVLayout, n_tokens: int) -> int:
        return n_tokens * layout.bytes_per_token + HEADER_ROOM

    def decode(self, data: memoryview, layout: KVLayout, n_tokens: int, raw_len: int) -> memoryview:
        # safetensors checks every tensor's offsets against the blob, and the envelope has
        # bounded the blob by max_encoded: nothing here allocates more than the blob's size.
        from safetensors.torch import load

        try:
            tensors: dict[str, Any] = load(bytes(data))
        except Exception as exc:  # safetensors raises its own SafetensorError and others
            raise CorruptChunkError(f"safetensors payload does not load: {exc}") from None
        kv = tensors.get(TENSOR_NAME)
        want = layout.shape(n_tokens)
        if (
            set(tensors) != {TENSOR_NAME}
            or not isinstance(kv, torch.Tensor)
            or kv.dtype != torch_dtype(layout.dtype)
            or tuple(kv.shape) != want
        ):
            raise CorruptChunkError(f"safetensors payload does not hold one {layout.dtype} tensor {want}")
        out = kv.contiguous().view(torch.uint8).reshape(-1).numpy()
        if out.nbytes != raw_len:
            raise CorruptChunkError("safetensors payload has the wrong length")
        return out.data
