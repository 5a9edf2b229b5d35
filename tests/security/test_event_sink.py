"""Hostile publishers on kvmesh epp's bound KV-event sink (llm-d's central layout).

The sink is a listener anything that reaches its port can publish to. Over real ZMQ sockets:
a message over the size bound drops that connection before it is buffered; a flood of
invented or oversized topics keeps no state; a forged batch that does not decode is counted
and applied nowhere. Through all of it an honest publisher's batches keep arriving, so the
sink's one thread is still serving. The hostile publishers are the test's own PUB sockets.
"""

from __future__ import annotations

import time

import zmq

from kvmesh.events import BlockStored, EventBatch, encode_batch
from kvmesh.events.sink import BoundEventSink
from tests.unit.events.test_pubsub import Recorder
from tests.waiting import wait_for

KNOWN = {"10.0.0.1": ("10.0.0.1:8000",)}


def _pub(endpoint: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    sock.connect(endpoint)
    return sock


def _frames(topic: bytes, seq: int, payload: bytes | None = None) -> list[bytes]:
    if payload is None:
        payload = encode_batch(EventBatch(float(seq), (BlockStored((seq,), None, (1, 2), 2),)))
    return [topic, seq.to_bytes(8, "big"), payload]


def _honest_gets_through(sink: BoundEventSink, rec: Recorder, honest: zmq.Socket[bytes], seq: int) -> None:
    """PUB drops messages until its connection is up: send until one arrives."""
    before = len(rec.batches)
    deadline = time.monotonic() + 10
    while len(rec.batches) == before and time.monotonic() < deadline:
        honest.send_multipart(_frames(b"kv@10.0.0.1@m", seq))
        seq += 1
        time.sleep(0.02)
    assert len(rec.batches) > before, "the honest publisher's batch never came: the sink stopped"


def test_hostile_publishers_cost_the_sink_nothing_it_keeps() -> None:
    rec = Recorder()
    sink = BoundEventSink("tcp://127.0.0.1:0", rec.on_batch, rec.on_gap, lambda pod: KNOWN.get(pod, ()),
                          max_message_bytes=64 << 10)  # fmt: skip
    honest, hostile = _pub(sink.endpoint), _pub(sink.endpoint)
    try:
        _honest_gets_through(sink, rec, honest, 0)
        applied = len(rec.batches)
        # Invented pods, a topic per message.
        for i in range(5000):
            hostile.send_multipart(_frames(f"kv@10.{i // 250}.{i % 250}.9@m".encode(), i))
        # A known pod's topic padded far past the topic bound (each would be a publisher kept).
        for i in range(50):
            hostile.send_multipart(_frames(b"kv@10.0.0.1@" + b"m" * 1000 + str(i).encode(), 500 + i))
        # A known pod's topic with a payload that is not a batch.
        hostile.send_multipart(_frames(b"kv@10.0.0.1@m", 1000, b"\xc1\xc1not msgpack"))
        wait_for(lambda: sink.stats()["malformed"] >= 51, 10, "the hostile messages never arrived")
        # Over the size bound: ZMQ drops the connection before buffering the message.
        for _ in range(5):
            hostile.send_multipart(_frames(b"kv@10.0.0.1@m", 99, b"\x00" * (1 << 20)))
        _honest_gets_through(sink, rec, honest, 2000)
        stats = sink.stats()
        assert stats["publishers"] == 1  # only the known pod's topic is kept
        assert all(name == "10.0.0.1:8000" for name, _ in rec.batches)
        assert len(rec.batches) > applied and stats["batches"] == len(rec.batches)
        assert stats["unknown_pod"] > 0 and stats["malformed"] == 51
        assert not any(b.ts in (99.0, 1000.0) or 500 <= b.ts < 550 for _, b in rec.batches)
    finally:
        honest.close(linger=0)
        hostile.close(linger=0)
        sink.close()
