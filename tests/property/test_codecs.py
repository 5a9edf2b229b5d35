"""Properties of the chunk codecs: lossless ones round-trip exactly; damage is always a
CorruptChunkError (a miss), never wrong KV; cachegen's error stays within its bins."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core import serde
from kvmesh.core.codecs.cachegen import CacheGenCodec
from kvmesh.core.keys import KVLayout
from kvmesh.errors import CorruptChunkError

FAST = settings(deadline=None, max_examples=40)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LOSSLESS = ["raw", "zstd", "safetensors"]
ALL = [*LOSSLESS, "cachegen"]


@st.composite
def chunks(draw: st.DrawFn) -> tuple[KVLayout, np.ndarray, np.ndarray]:
    layout = KVLayout(
        draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 4, 8])),
        draw(st.sampled_from(sorted(DTYPES))),
    )  # fmt: skip
    n = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31))
    scale = draw(st.sampled_from([1e-3, 1.0, 100.0]))
    gen = torch.Generator().manual_seed(seed)
    kv = (torch.randn(layout.shape(n), generator=gen) * scale).cumsum(2).to(DTYPES[layout.dtype])
    if draw(st.booleans()):
        kv.view(-1)[0] = 0.0
        kv.view(-1)[-1] = -0.0
    raw = kv.contiguous().view(torch.uint8).reshape(-1).numpy().copy()
    return layout, np.arange(n, dtype=np.uint32), raw


@FAST
@given(chunk=chunks(), codec=st.sampled_from(LOSSLESS))
def test_lossless_codecs_round_trip_exactly(
    chunk: tuple[KVLayout, np.ndarray, np.ndarray], codec: str
) -> None:
    layout, tokens, raw = chunk
    header, out = serde.decode(serde.encode_bytes("k", layout, tokens, raw, codec), expected_key="k")
    assert header.codec == codec
    assert bytes(out) == raw.tobytes()


@FAST
@given(chunk=chunks(), codec=st.sampled_from(ALL), data=st.data())
def test_damaged_chunk_is_a_corrupt_chunk_error(
    chunk: tuple[KVLayout, np.ndarray, np.ndarray], codec: str, data: st.DataObject
) -> None:
    layout, tokens, raw = chunk
    blob = bytearray(serde.encode_bytes("k", layout, tokens, raw, codec))
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if kind == "flip":
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        del blob[data.draw(st.integers(0, len(blob) - 1)) :]
    else:
        blob += bytes(data.draw(st.integers(1, 8)))
    try:
        serde.decode(bytes(blob), expected_key="k")
    except CorruptChunkError:
        return
    raise AssertionError(f"{kind} of a {codec} chunk was not detected")


@FAST
@given(chunk=chunks(), codec=st.sampled_from(["safetensors", "cachegen", "zstd"]), data=st.data())
def test_codec_given_garbage_raises_corrupt_chunk_error_only(
    chunk: tuple[KVLayout, np.ndarray, np.ndarray], codec: str, data: st.DataObject
) -> None:
    """Below the envelope's checksum: a codec handed damaged bytes either decodes to the
    right length or raises CorruptChunkError, never another exception."""
    layout, tokens, raw = chunk
    cod = serde.get_codec(codec)
    body = bytearray(bytes(cod.encode(memoryview(raw), layout, len(tokens))))
    for _ in range(data.draw(st.integers(1, 4))):
        if not body:
            break
        op = data.draw(st.sampled_from(["flip", "cut"]))
        pos = data.draw(st.integers(0, len(body) - 1))
        if op == "flip":
            body[pos] ^= 0xFF
        else:
            del body[pos:]
    try:
        out = cod.decode(memoryview(bytes(body)), layout, len(tokens), raw.nbytes)
    except CorruptChunkError:
        return
    assert memoryview(out).nbytes == raw.nbytes


@FAST
@given(chunk=chunks())
def test_cachegen_error_is_bounded_by_its_bins(chunk: tuple[KVLayout, np.ndarray, np.ndarray]) -> None:
    layout, tokens, raw = chunk
    codec = CacheGenCodec()
    out = codec.decode(
        memoryview(bytes(codec.encode(memoryview(raw), layout, len(tokens)))), layout, len(tokens), raw.nbytes
    )
    dt = DTYPES[layout.dtype]
    x = torch.frombuffer(bytearray(raw), dtype=dt).float().view(layout.num_layers * 2, len(tokens), -1)
    y = torch.frombuffer(bytearray(out), dtype=dt).float().view_as(x)
    # anchors: half an 8-bit step of the anchors' range; deltas: their bin (alpha=1 std)
    # plus anything beyond 31 bins (clipped); bounded by the section's own spread.
    spread = (x.amax(dim=1) - x.amin(dim=1)).amax()
    assert torch.isfinite(y).all()
    assert (y - x).abs().max() <= spread + 1e-2 * x.abs().max() + 1e-6


def test_cachegen_ans_and_zstd_entropy_coders_decode_the_same_kv() -> None:
    layout = KVLayout(4, 2, 16, "bfloat16")
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(layout.shape(64), generator=gen).cumsum(2).to(torch.bfloat16)
    raw = memoryview(kv.contiguous().view(torch.uint8).reshape(-1).numpy())
    outs = []
    for entropy in ("ans", "zstd"):
        codec = CacheGenCodec(entropy=entropy)
        enc = bytes(codec.encode(raw, layout, 64))
        outs.append(bytes(CacheGenCodec().decode(memoryview(enc), layout, 64, raw.nbytes)))
        assert len(enc) < raw.nbytes / 2
    assert outs[0] == outs[1]
