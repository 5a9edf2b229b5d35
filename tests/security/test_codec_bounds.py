"""A payload's own parameters must not size the decoder's allocations beyond a small
multiple of the chunk: cachegen's header names its group, and the decoder allocates
symbols for whole groups. A hostile writer of a shared tier (no fleet key: the drop-in
case) could name a group of 1,024 for a 1-token chunk: 512x its bfloat16 KV in symbols.
The decoder refuses a group longer than the chunk (or 16, the default) before allocating."""

from __future__ import annotations

import struct

import pytest
import torch

from kvmesh.core.codecs import cachegen
from kvmesh.core.codecs.cachegen import CacheGenCodec
from kvmesh.core.keys import KVLayout
from kvmesh.errors import CorruptChunkError


def test_cachegen_payload_naming_a_group_longer_than_its_chunk_is_corrupt() -> None:
    layout = KVLayout(2, 2, 8, "bfloat16")
    one = memoryview(
        torch.randn(layout.shape(1)).to(torch.bfloat16).contiguous().view(torch.uint8).numpy().reshape(-1)
    )
    short = bytearray(CacheGenCodec().encode(one, layout, 1))
    assert cachegen._HEAD.unpack_from(short)[2] == 16  # the default group stands for a short chunk
    struct.pack_into("<H", short, 4, 1024)
    with pytest.raises(CorruptChunkError, match="invalid parameters"):
        CacheGenCodec().decode(memoryview(bytes(short)), layout, 1, one.nbytes)
