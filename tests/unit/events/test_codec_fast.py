"""The fast (typed) decoder gives what the generic decoder gives, or leaves the payload to it."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.events.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    _fast,
    _generic,
    decode_batch,
    encode_batch,
)

hashes = st.lists(st.one_of(st.integers(0, 2**63), st.binary(min_size=1, max_size=8)), max_size=4)
opt_str = st.none() | st.sampled_from(["GPU", "CPU", "lora-a"])
stored = st.builds(
    BlockStored,
    hashes.map(tuple),
    st.none() | st.integers(0, 2**40),
    st.lists(st.integers(0, 2**31), max_size=8).map(tuple),
    st.integers(0, 64),
    st.none() | st.integers(0, 9),
    opt_str,
    opt_str,
    st.none()
    | st.lists(
        st.none()
        | st.tuples(st.text(max_size=3), st.integers(0, 9))
        # nested, as vLLM's multimodal keys are: (mm hash, offset) inside a block's keys
        | st.tuples(st.text(max_size=3), st.tuples(st.text(max_size=2), st.integers(0, 9))),
        max_size=2,
    ).map(tuple),
    st.none() | st.integers(0, 3),
)
removed = st.builds(BlockRemoved, hashes.map(tuple), opt_str, st.none() | st.integers(0, 3))
events = st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=6)


@settings(max_examples=200, deadline=None)
@given(events, st.floats(0, 1e10), st.none() | st.integers(0, 7), st.sampled_from(["map", "array"]))
def test_fast_path_equals_generic(evs: list, ts: float, rank: int | None, shape: str) -> None:  # type: ignore[type-arg]
    payload = encode_batch(EventBatch(ts, tuple(evs), rank), shape=shape)  # type: ignore[arg-type]
    want = _generic(payload)
    fast = _fast(payload)
    if shape == "map":
        assert fast == want  # vLLM 0.32's shape: always the fast path
    else:
        assert fast is None or fast == want
    assert decode_batch(payload) == want
    assert hash(decode_batch(payload)) == hash(want)  # nested extra keys come back as tuples


def test_unknown_types_and_bad_fields_go_to_the_generic_path() -> None:
    enc = msgspec.msgpack.encode
    unknown = enc(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "parent_block_hash": None,
                    "token_ids": [1, 2],
                    "block_size": 2,
                },
                {"type": "NewEvent", "x": 1},
            ],
            None,
        ]
    )
    assert _fast(unknown) is None
    got = decode_batch(unknown)
    assert got.skipped == 1 and len(got.events) == 1
    for bad in (
        [True, [], None],  # a bool is not a timestamp
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "parent_block_hash": None,
                    "token_ids": [1, 2],
                    "block_size": -1,
                }
            ],
            None,
        ],
        [1.0, [{"type": "BlockRemoved", "block_hashes": [True]}], None],
    ):
        assert _fast(enc(bad)) is None
