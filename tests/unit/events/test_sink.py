"""The bound event sink (llm-d's central layout): vLLM's own publisher connects to it.

vLLM's ``ZmqEventPublisher`` connects to any endpoint that is not a wildcard, so given the
sink's ``tcp://127.0.0.1:PORT`` it does exactly what a pod with ``--kv-events-config``
endpoint ``tcp://<epp>:5557`` and topic ``kv@$(POD_IP)@<model>`` does. The sequence
bookkeeping is tested on :meth:`BoundEventSink.on_message` directly (no sockets).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvmesh.events import BlockStored, EventBatch, encode_batch
from kvmesh.events import sink as sink_mod
from kvmesh.events.sink import BoundEventSink
from tests.unit.events.test_pubsub import Recorder
from tests.waiting import wait_for


class Calls(Recorder):
    """What the sink hands on, and the endpoints each pod has."""

    def __init__(self, pods: dict[str, tuple[str, ...]]) -> None:
        super().__init__()
        self.pods = pods

    def resolve(self, pod: str) -> tuple[str, ...]:
        return self.pods.get(pod, ())


def frames(topic: str, seq: int, ts: float = 0.0) -> list[bytes]:
    batch = EventBatch(ts, (BlockStored((seq,), None, (1, 2), 2),))
    return [topic.encode(), seq.to_bytes(8, "big"), encode_batch(batch)]


@pytest.mark.vllm
def test_vllms_publisher_connects_and_its_topic_names_the_pod() -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    calls = Calls({"127.0.0.1": ("127.0.0.1:8000", "127.0.0.1:8001")})
    sink = BoundEventSink("tcp://127.0.0.1:0", calls.on_batch, calls.on_gap, calls.resolve)
    assert not kv.ZmqEventPublisher._is_bind_endpoint(sink.endpoint)  # vLLM connects to it
    vpub = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=sink.endpoint, topic="kv@127.0.0.1@qwen3")
    other = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=sink.endpoint, topic="kv@10.9.9.9@qwen3")

    def vbatch(i: int) -> Any:
        ev = kv.BlockStored(block_hashes=[i], parent_block_hash=None, token_ids=[i, i], block_size=2,
                            lora_id=None, medium=None, lora_name=None)  # fmt: skip
        return kv.KVEventBatch(ts=float(i), events=[ev])

    try:
        n = 0
        deadline = time.monotonic() + 20
        while not calls.batches and time.monotonic() < deadline:  # PUB drops until connected
            vpub.publish(vbatch(n))
            other.publish(vbatch(n))
            n += 1
            time.sleep(0.02)
        wait_for(lambda: bool(calls.batches), 5, "no batch reached the sink")
        vpub.publish(vbatch(n))
        wait_for(lambda: calls.batches[-1][1].ts == float(n), 5, "the last batch never came")
        names = {name for name, _ in calls.batches}
        assert names == {"127.0.0.1:8000", "127.0.0.1:8001"}  # both endpoints at that pod
        assert calls.batches[-1][1].events[0] == BlockStored((n,), None, (n, n), 2)
        wait_for(lambda: sink.stats()["unknown_pod"] > 0, 5, "the unknown pod's batches were not counted")
    finally:
        vpub.shutdown()
        other.shutdown()
        sink.close()


def test_gaps_restarts_and_unknown_pods_by_topic() -> None:
    calls = Calls(
        {"10.0.0.1": ("10.0.0.1:8000",), "10.0.0.2": ("10.0.0.2:8000",), "fd00::3": ("[fd00::3]:8000",)}
    )
    sink = BoundEventSink("tcp://127.0.0.1:0", calls.on_batch, calls.on_gap, calls.resolve)
    try:
        for seq in (0, 1, 2):
            sink.on_message(frames("kv@10.0.0.1@m", seq))
        sink.on_message(frames("kv@10.0.0.2@m", 7))  # its own numbering: no gap
        assert calls.gaps == [] and len(calls.batches) == 4
        sink.on_message(frames("kv@10.0.0.1@m", 5))  # 3 and 4 lost: the pod's entries go
        assert calls.gaps == ["10.0.0.1:8000"] and sink.stats()["gaps"] == 1
        sink.on_message(frames("kv@10.0.0.1@m", 0))  # a restarted publisher: its cache is empty
        assert calls.gaps[-1] == "10.0.0.1:8000" and sink.stats()["restarts"] == 1
        sink.on_message(frames("kv@fd00::3@m", 0))
        assert calls.batches[-1][0] == "[fd00::3]:8000"
        before = len(calls.batches)
        for bad in (frames("kv@10.9.9.9@m", 0), frames("no-at-signs", 0), frames("kv@@m", 0)):
            sink.on_message(bad)
        assert sink.stats()["unknown_pod"] == 3 and len(calls.batches) == before
        sink.on_message([b"kv@10.0.0.1@m", b"short"])
        sink.on_message([b"kv@10.0.0.2@m", (8).to_bytes(8, "big"), b"\xc1not msgpack"])
        assert sink.stats()["malformed"] == 2 and len(calls.batches) == before
    finally:
        sink.close()


def test_publishers_tracked_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A publisher inventing a topic per message costs a bounded table, not memory without end."""
    monkeypatch.setattr(sink_mod, "MAX_PUBLISHERS", 8)
    calls = Calls({})
    anyone = BoundEventSink("tcp://127.0.0.1:0", calls.on_batch, calls.on_gap, lambda pod: ("x:1",))
    nobody = BoundEventSink("tcp://127.0.0.1:0", calls.on_batch, calls.on_gap, calls.resolve)
    try:
        for i in range(100):
            anyone.on_message(frames(f"kv@10.1.{i}.1@m", 0))
            nobody.on_message(frames(f"kv@10.1.{i}.1@m", 0))
        assert anyone.stats()["publishers"] == 8
        assert nobody.stats()["publishers"] == 0  # a topic naming no known pod is not kept
        nobody.on_message([b"kv@" + b"9" * 300 + b"@m", (0).to_bytes(8, "big"), b""])
        assert nobody.stats()["malformed"] == 1  # a topic is short; a 16 MiB one is not kept or read
    finally:
        anyone.close()
        nobody.close()


def test_a_duplicate_is_dropped_not_a_restart() -> None:
    calls = Calls({"10.0.0.1": ("10.0.0.1:8000",)})
    sink = BoundEventSink("tcp://127.0.0.1:0", calls.on_batch, calls.on_gap, calls.resolve)
    try:
        for seq in (0, 1, 1, 2):
            sink.on_message(frames("kv@10.0.0.1@m", seq))
        assert len(calls.batches) == 3 and calls.gaps == [] and sink.stats()["restarts"] == 0
    finally:
        sink.close()


def test_close_frees_the_port() -> None:
    calls = Calls({})
    sink = BoundEventSink("tcp://127.0.0.1:0", calls.on_batch, calls.on_gap, calls.resolve)
    endpoint = sink.endpoint
    sink.close()
    sink.close()  # idempotent
    again = BoundEventSink(endpoint, calls.on_batch, calls.on_gap, calls.resolve)
    again.close()


def test_a_port_in_use_is_a_clear_error() -> None:
    calls = Calls({})
    first = BoundEventSink("tcp://127.0.0.1:0", calls.on_batch, calls.on_gap, calls.resolve)
    try:
        with pytest.raises(ValueError, match="cannot bind the KV event sink"):
            BoundEventSink(first.endpoint, calls.on_batch, calls.on_gap, calls.resolve)
    finally:
        first.close()
