"""Properties of the chunk codecs: lossless ones round-trip exactly; damage is always a
CorruptChunkError (a miss), never wrong KV; cachegen's error stays within its bins, and its
compiled decode kernel gives torch's arithmetic of the same steps, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core import serde
from kvmesh.core.codecs import cachegen, planes
from kvmesh.core.codecs.base import ZstdPlaneCodec
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
        draw(st.sampled_from(sorted(DTYPES))), kv_planes=draw(st.sampled_from([1, 2])),
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
    x = (
        torch.frombuffer(bytearray(raw), dtype=dt)
        .float()
        .view(layout.num_layers * layout.kv_planes, len(tokens), -1)
    )
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


def _torch_dequantise(
    a8: np.ndarray, d8: np.ndarray, side: np.ndarray, q: int, n_tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """The decoder's steps in torch: each group's anchor, then its deltas added token by
    token in float32 (the encoder's closed-loop reconstruction): the reference."""
    sections, groups, channels = a8.shape
    g = d8.shape[1] // groups + 1
    amin, step, dbin = (torch.from_numpy(side[i]) for i in range(3))
    rec = amin[:, None] + torch.from_numpy(a8.copy()).float() * step[:, None]
    d = torch.from_numpy(d8.copy()).float().sub_(q).view(sections, groups, g - 1, channels)
    full = torch.empty(sections, groups, g, channels)
    full[:, :, 0] = rec
    for j in range(1, g):
        rec = rec + d[:, :, j - 1] * dbin[:, None]
        full[:, :, j] = rec
    return full.view(sections, groups * g, channels)[:, :n_tokens].to(dtype)


SIDE_VALUES = st.one_of(
    st.floats(-1e3, 1e3, width=32),
    st.sampled_from([0.0, -0.0, 1e-8, 3.0e38, -3.0e38, float("inf"), float("-inf"), float("nan")]),
)


@FAST
@given(
    sections=st.integers(1, 4), groups=st.integers(1, 3), g=st.integers(2, 17), channels=st.integers(1, 9),
    q=st.integers(1, 127), dtype=st.sampled_from([torch.bfloat16, torch.float32]), data=st.data(),
)  # fmt: skip
def test_cachegen_kernel_is_torchs_arithmetic_bit_for_bit(
    sections: int, groups: int, g: int, channels: int, q: int, dtype: torch.dtype, data: st.DataObject
) -> None:
    n_tokens = data.draw(st.integers(1, groups * g))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    a8 = rng.integers(0, 256, (sections, groups, channels), dtype=np.uint8)
    d8 = rng.integers(0, 2 * q + 1, (sections, groups * (g - 1), channels), dtype=np.uint8)
    side = rng.normal(0, rng.choice([1e-3, 1.0, 1e3]), (3, sections, channels)).astype(np.float32)
    specials = data.draw(st.lists(SIDE_VALUES, max_size=min(3, side.size)))
    side.reshape(-1)[: len(specials)] = specials  # extremes, infinities and NaN among the first
    want = _torch_dequantise(a8, d8, side, q, n_tokens, dtype)
    bf16 = dtype == torch.bfloat16
    out = np.empty((sections, n_tokens, channels), dtype=np.uint16 if bf16 else np.float32)
    args = (cachegen._NO_F32, out) if bf16 else (out, cachegen._NO_BF16)
    assert cachegen._dequantise(a8, d8, side, q, n_tokens, *args)
    got = torch.from_numpy(out).view(dtype)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)  # a NaN is a NaN: torch's own paths differ in its bits
    bits = torch.int16 if bf16 else torch.int32
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])


def test_cachegen_delta_out_of_range_is_corrupt_even_in_the_padding() -> None:
    """A symbol above 2 * half_range, in the last group's padding (decoded, never
    written), still makes the payload corrupt: the kernel checks every symbol."""
    a8 = np.zeros((1, 1, 2), dtype=np.uint8)
    d8 = np.zeros((1, 3, 2), dtype=np.uint8)
    d8[0, 2, 1] = 9
    side = np.ones((3, 1, 2), dtype=np.float32)
    out = np.empty((1, 2, 2), dtype=np.uint16)
    assert not cachegen._dequantise(a8, d8, side, 4, 2, cachegen._NO_F32, out)
    d8[0, 2, 1] = 8
    assert cachegen._dequantise(a8, d8, side, 4, 2, cachegen._NO_F32, out)


