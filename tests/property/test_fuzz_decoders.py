"""Fuzzing the decoders that read bytes from outside the process: the KV-event decoder
(events/codec.py, fed by any replica's ZMQ socket), the chunk deserializer (core/serde.py,
fed by disk, Redis, a shared filesystem) and the router's reading of a held page
(router/rebuild.py, fed by an engine's admin API). Each either decodes or raises its one
documented error; nothing else escapes (no crash, no stray TypeError or RecursionError)."""

from __future__ import annotations

import json
import struct
from typing import Any

import msgspec
import numpy as np
import xxhash
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvmesh.core import serde
from kvmesh.core.fleetkey import FleetKey
from kvmesh.core.keys import KVLayout
from kvmesh.errors import CorruptChunkError, EventDecodeError
from kvmesh.events.codec import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, encode_batch
from kvmesh.index import BlockIndex
from kvmesh.router.rebuild import events_of

FUZZ = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])

SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=12),
)
TREE = st.recursive(
    SCALAR,
    lambda kids: st.one_of(
        st.lists(kids, max_size=5), st.dictionaries(st.text(max_size=8), kids, max_size=5)
    ),
    max_leaves=40,
)
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12)),
    lambda kids: st.one_of(
        st.lists(kids, max_size=5), st.dictionaries(st.text(max_size=8), kids, max_size=5)
    ),
    max_leaves=30,
)
TAGS = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])
HASH = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=32))


def _msgpack(value: Any) -> bytes:
    # msgspec encodes Python ints beyond 64 bits as an error: keep what it can encode.
    try:
        return msgspec.msgpack.encode(value)
    except (OverflowError, TypeError):
        return msgspec.msgpack.encode(None)


@st.composite
def event_like(draw: st.DrawFn) -> Any:
    """Mostly well-shaped events with fields replaced by anything: where decoders break."""
    tag = draw(TAGS)
    n = draw(st.integers(0, 3))
    bs = draw(st.one_of(st.integers(-2, 4), TREE))
    fields: dict[str, Any] = {
        "block_hashes": draw(st.one_of(st.lists(HASH, max_size=n), TREE)),
        "parent_block_hash": draw(st.one_of(st.none(), HASH, TREE)),
        "token_ids": draw(st.one_of(st.lists(st.integers(-1, 2**32), max_size=12), TREE)),
        "block_size": bs,
        "lora_id": draw(st.one_of(st.none(), TREE)),
        "medium": draw(st.one_of(st.sampled_from(["GPU", "CPU", "DISK", "REMOTE", "gpu", "x"]), TREE)),
        "lora_name": draw(st.one_of(st.none(), TREE)),
        "extra_keys": draw(st.one_of(st.none(), TREE)),
        "group_idx": draw(st.one_of(st.none(), st.integers(-1, 2), TREE)),
    }
    keep = draw(st.lists(st.sampled_from(sorted(fields)), unique=True))
    if draw(st.booleans()):
        return {"type": tag, **{k: fields[k] for k in keep}}
    return [tag, *[fields[k] for k in sorted(fields) if k in keep]]


PAYLOADS = st.one_of(
    st.binary(max_size=200),
    TREE.map(_msgpack),
    st.tuples(
        st.one_of(st.floats(), TREE), st.lists(event_like(), max_size=4), st.one_of(st.none(), TREE)
    ).map(lambda t: _msgpack(list(t))),
)


@FUZZ
@given(payload=PAYLOADS)
@example(payload=b"\x92\xcb" + b"\x00" * 8 + b"\x91" * 2000)  # deep nesting
@example(
    payload=msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [1], 1, None, None, None, [[[[[]]]]]]]])
)
def test_event_decoder_raises_only_event_decode_error(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except EventDecodeError:
        return
    for ev in batch.events:
        assert isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared))
    # What decodes is something the index takes without raising (the subscriber would count
    # a raise as a callback error and drop the batch).
    index = BlockIndex(max_blocks=64)
    index.apply("r", batch)
    index.match(np.arange(8, dtype=np.uint32))
    assert decode_batch(encode_batch(batch)).events == batch.events


# -- chunk deserializer ----------------------------------------------------------------------------
LAYOUT = KVLayout(1, 1, 2, "float16")


def _with_header(meta: Any, payload: bytes, version: int = serde.FORMAT_VERSION) -> bytes:
    """A chunk whose header checksum is right around any JSON: reaches the header parser."""
    hjson = json.dumps(meta).encode()
    head = struct.pack("<4sHHIQ", serde.MAGIC, version, 0, len(hjson), len(payload)) + hjson
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + payload


