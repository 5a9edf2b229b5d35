"""A replica's KV events with extra keys nested hundreds deep are dropped as malformed.

vLLM's extra keys nest two levels. A hostile replica (or anything that can publish on its
event port) sent a ``BlockStored`` whose ``extra_keys`` nested 500 levels: within msgspec's
own depth limit, so it decoded, but the decoder's freezing of the arrays into tuples
recursed past Python's stack, and the ``RecursionError`` left ``decode_batch``. On the event
hub that ended the one thread that reads every replica's events. The decoder now refuses
keys nested deeper than ``MAX_KEY_DEPTH`` with its documented error. The hostile publisher is
a real ZMQ PUB socket of the test's own; the honest one is kvmesh's, on the same hub.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from kvmesh.errors import EventDecodeError
from kvmesh.events import EventPublisher, EventSubscriber, decode_batch, encode_batch
from kvmesh.events.codec import MAX_KEY_DEPTH
from kvmesh.events.hub import EventHub
from tests.unit.events.test_pubsub import LOOPBACK, Recorder, batch, warm_up
from tests.waiting import wait_for


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _payload(depth: int, shape: str) -> bytes:
    keys = [_nested(depth)]
    event: Any = (
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": 2, "extra_keys": keys}
        if shape == "map"
        else ["BlockStored", [1], None, [1, 2], 2, None, None, None, keys]
    )  # fmt: skip
    return msgspec.msgpack.encode([1.0, [event], None])


@pytest.mark.parametrize("shape", ["map", "array"])
@pytest.mark.parametrize("depth", [MAX_KEY_DEPTH + 1, 300, 500])
def test_deep_extra_keys_are_a_decode_error(shape: str, depth: int) -> None:
    with pytest.raises(EventDecodeError, match="nest deeper"):
        decode_batch(_payload(depth, shape))


def test_vllm_shaped_keys_still_decode() -> None:
    got = decode_batch(_payload(2, "map")).events[0]
    assert got.extra_keys == (((1,),),)  # type: ignore[union-attr]


def test_a_hostile_replica_cannot_stop_the_hub() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    honest = EventPublisher(LOOPBACK, topic="kv")
    rec = Recorder()
    try:
        with EventHub() as hub:
            bad = EventSubscriber(f"tcp://127.0.0.1:{port}", rec.on_batch, "bad", None, rec.on_gap, hub=hub)
            good = EventSubscriber(honest.endpoint, rec.on_batch, "good", None, rec.on_gap, hub=hub)
            n = warm_up(honest, rec)
            first = encode_batch(batch(1000))
            # Send until the subscription has arrived, each with the next number: a copy of one
            # already seen would read as the publisher restarting (a gap).
            seq, deadline = 0, time.monotonic() + 5
            while "bad" not in {r for r, _ in rec.batches} and time.monotonic() < deadline:
                raw.send_multipart([b"", seq.to_bytes(8, "big"), first])
                seq += 1
                time.sleep(0.02)
            raw.send_multipart([b"", seq.to_bytes(8, "big"), _payload(500, "map")])
            raw.send_multipart([b"", (seq + 1).to_bytes(8, "big"), encode_batch(batch(1002))])
            wait_for(lambda: rec.ts[-1] == 1002.0)  # the hostile replica's next batch, read
            assert bad.stats()["malformed"] == 1 and rec.gaps == []
            honest.publish(batch(n))
            wait_for(lambda: rec.ts[-1] == float(n))  # and every other replica's
            assert good.stats()["malformed"] == 0
            bad.close()
            good.close()
    finally:
        raw.close(linger=0)
        honest.close()
