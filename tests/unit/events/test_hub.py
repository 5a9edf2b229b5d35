"""One hub thread serving many subscribers: in-order delivery, gap repair, close."""

from __future__ import annotations

import threading

from kvmesh.events import EventSubscriber
from kvmesh.events.hub import EventHub
from tests.unit.events.test_pubsub import LOOPBACK, LossyPublisher, Recorder, batch, wait_for, warm_up


def test_one_thread_serves_every_replica_in_order_and_repairs_gaps() -> None:
    pubs = [LossyPublisher(LOOPBACK, replay_endpoint=LOOPBACK, topic="kv", buffer=100) for _ in range(5)]
    recs = [Recorder() for _ in pubs]
    before = threading.active_count()
    try:
        with EventHub(burst=2) as hub:
            subs = [
                EventSubscriber(p.endpoint, r.on_batch, f"r{i}", p.replay_endpoint, r.on_gap, hub=hub)
                for i, (p, r) in enumerate(zip(pubs, recs, strict=True))
            ]
            assert threading.active_count() == before + 1  # the hub's thread, none per replica
            starts = [warm_up(p, r) for p, r in zip(pubs, recs, strict=True)]
            pubs[2].drop = {starts[2] + 3}  # one replica loses a batch: repaired by replay
            for k in range(12):  # interleaved, more than a burst per replica
                for p, n in zip(pubs, starts, strict=True):
                    p.publish(batch(n + k))
            for r, n in zip(recs, starts, strict=True):
                wait_for(lambda r=r, n=n: len(r.batches) == n + 12)  # type: ignore[misc]
                assert r.ts == [float(i) for i in range(n + 12)] and r.gaps == []
            assert subs[2].stats()["repaired"] == 1
            for s in subs:
                s.close()
            pubs[0].publish(batch(starts[0] + 12))  # closed: no longer delivered
            assert len(recs[0].batches) == starts[0] + 12
    finally:
        for p in pubs:
            p.close()
