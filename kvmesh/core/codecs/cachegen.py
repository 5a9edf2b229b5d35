"""``cachegen``: a CacheGen-style lossy KV codec (after Liu et al., SIGCOMM'24). Opt-in.

What it keeps from CacheGen: KV is coded per layer and K/V, token-wise *deltas* against
anchor tokens (neighbouring tokens' KV is similar), quantised per channel with coarser bins
in deeper layers (early layers matter more to the output), then entropy coded.

Steps, for each (layer, K/V) section ``x[tokens, channels]`` of the chunk (each layer's latent
plane for MLA), in numba-compiled kernels that release the GIL:

1. anchors: every ``group``-th token, 8-bit quantised per channel between the anchors'
   min and max;
2. deltas: every other token minus the *decoded* previous token of its group (closed-loop
   DPCM, so quantisation error does not add up along the group and decoding is a cumsum),
   quantised per channel with bin width ``alpha_layer * std(channel)``, clipped to
   ``±half_range`` bins (the relative error is about ``alpha / 3.5``);
3. entropy coding of the symbols: ``ans`` — rANS from the ``constriction`` library with one
   categorical model for the anchors, one for the early layers' deltas and one for the rest
   (their histograms travel in the payload) — or ``zstd``
   (zstd's Huffman/FSE stages over the symbol bytes; far faster to decode).

Payload (little-endian): ``b"CG2"``, entropy id (u8), group (u16), half_range (u16),
sections (u32), tokens (u32), channels (u32), then per-section side info (float16 anchor
min, anchor step and delta bin per channel: float32 when a value exceeds float16's range),
then the entropy-coded symbols. A payload that does not parse is a
:class:`~kvmesh.errors.CorruptChunkError`: a miss, never wrong KV (the envelope's checksum
is checked before the codec runs).
"""

from __future__ import annotations

import struct

import numpy as np
import torch
import zstandard

from kvmesh.core.codecs.base import zstd_bound, zstd_decompress
from kvmesh.core.jit import kernel, readonly
from kvmesh.core.keys import KVLayout
from kvmesh.core.memory import torch_dtype
from kvmesh.errors import ConfigError, CorruptChunkError

MAGIC = b"CG2"
_HEAD = struct.Struct("<3sBHHIII")
ENTROPY = {"ans": 0, "zstd": 1}
_F16_MAX = 60000.0
_MIN_BIN = 1e-8
MAX_GROUP = 1024
# A group longer than its chunk only pads it: the encoder caps the group at the chunk's
# length (or 16, the default group), and the decoder refuses a longer one. So the symbols a
# payload makes the decoder allocate stay within ~2x the chunk's tokens (+15), whatever
# group its header names (1,024 on a 1-token chunk would be 512x its bfloat16 KV).
SHORT_GROUP = 16