def _valid(n_tokens: int, codec: str) -> bytes:
    tokens = np.arange(n_tokens, dtype=np.uint32)
    raw = np.arange(n_tokens * LAYOUT.bytes_per_token, dtype=np.uint8).tobytes()
    return serde.encode_bytes("ns/0/abc", LAYOUT, tokens, raw, codec)


META_FIELDS = {
    "key": st.one_of(st.just("ns/0/abc"), JSON),
    "layout": st.one_of(
        st.just(LAYOUT.to_dict()), st.dictionaries(st.sampled_from(list(LAYOUT.to_dict())), JSON), JSON
    ),
    "shape": st.one_of(st.just([1, 2, 2, 1, 2]), JSON),
    "codec": st.one_of(st.sampled_from(["raw", "zstd", "lz4"]), JSON),
    "raw_len": st.one_of(st.integers(-5, 64), JSON),
    "tokens": st.one_of(st.just("AAAAAAEAAAA="), st.text(max_size=12), JSON),
    "checksum": st.one_of(st.text(max_size=32), JSON),
}


@FUZZ
@given(
    data=st.one_of(
        st.binary(max_size=120),
        st.builds(_with_header, st.fixed_dictionaries({}, optional=META_FIELDS), st.binary(max_size=40)),
        st.builds(_with_header, JSON, st.binary(max_size=8)),
        st.tuples(st.integers(1, 4), st.sampled_from(["raw", "zstd"]), st.data()).map(
            lambda t: _mutate(_valid(t[0], t[1]), t[2])
        ),
    )
)
def test_chunk_deserializer_raises_only_corrupt_chunk_error(data: bytes) -> None:
    try:
        header, raw = serde.decode(data)
    except CorruptChunkError:
        return
    assert memoryview(raw).nbytes == header.raw_len


def _mutate(chunk: bytes, data: st.DataObject) -> bytes:
    buf = bytearray(chunk)
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["flip", "cut", "grow"]))
        if op == "flip" and buf:
            i = data.draw(st.integers(0, len(buf) - 1))
            buf[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del buf[data.draw(st.integers(0, len(buf))) :]
        else:
            buf += data.draw(st.binary(max_size=8))
    return bytes(buf)


_KEYED = {enc: serde.ChunkFormat(FleetKey([b"k" * 32]), encrypt=enc, layout=LAYOUT) for enc in (False, True)}


@FUZZ
@given(
    enc=st.booleans(),
    codec=st.sampled_from(["raw", "zstd"]),
    n=st.integers(1, 4),
    data=st.data(),
)
def test_keyed_chunks_altered_anywhere_never_decode(
    enc: bool, codec: str, n: int, data: st.DataObject
) -> None:
    """A MAC'd or sealed chunk, flipped, cut or grown anywhere: only CorruptChunkError (its
    UnauthenticatedChunkError above all), never other bytes."""
    fmt = _KEYED[enc]
    raw = np.arange(n * LAYOUT.bytes_per_token, dtype=np.uint8).tobytes()
    good = fmt.encode_bytes("ns/0/abc", LAYOUT, np.arange(n, dtype=np.uint32), raw, codec)
    bad = _mutate(good, data)
    try:
        _, out = fmt.decode(bad)
    except CorruptChunkError:
        return
    assert bytes(out) == raw  # only a mutation that changed nothing that matters decodes


def test_valid_chunks_round_trip() -> None:
    for codec in ("raw", "zstd"):
        header, raw = serde.decode(_valid(3, codec))
        assert bytes(raw) == np.arange(3 * LAYOUT.bytes_per_token, dtype=np.uint8).tobytes()
        assert header.tokens.tolist() == [0, 1, 2]


# -- a held page from an engine's admin API ----------------------------------------------------------
HELD_EVENT = st.fixed_dictionaries(
    {},
    optional={
        "block_hashes": st.one_of(
            st.lists(st.one_of(st.integers(0, 2**64), st.just("hex:00ff"), st.text(max_size=6))), TREE
        ),
        "parent_block_hash": st.one_of(st.none(), st.integers(), st.just("hex:zz"), TREE),
        "token_ids": st.one_of(st.lists(st.integers(-1, 2**33), max_size=8), TREE),
        "block_size": st.one_of(st.integers(-1, 4), TREE),
        "medium": st.one_of(st.sampled_from(["CPU", "DISK"]), TREE),
    },
)


@FUZZ
@given(
    page=st.one_of(TREE, st.fixed_dictionaries({"events": st.lists(st.one_of(HELD_EVENT, TREE), max_size=4)}))
)
def test_held_page_reader_raises_only_value_error(page: Any) -> None:
    try:
        events = events_of(page)
    except ValueError:
        return
    index = BlockIndex(max_blocks=64)
    from kvmesh.events.codec import EventBatch

    index.apply("r", EventBatch(0.0, tuple(events)))
