"""The KV-event codec against hand-built payloads and against vLLM's own encoder."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvmesh.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    decode_batch,
    encode_batch,
)

enc = msgspec.msgpack.Encoder()

STORED = BlockStored(
    block_hashes=(11, b"\x01" * 32),
    parent_block_hash=7,
    token_ids=tuple(range(8)),
    block_size=4,
    lora_id=None,
    medium="CPU",
)
REMOVED = BlockRemoved(block_hashes=(11,), medium=None)
BATCH = EventBatch(ts=12.5, events=(STORED, REMOVED, AllBlocksCleared()), data_parallel_rank=0)


def test_array_shape_hand_built() -> None:
    payload = enc.encode(
        [
            1.0,
            [
                ["BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None, "GPU"],
                ["BlockStored", [3], 2, [9, 10], 2, 7],  # older vLLM: no medium field
                ["BlockRemoved", [1], None],
                ["BlockRemoved", [b"\xff"]],
                ["AllBlocksCleared"],
            ],
            None,
        ]
    )
    batch = decode_batch(payload)
    assert batch.ts == 1.0 and batch.data_parallel_rank is None and batch.skipped == 0
    s0, s1, r0, r1, c = batch.events
    assert s0 == BlockStored((1, 2), None, (5, 6, 7, 8), 2, None, "GPU")
    assert s1 == BlockStored((3,), 2, (9, 10), 2, lora_id=7, medium=None)
    assert r0 == BlockRemoved((1,), None)
    assert r1 == BlockRemoved((b"\xff",))
    assert c == AllBlocksCleared()


def test_map_shape_hand_built_ignores_unknown_fields_and_types() -> None:
    payload = enc.encode(
        [
            2,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"ab"],
                    "parent_block_hash": None,
                    "token_ids": [1, 2],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": "adapter",
                    "extra_keys": [["salt", ["mm", 3]]],
                    "group_idx": 0,
                    "some_future_field": {"x": 1},
                },
                {"type": "BlockRemoved", "block_hashes": [b"ab"], "medium": "GPU", "locality": "LOCAL"},
                {"type": "SomethingNew", "payload": 1},
            ],
            3,
        ]
    )
    batch = decode_batch(payload)
    assert batch.ts == 2.0 and batch.data_parallel_rank == 3
    assert batch.skipped == 1
    stored, removed = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.lora_name == "adapter" and stored.group_idx == 0
    assert stored.extra_keys == (("salt", ("mm", 3)),)
    assert removed == BlockRemoved((b"ab",), "GPU", locality="LOCAL")


def test_offloading_placeholder_store_decodes() -> None:
    # vLLM's offloading connector stores blocks it has no metadata for as token-less placeholders.
    ev = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": []}
    ev |= {"block_size": 0, "lora_id": None, "medium": "CPU", "lora_name": None, "group_idx": 0}
    (stored,) = decode_batch(enc.encode([1.0, [ev], 0])).events
    assert stored == BlockStored((5,), None, (), 0, medium="CPU", group_idx=0)


def test_batch_without_rank() -> None:
    assert decode_batch(enc.encode([0.5, []])) == EventBatch(0.5, ())


@pytest.mark.parametrize("shape", ["map", "array"])
def test_round_trip(shape: Any) -> None:
    assert decode_batch(encode_batch(BATCH, shape=shape)) == BATCH


# Payloads produced by vLLM 0.32's own ``msgspec.msgpack.encode(KVEventBatch(...))`` for
# VLLM_BATCH_1 / VLLM_BATCH_2 below; the ``vllm``-marked tests re-check them against the
# installed vLLM (importing vLLM takes 10+ s, so the fast suite uses the recorded bytes).
VLLM_PAYLOAD_1 = bytes.fromhex(
    "93cb40290000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920b"
    "c4200101010101010101010101010101010101010101010101010101010101010101b1706172656e745f626c"
    "6f636b5f6861736807a9746f6b656e5f696473980001020304050607aa626c6f636b5f73697a6504a76c6f72"
    "615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f76"
    "6564ac626c6f636b5f686173686573910ba66d656469756dc081a474797065b0416c6c426c6f636b73436c65"
    "6172656400"
)
VLLM_PAYLOAD_2 = bytes.fromhex(
    "93cb3ff0000000000000928da474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739101"
    "b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473920405aa626c6f636b5f73697a6502"
    "a76c6f72615f696403a66d656469756dc0a96c6f72615f6e616d65a66c6f72612d61aa65787472615f6b6579"
    "739192a66c6f72612d61a473616c74a967726f75705f69647801b26b765f63616368655f737065635f6b696e"
    "64ae66756c6c5f617474656e74696f6ea86c6f63616c697479a54c4f43414caa73657373696f6e5f6964a173"
    "85a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739101a66d656469756da34350"
    "55a967726f75705f69647801a96f776e657273686970a178c0"
)
BATCH_2_STORED = BlockStored(
    (1,),
    None,
    (4, 5),
    2,
    3,
    None,
    "lora-a",
    extra_keys=(("lora-a", "salt"),),
    group_idx=1,
    locality="LOCAL",
    kv_cache_spec_kind="full_attention",  # the group's kind: the router indexes full attention only
)
BATCH_2_REMOVED = BlockRemoved((1,), "CPU", group_idx=1, ownership="x")  # vLLM 0.32's medium qualifiers


def _vllm_batches() -> tuple[Any, Any]:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    b1 = kv.KVEventBatch(
        ts=12.5,
        events=[
            kv.BlockStored(
                block_hashes=[11, b"\x01" * 32],
                parent_block_hash=7,
                token_ids=list(range(8)),
                block_size=4,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            ),
            kv.BlockRemoved(block_hashes=[11], medium=None),
            kv.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    b2 = kv.KVEventBatch(
        ts=1.0,
        events=[
            kv.BlockStored(
                block_hashes=[1],
                parent_block_hash=None,
                token_ids=[4, 5],
                block_size=2,
                lora_id=3,
                medium=None,
                lora_name="lora-a",
                extra_keys=[("lora-a", "salt")],
                group_idx=1,
                kv_cache_spec_kind="full_attention",
                locality="LOCAL",
                session_id="s",
            ),
            kv.BlockRemoved(block_hashes=[1], medium="CPU", group_idx=1, ownership="x"),
        ],
    )
    return b1, b2


def test_recorded_vllm_payloads_decode() -> None:
    assert decode_batch(VLLM_PAYLOAD_1) == BATCH
    batch = decode_batch(VLLM_PAYLOAD_2)
    assert batch.events == (BATCH_2_STORED, BATCH_2_REMOVED) and batch.data_parallel_rank is None
    # The wire facts the decoder relies on: an array batch whose events are maps with "type".
    raw = msgspec.msgpack.decode(VLLM_PAYLOAD_2)
    assert isinstance(raw, list) and len(raw) == 3
    assert [e["type"] for e in raw[1]] == ["BlockStored", "BlockRemoved"]


def test_map_encoding_is_byte_identical_to_vllm_0_32() -> None:
    assert encode_batch(BATCH, shape="map") == VLLM_PAYLOAD_1


@pytest.mark.vllm
def test_recorded_payloads_match_installed_vllm() -> None:
    b1, b2 = _vllm_batches()
    assert msgspec.msgpack.encode(b1) == VLLM_PAYLOAD_1
    assert msgspec.msgpack.encode(b2) == VLLM_PAYLOAD_2


class _OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM ≤ 0.23 declared its events like this: tagged *arrays*."""