def _early_layers(num_layers: int) -> int:
    return max(1, num_layers // 4)


def layer_alpha(alpha: float, layer: int, num_layers: int) -> float:
    """Bin width in delta standard deviations: half as wide in the first quarter of layers."""
    return alpha * (0.5 if layer < _early_layers(num_layers) else 1.0)


class CacheGenCodec:
    name = "cachegen"
    lossless = False

    def __init__(self, group: int = 16, alpha: float = 0.1, half_range: int = 127, entropy: str = "zstd"):
        if entropy not in ENTROPY:
            raise ConfigError(f"cachegen entropy coder {entropy!r}; valid: {', '.join(ENTROPY)}")
        if not 2 <= group <= MAX_GROUP or not 1 <= half_range <= 127 or alpha <= 0:
            raise ConfigError(f"cachegen: group in [2, {MAX_GROUP}], half_range in [1, 127], alpha > 0")
        self.group, self.alpha, self.half_range, self.entropy = group, alpha, half_range, entropy
        _warm_up()

    # ---- encode -------------------------------------------------------------------------
    def encode(self, data: memoryview, layout: KVLayout, n_tokens: int) -> bytes:
        sections = layout.num_layers * layout.kv_planes
        channels = layout.num_kv_heads * layout.head_size
        if n_tokens < 1:
            raise ValueError("cachegen codes chunks of at least one token")
        g, q = min(self.group, max(SHORT_GROUP, n_tokens)), self.half_range
        ng = -(-n_tokens // g)
        x32, x16 = _as_rows(data, layout.dtype, (sections, n_tokens, channels))
        amin = np.empty((sections, channels), dtype=np.float32)
        amax, std = np.empty_like(amin), np.empty_like(amin)
        _encode_stats(x32, x16, g, n_tokens, amin, amax, std)
        # Infinite or NaN KV (garbage in) makes NaN side info, not a warning: the payload
        # still decodes, to whatever it holds; a value beyond float16 makes it float32.
        with np.errstate(invalid="ignore", over="ignore"):
            step = (amax - amin) / np.float32(255.0)
            alphas = [
                layer_alpha(self.alpha, s // layout.kv_planes, layout.num_layers) for s in range(sections)
            ]
            dbin = np.asarray(alphas, dtype=np.float32)[:, None] * std
            wide = bool(max(np.abs(amin).max(), step.max(), dbin.max()) > _F16_MAX)
            side = np.stack([amin, step, dbin]).astype(np.float32 if wide else np.float16)
        rounded = side.astype(np.float32)  # what the decoder will read
        np.maximum(rounded[2], np.float32(_MIN_BIN), out=rounded[2])
        symbols = np.empty(sections * ng * g * channels, dtype=np.uint8)
        a8, d8 = _split(symbols, ((sections, ng, channels), (sections, ng * (g - 1), channels)))
        _quantise(x32, x16, rounded, q, n_tokens, a8, d8)
        head = _HEAD.pack(
            MAGIC, ENTROPY[self.entropy] | (0x80 if wide else 0), g, q, sections, n_tokens, channels
        )
        if self.entropy == "ans":
            body = _ans_encode(a8, d8, q, layout.kv_planes * _early_layers(layout.num_layers))
        else:  # plain zstd, level 1: its literal stage is a Huffman coder over the symbol bytes
            body = zstandard.ZstdCompressor(level=1).compress(symbols.data)
        return head + side.tobytes() + body

    def max_encoded(self, layout: KVLayout, n_tokens: int) -> int:
        """Header, side info (float32 at most), and the entropy-coded symbols of the padded
        groups: zstd's bound over one byte a symbol, or ANS at worst 32 bits a symbol."""
        sections = layout.num_layers * layout.kv_planes
        channels = layout.num_kv_heads * layout.head_size
        symbols = sections * -(-n_tokens // self.group) * self.group * channels
        body = zstd_bound(symbols) if self.entropy == "zstd" else 4 * symbols + 4096
        return _HEAD.size + 3 * sections * channels * 4 + body

    # ---- decode -------------------------------------------------------------------------
    def decode(self, data: memoryview, layout: KVLayout, n_tokens: int, raw_len: int) -> memoryview:
        try:
            return self._decode(data, layout, n_tokens, raw_len)
        except CorruptChunkError:
            raise
        except Exception as exc:  # a damaged stream can fail anywhere in the decoders
            raise CorruptChunkError(f"cachegen payload does not decode: {exc}") from None

    def _decode(self, data: memoryview, layout: KVLayout, n_tokens: int, raw_len: int) -> memoryview:
        if data.nbytes < _HEAD.size:
            raise CorruptChunkError("cachegen payload shorter than its header")
        magic, ent, g, q, sections, tokens, channels = _HEAD.unpack_from(data)
        if magic != MAGIC:
            raise CorruptChunkError(f"cachegen payload has bad magic {magic!r}")
        if (sections, tokens, channels) != (
            layout.num_layers * layout.kv_planes,
            n_tokens,
            layout.num_kv_heads * layout.head_size,
        ):
            raise CorruptChunkError("cachegen payload's shape does not match the chunk header")
        # The group sets how many padded tokens are decoded: no longer than the chunk (see
        # SHORT_GROUP), so the symbol arrays stay within a small multiple of its own size.
        if not 2 <= g <= min(MAX_GROUP, max(SHORT_GROUP, n_tokens)) or q < 1 or q > 127 or n_tokens < 1:
            raise CorruptChunkError("cachegen payload has invalid parameters")
        side_dtype = np.float32 if ent & 0x80 else np.float16
        n_side = 3 * sections * channels
        pos = _HEAD.size
        side_np = np.frombuffer(data, dtype=side_dtype, count=n_side, offset=pos)
        pos += side_np.nbytes
        side = side_np.astype(np.float32).reshape(3, sections, channels)
        ng = -(-n_tokens // g)
        shapes = ((sections, ng, channels), (sections, ng * (g - 1), channels))
        if ent & 0x7F == ENTROPY["ans"]:
            a8, d8 = _ans_decode(data[pos:], shapes, q, layout.kv_planes * _early_layers(layout.num_layers))
        elif ent & 0x7F == ENTROPY["zstd"]:
            a8, d8 = _zstd_decode(data[pos:], shapes)
        else:
            raise CorruptChunkError(f"cachegen payload has unknown entropy coder {ent & 0x7F}")
        n_out = sections * n_tokens * channels
        if n_out * layout.itemsize != raw_len:
            raise CorruptChunkError("cachegen payload decoded to the wrong length")
        dtype = layout.dtype
        out = np.empty((sections, n_tokens, channels), dtype=np.uint16 if dtype == "bfloat16" else np.float32)
        bf16 = out if dtype == "bfloat16" else _NO_BF16
        f32 = _NO_F32 if dtype == "bfloat16" else out
        if not _dequantise(a8, d8, side, q, n_tokens, f32, bf16):
            raise CorruptChunkError("cachegen delta symbol out of range")
        if dtype in ("bfloat16", "float32"):
            return out.reshape(-1).data.cast("B")
        # float16, 8-bit floats and integers: one cast of the float32 result
        kv = torch.from_numpy(out).to(torch_dtype(dtype)).view(torch.uint8).reshape(-1).numpy()
        return kv.data


_NO_F32 = np.zeros((0, 0, 0), dtype=np.float32)
_NO_BF16 = np.zeros((0, 0, 0), dtype=np.uint16)


@kernel
def _dequantise(
    a8: np.ndarray, d8: np.ndarray, side: np.ndarray, q: int, n_tokens: int, f32: np.ndarray, bf16: np.ndarray
) -> bool:
    """The decoder's one pass: anchors dequantised, each group's deltas added up, every
    token written once — as float32 into ``f32``, or as bfloat16 bits into ``bf16`` when
    that is not empty. Returns False if a delta symbol is out of range.

    The running value is the encoder's own reconstruction, bit for bit: ``amin + a * step``
    then ``+ (d - q) * dbin`` token by token, in float32 as :func:`_quantise` computes it
    (closed loop: the decoder ends where the encoder assumed it would). bfloat16 by
    round-to-nearest-even, as ``c10::BFloat16`` does (NaN as a quiet NaN).
    """
    sections, groups, channels = a8.shape
    gm1 = d8.shape[1] // groups
    g = gm1 + 1
    to_bf16 = bf16.shape[0] > 0
    row = np.empty(channels, np.float32)
    bits = row.view(np.uint32)
    fq = np.float32(q)
    top = np.uint8(0)
    for s in range(sections):
        amin, step, dbin = side[0, s], side[1, s], side[2, s]
        for k in range(groups):
            t0 = k * g
            for j in range(g):
                if j == 0:
                    ak = a8[s, k]
                    for c in range(channels):
                        row[c] = amin[c] + np.float32(ak[c]) * step[c]
                else:
                    dj = d8[s, k * gm1 + j - 1]
                    for c in range(channels):
                        top = max(top, dj[c])
                        row[c] = row[c] + (np.float32(dj[c]) - fq) * dbin[c]
                t = t0 + j
                if t >= n_tokens:
                    continue  # the padding of the last group: range-checked, not written
                if to_bf16:
                    o = bf16[s, t]
                    for c in range(channels):
                        b = bits[c]
                        r = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
                        o[c] = (
                            np.uint16(0x7FC0)
                            if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
                            else np.uint16(r)
                        )
                else:
                    f32[s, t, :] = row
    return bool(top <= 2 * q)


def _split(flat: np.ndarray, shapes: tuple[tuple[int, int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
    """The anchor and delta symbol arrays as views of one flat buffer (anchors first)."""
    split = int(np.prod(shapes[0]))
    return flat[:split].reshape(shapes[0]), flat[split:].reshape(shapes[1])


_NO_X32 = readonly(np.zeros((0, 0, 0), dtype=np.float32))
_NO_X16 = readonly(np.zeros((0, 0, 0), dtype=np.uint16))


def _as_rows(data: memoryview, dtype: str, shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The chunk as the encoder's kernels read it: float32 as it is, bfloat16 as its bits
    (widened in the kernel), any other dtype cast to float32 first."""
    if dtype == "bfloat16":
        return _NO_X32, readonly(np.frombuffer(data, dtype=np.uint16).reshape(shape))
    if dtype == "float32":
        return readonly(np.frombuffer(data, dtype=np.float32).reshape(shape)), _NO_X16
    x = torch.frombuffer(data, dtype=torch.uint8).view(torch_dtype(dtype)).float().numpy()
    return readonly(x.reshape(shape)), _NO_X16


@kernel
def _load_row(x32: np.ndarray, x16: np.ndarray, s: int, t: int, row: np.ndarray, bits: np.ndarray) -> None:
    if x16.shape[0] > 0:
        src = x16[s, t]
        for c in range(row.shape[0]):
            bits[c] = np.uint32(src[c]) << np.uint32(16)
    else:
        row[:] = x32[s, t]


@kernel
def _encode_stats(
    x32: np.ndarray,
    x16: np.ndarray,
    g: int,
    n_tokens: int,
    amin: np.ndarray,
    amax: np.ndarray,
    std: np.ndarray,
) -> None:
    """Per section and channel: the anchors' (every ``g``-th token's) min and max, and the
    tokens' standard deviation (unbiased; the largest magnitude for a single token). One
    pass, sums in float64 shifted by the first token (no cancellation)."""
    sections, channels = amin.shape
    row = np.empty(channels, np.float32)
    bits = row.view(np.uint32)
    first = np.empty(channels, np.float64)
    s1 = np.empty(channels, np.float64)
    s2 = np.empty(channels, np.float64)
    for s in range(sections):
        _load_row(x32, x16, s, 0, row, bits)
        for c in range(channels):
            first[c] = row[c]
            amin[s, c] = row[c]
            amax[s, c] = row[c]
            s1[c] = 0.0
            s2[c] = 0.0
        for t in range(1, n_tokens):
            _load_row(x32, x16, s, t, row, bits)
            for c in range(channels):
                d = row[c] - first[c]
                s1[c] += d
                s2[c] += d * d
            if t % g == 0:
                for c in range(channels):
                    amin[s, c] = min(amin[s, c], row[c])
                    amax[s, c] = max(amax[s, c], row[c])
        for c in range(channels):
            if n_tokens > 1:
                var = (s2[c] - s1[c] * s1[c] / n_tokens) / (n_tokens - 1)
                std[s, c] = np.float32(np.sqrt(max(var, 0.0)))
            else:
                std[s, c] = abs(first[c])


@kernel
def _quantise(
    x32: np.ndarray, x16: np.ndarray, side: np.ndarray, q: int, n_tokens: int, a8: np.ndarray, d8: np.ndarray
) -> None:
    """Anchors 8-bit between their min and max; every other token's delta against the
    *decoded* previous token of its group (closed loop), rounded half to even and clipped
    to ``±q`` bins, stored as ``delta + q``. The last group is padded with the last token.
    A NaN quantises to the middle (garbage in, a decodable payload out)."""
    sections, groups, channels = a8.shape
    gm1 = d8.shape[1] // groups
    g = gm1 + 1
    row = np.empty(channels, np.float32)
    bits = row.view(np.uint32)
    rec = np.empty(channels, np.float32)
    fq = np.float32(q)
    for s in range(sections):
        amin, step, dbin = side[0, s], side[1, s], side[2, s]
        for k in range(groups):
            t0 = k * g
            _load_row(x32, x16, s, t0, row, bits)
            ak = a8[s, k]
            for c in range(channels):
                a = np.rint((row[c] - amin[c]) / max(step[c], np.float32(_MIN_BIN)))
                if not a >= 0.0:
                    a = np.float32(0.0)
                if a > 255.0:
                    a = np.float32(255.0)
                ak[c] = np.uint8(a)
                rec[c] = amin[c] + a * step[c]
            for j in range(1, g):
                _load_row(x32, x16, s, min(t0 + j, n_tokens - 1), row, bits)
                dj = d8[s, k * gm1 + j - 1]
                for c in range(channels):
                    v = np.rint((row[c] - rec[c]) / dbin[c])
                    if not v >= -fq:
                        v = -fq if v < 0.0 else np.float32(0.0)  # NaN: no step
                    if v > fq:
                        v = fq
                    rec[c] = rec[c] + v * dbin[c]
                    dj[c] = np.uint8(v + fq)


_warm = False


def _warm_up() -> None:
    """Compile the kernels (or load them from numba's cache on disk) when the codec is
    made, at a tier's open, rather than inside the first store or load: one round trip of
    a float32 and a bfloat16 token."""
    global _warm
    if not _warm:
        codec = CacheGenCodec.__new__(CacheGenCodec)
        codec.group, codec.alpha, codec.half_range, codec.entropy = 2, 0.1, 127, "zstd"
        for dtype in ("float32", "bfloat16"):
            layout = KVLayout(1, 1, 1, dtype, kv_planes=1)
            raw = memoryview(bytes(layout.bytes_per_token))
            codec.decode(memoryview(codec.encode(raw, layout, 1)), layout, 1, raw.nbytes)
        _warm = True


def _zstd_decode(body: memoryview, shapes: tuple[tuple[int, int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
    size = sum(int(np.prod(s)) for s in shapes)
    return _split(np.frombuffer(zstd_decompress(body, size, "cachegen zstd stream"), dtype=np.uint8), shapes)


def _model(hist: np.ndarray) -> object:
    import constriction

    p = hist.astype(np.float64) + 1e-3  # every symbol encodable; same on both sides
    return constriction.stream.model.Categorical(p / p.sum(), perfect=False)


def _streams(a8: np.ndarray, d8: np.ndarray, early: int) -> list[tuple[np.ndarray, int]]:
    """The symbol groups that share one model: anchors; deltas of the early layers (finer
    bins, wider symbol spread); deltas of the rest. One histogram each keeps the model
    cost negligible even for small chunks."""
    return [(a8, 256), (d8[:early], 0), (d8[early:], 0)]


def _ans_encode(a8: np.ndarray, d8: np.ndarray, q: int, early: int) -> bytes:
    import constriction

    parts: list[bytes] = []
    for arr, k in _streams(a8, d8, early):
        k = k or 2 * q + 1
        sym = arr.reshape(-1).astype(np.int32)
        hist = np.bincount(sym, minlength=k).astype("<u4")
        coder = constriction.stream.stack.AnsCoder()
        if sym.size:
            coder.encode_reverse(sym, _model(hist))
        words = coder.get_compressed()
        parts += [hist.tobytes(), struct.pack("<I", words.size), words.astype("<u4").tobytes()]
    return b"".join(parts)


def _ans_decode(
    body: memoryview, shapes: tuple[tuple[int, int, int], ...], q: int, early: int
) -> tuple[np.ndarray, np.ndarray]:
    import constriction

    flat = np.empty(sum(int(np.prod(s)) for s in shapes), dtype=np.uint8)
    a8, d8 = _split(flat, shapes)
    pos = 0
    for arr, k in _streams(a8, d8, early):
        k = k or 2 * q + 1
        hist = np.frombuffer(body, dtype="<u4", count=k, offset=pos)
        pos += 4 * k
        (nwords,) = struct.unpack_from("<I", body, pos)
        pos += 4
        words = np.frombuffer(body, dtype="<u4", count=nwords, offset=pos).astype(np.uint32)
        pos += 4 * nwords
        if arr.size:
            sym = constriction.stream.stack.AnsCoder(words).decode(_model(hist), arr.size)
            if sym.size != arr.size or int(sym.max(initial=0)) >= k:
                raise CorruptChunkError("cachegen ANS stream decodes to the wrong symbols")
            arr[...] = sym.reshape(arr.shape)
    if pos != body.nbytes:
        raise CorruptChunkError("cachegen payload has trailing bytes")
    return _split(readonly(flat), shapes)
