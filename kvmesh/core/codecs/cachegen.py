"""``cachegen``: a CacheGen-style lossy KV codec (after Liu et al., SIGCOMM'24). Opt-in.

What it keeps from CacheGen: KV is coded per layer and K/V, token-wise *deltas* against
anchor tokens (neighbouring tokens' KV is similar), quantised per channel with coarser bins
in deeper layers (early layers matter more to the output), then entropy coded.

Steps, for each (layer, K/V) section ``x[tokens, channels]`` of the chunk:

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
from kvmesh.core.keys import KVLayout
from kvmesh.core.memory import torch_dtype
from kvmesh.errors import ConfigError, CorruptChunkError

MAGIC = b"CG2"
_HEAD = struct.Struct("<3sBHHIII")
ENTROPY = {"ans": 0, "zstd": 1}
_F16_MAX = 60000.0
_MIN_BIN = 1e-8
MAX_GROUP = 1024


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

    # ---- encode -------------------------------------------------------------------------
    def encode(self, data: memoryview, layout: KVLayout, n_tokens: int) -> bytes:
        sections = layout.num_layers * 2
        channels = layout.num_kv_heads * layout.head_size
        raw = torch.frombuffer(data, dtype=torch.uint8).view(torch_dtype(layout.dtype))
        x = raw.view(sections, n_tokens, channels).float()
        g, q = self.group, self.half_range
        ng = -(-n_tokens // g)
        # pad the last group by repeating the last token: its deltas are 0, nearly free
        xp = torch.cat([x, x[:, -1:].expand(sections, ng * g - n_tokens, channels)], dim=1)
        xp = xp.view(sections, ng, g, channels)
        anchors = xp[:, :, 0]  # [S, groups, C]
        amin = anchors.amin(dim=1)
        step = (anchors.amax(dim=1) - amin) / 255.0
        std = x.std(dim=1) if n_tokens > 1 else x.abs().amax(dim=1)
        alphas = torch.tensor([layer_alpha(self.alpha, s // 2, layout.num_layers) for s in range(sections)])
        dbin = alphas[:, None] * std
        wide = bool(max(amin.abs().max(), step.max(), dbin.max()) > _F16_MAX)
        side_dtype = torch.float32 if wide else torch.float16
        amin, step = amin.to(side_dtype).float(), step.to(side_dtype).float()
        dbin = dbin.to(side_dtype).float().clamp_min(_MIN_BIN)
        a_sym = ((anchors - amin[:, None]) / step.clamp_min(_MIN_BIN)[:, None]).round_().clamp_(0, 255)
        rec = amin[:, None] + a_sym * step[:, None]  # the decoder's anchors
        # Closed loop: each token's delta is taken against the *decoded* previous token, so
        # quantisation error never accumulates along the group (decoding is a cumsum).
        d_sym = torch.empty(sections, ng, g - 1, channels)
        bins = dbin[:, None]
        for j in range(1, g):
            qj = ((xp[:, :, j] - rec) / bins).round_().clamp_(-q, q)
            rec = rec + qj * bins
            d_sym[:, :, j - 1] = qj
        d_sym = d_sym.add_(q).view(sections, ng * (g - 1), channels)
        side = torch.stack([amin, step, dbin]).to(side_dtype)
        head = _HEAD.pack(
            MAGIC, ENTROPY[self.entropy] | (0x80 if wide else 0), g, q, sections, n_tokens, channels
        )
        a8 = a_sym.to(torch.uint8).numpy()
        d8 = d_sym.to(torch.uint8).numpy()
        early = 2 * _early_layers(layout.num_layers)
        body = _ans_encode(a8, d8, q, early) if self.entropy == "ans" else _zstd_encode(a8, d8)
        return head + side.numpy().tobytes() + body

    def max_encoded(self, layout: KVLayout, n_tokens: int) -> int:
        """Header, side info (float32 at most), and the entropy-coded symbols of the padded
        groups: zstd's bound over one byte a symbol, or ANS at worst 32 bits a symbol."""
        sections = layout.num_layers * 2
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
            layout.num_layers * 2,
            n_tokens,
            layout.num_kv_heads * layout.head_size,
        ):
            raise CorruptChunkError("cachegen payload's shape does not match the chunk header")
        # The group sets how many padded tokens are decoded: bounded like the encoder's, so
        # the symbol arrays stay within a small multiple of the chunk's own size.
        if not 2 <= g <= MAX_GROUP or q < 1 or q > 127:
            raise CorruptChunkError("cachegen payload has invalid parameters")
        side_dtype = np.float32 if ent & 0x80 else np.float16
        n_side = 3 * sections * channels
        pos = _HEAD.size
        side_np = np.frombuffer(data, dtype=side_dtype, count=n_side, offset=pos)
        pos += side_np.nbytes
        side = torch.from_numpy(side_np.astype(np.float32)).view(3, sections, channels)  # astype copies
        ng = -(-n_tokens // g)
        shapes = ((sections, ng, channels), (sections, ng * (g - 1), channels))
        if ent & 0x7F == ENTROPY["ans"]:
            a8, d8 = _ans_decode(data[pos:], shapes, q, 2 * _early_layers(layout.num_layers))
        elif ent & 0x7F == ENTROPY["zstd"]:
            a8, d8 = _zstd_decode(data[pos:], shapes)
        else:
            raise CorruptChunkError(f"cachegen payload has unknown entropy coder {ent & 0x7F}")
        if int(d8.max(initial=0)) > 2 * q:
            raise CorruptChunkError("cachegen delta symbol out of range")
        amin, step, dbin = side[0], side[1], side[2]
        deq_a = amin[:, None] + torch.from_numpy(a8).float() * step[:, None]  # [S, groups, C]
        d = torch.from_numpy(d8).float().sub_(q).view(sections, ng, g - 1, channels)
        full = torch.empty(sections, ng, g, channels)
        full[:, :, 0] = deq_a
        full[:, :, 1:] = deq_a[:, :, None] + d.mul_(dbin[:, None, None]).cumsum_(dim=2)
        out = full.view(sections, ng * g, channels)[:, :n_tokens]
        kv = out.to(torch_dtype(layout.dtype)).view(torch.uint8).reshape(-1).numpy()
        if kv.nbytes != raw_len:
            raise CorruptChunkError("cachegen payload decoded to the wrong length")
        return kv.data


def _zstd_encode(a8: np.ndarray, d8: np.ndarray) -> bytes:
    # Plain zstd, level 1: its literal stage is a Huffman coder over the symbol bytes,
    # which is where the entropy coding happens; decoding runs at well over 1 GB/s.
    return zstandard.ZstdCompressor(level=1).compress(a8.tobytes() + d8.tobytes())


def _zstd_decode(body: memoryview, shapes: tuple[tuple[int, int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
    sizes = [int(np.prod(s)) for s in shapes]
    out = zstd_decompress(body, sum(sizes), "cachegen zstd stream")
    flat = np.frombuffer(bytearray(out), dtype=np.uint8)  # writable: torch takes it without a copy
    return flat[: sizes[0]].reshape(shapes[0]), flat[sizes[0] :].reshape(shapes[1])


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

    a8 = np.empty(shapes[0], dtype=np.uint8)
    d8 = np.empty(shapes[1], dtype=np.uint8)
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
    return a8, d8