def _torch_quantise(x: torch.Tensor, codec: CacheGenCodec, alphas: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The encoder's steps in torch (what the codec ran before its kernels): side info,
    symbols, and the closed loop's reconstruction of every token, for one chunk
    ``x[sections, tokens, channels]`` (float32), as the reference."""
    sections, n, channels = x.shape
    g, q = codec.group, codec.half_range
    ng = -(-n // g)
    xp = torch.cat([x, x[:, -1:].expand(sections, ng * g - n, channels)], dim=1).view(
        sections, ng, g, channels
    )
    anchors = xp[:, :, 0]
    amin = anchors.amin(dim=1)
    step = (anchors.amax(dim=1) - amin) / 255.0
    dbin = alphas[:, None] * (x.std(dim=1) if n > 1 else x.abs().amax(dim=1))
    side = torch.stack([amin, step, dbin]).to(torch.float16)
    amin, step, dbin = side[0].float(), side[1].float(), side[2].float().clamp_min(1e-8)
    a_sym = ((anchors - amin[:, None]) / step.clamp_min(1e-8)[:, None]).round_().clamp_(0, 255)
    rec = amin[:, None] + a_sym * step[:, None]
    d_sym = torch.empty(sections, ng, g - 1, channels)
    recs = torch.empty(sections, ng, g, channels)
    recs[:, :, 0] = rec
    for j in range(1, g):
        qj = ((xp[:, :, j] - rec) / dbin[:, None]).round_().clamp_(-q, q)
        rec = rec + qj * dbin[:, None]
        d_sym[:, :, j - 1] = qj
        recs[:, :, j] = rec
    recs = recs.view(sections, ng * g, channels)[:, :n]
    return side, a_sym.to(torch.uint8), d_sym.add_(q).to(torch.uint8), recs


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
@pytest.mark.parametrize("planes,n,group", [(2, 1, 16), (2, 37, 16), (1, 64, 5), (2, 100, 2)])
def test_cachegen_kernels_encode_torchs_payload_byte_for_byte(
    dtype: str, planes: int, n: int, group: int
) -> None:
    """Finite KV: the compiled encoder writes the payload the torch steps wrote (side info
    and every symbol), and the compiled decoder gives back exactly the encoder's
    closed-loop reconstruction, in the chunk's dtype."""
    layout = KVLayout(4, 2, 8, dtype, kv_planes=planes)
    gen = torch.Generator().manual_seed(n * 31 + group)
    kv = (torch.randn(layout.shape(n), generator=gen) * 3).cumsum(2).to(DTYPES[dtype])
    raw = kv.contiguous().view(torch.uint8).reshape(-1).numpy()
    codec = CacheGenCodec(group=group)
    payload = bytes(codec.encode(memoryview(raw), layout, n))
    sections = layout.num_layers * planes
    alphas = torch.tensor(
        [cachegen.layer_alpha(codec.alpha, s // planes, layout.num_layers) for s in range(sections)]
    )
    side, a8, d8, recs = _torch_quantise(kv.float().reshape(sections, n, -1), codec, alphas)
    head = cachegen._HEAD.size
    assert payload[head : head + side.numel() * 2] == side.numpy().tobytes()
    body = zstandard.ZstdDecompressor().decompress(payload[head + side.numel() * 2 :])
    assert body == a8.numpy().tobytes() + d8.numpy().tobytes()
    out = codec.decode(memoryview(payload), layout, n, raw.nbytes)
    assert bytes(out) == recs.to(DTYPES[dtype]).contiguous().view(torch.uint8).numpy().tobytes()


def test_cachegen_kernels_leave_the_gil() -> None:
    """A tier's I/O thread coding a chunk must not hold vLLM's forward loop."""
    for kernel in (cachegen._dequantise, cachegen._encode_stats, cachegen._quantise):
        assert kernel.targetoptions["nogil"] is True


@FAST
@given(itemsize=st.sampled_from([1, 2, 4]), n=st.integers(0, 300), offset=st.integers(0, 3), data=st.data())
def test_byte_planes_are_numpys_transpose_and_back(
    itemsize: int, n: int, offset: int, data: st.DataObject
) -> None:
    """The zstd codec's compiled plane split is the transpose it replaced, byte for byte,
    for aligned and unaligned, writable and read-only buffers; the merge undoes it."""
    body = data.draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))
    buf = bytes(offset) + body  # the elements start `offset` bytes into the buffer
    raw = np.frombuffer(buf, dtype=np.uint8)[offset:]
    want = np.ascontiguousarray(raw.reshape(-1, itemsize).T).reshape(-1)
    got = planes.split_planes(raw, itemsize)
    assert got.tobytes() == want.tobytes()
    assert planes.merge_planes(np.frombuffer(want.tobytes(), dtype=np.uint8), itemsize).tobytes() == body


def test_zstd_codec_reads_payloads_of_any_level() -> None:
    """The default level changed (3 -> 1): a payload written at another level still decodes."""
    layout = KVLayout(2, 2, 8, "bfloat16")
    raw = memoryview(
        torch.randn(layout.shape(33)).to(torch.bfloat16).contiguous().view(torch.uint8).numpy().reshape(-1)
    )
    for level in (1, 3, 19):
        blob = ZstdPlaneCodec(level=level).encode(raw, layout, 33)
        assert bytes(ZstdPlaneCodec().decode(memoryview(bytes(blob)), layout, 33, raw.nbytes)) == bytes(raw)


def test_cachegen_group_is_capped_at_the_chunk() -> None:
    """A group longer than the chunk only pads it: the encoder writes the chunk's length
    instead (a payload naming a longer one is refused: tests/security/test_codec_bounds.py)."""
    layout = KVLayout(2, 2, 8, "bfloat16")
    kv = torch.randn(layout.shape(20)).cumsum(2).to(torch.bfloat16)
    raw = memoryview(kv.contiguous().view(torch.uint8).numpy().reshape(-1))
    payload = bytearray(CacheGenCodec(group=64).encode(raw, layout, 20))
    assert cachegen._HEAD.unpack_from(payload)[2] == 20
    out = CacheGenCodec().decode(memoryview(bytes(payload)), layout, 20, raw.nbytes)
    assert memoryview(out).nbytes == raw.nbytes