class _OldStored(_OldEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _OldRemoved(_OldEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class _OldCleared(_OldEvent, tag="AllBlocksCleared"):
    pass


class _OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_OldStored | _OldRemoved | _OldCleared]
    data_parallel_rank: int | None = None


def test_array_encoding_matches_old_vllm_structs() -> None:
    old = _OldBatch(
        ts=12.5,
        events=[
            _OldStored([11, b"\x01" * 32], 7, list(range(8)), 4, None, "CPU"),
            _OldRemoved([11], None),
            _OldCleared(),
        ],
        data_parallel_rank=0,
    )
    payload = msgspec.msgpack.encode(old)
    assert encode_batch(BATCH, shape="array") == payload
    assert decode_batch(payload) == BATCH


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # reserved msgpack byte
        enc.encode({"ts": 1, "events": []}),
        enc.encode([1.0]),
        enc.encode(["now", []]),
        enc.encode([1.0, {}]),
        enc.encode([1.0, [], "rank"]),
        enc.encode([1.0, [42]]),
        enc.encode([1.0, [[]]]),
        enc.encode([1.0, [[7, [1]]]]),
        enc.encode([1.0, [["BlockStored", [1], None]]]),
        enc.encode([1.0, [["BlockStored", [1.5], None, [1], 1, None, None]]]),
        enc.encode([1.0, [["BlockStored", [1], None, ["a"], 1, None, None]]]),
        enc.encode([1.0, [["BlockStored", [1], None, [1], -1, None, None]]]),
        enc.encode([1.0, [["BlockStored", [1], 2.5, [1], 1, None, None]]]),
        enc.encode([1.0, [["BlockStored", [1], None, [1], 1, None, 5]]]),
        enc.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
        enc.encode([1.0, [{"type": "BlockRemoved"}]]),
        enc.encode([1.0, [{"type": "BlockRemoved", "block_hashes": 5}]]),
        enc.encode([1.0, [{"block_hashes": [1]}]]),
    ],
)
def test_malformed_payloads_raise_one_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_encode_rejects_unknown_shape() -> None:
    with pytest.raises(ValueError):
        encode_batch(BATCH, shape="xml")  # type: ignore[arg-type]
