"""The routing core's KV-event subscriptions: one hub thread, and a removed replica stays gone."""

from __future__ import annotations

import threading

from kvmesh.epp.metrics import EppMetrics
from kvmesh.routing.config import ReplicaConfig, RoutingConfig
from kvmesh.routing.core import RoutingCore
from tests.unit.events.test_pubsub import LOOPBACK, LossyPublisher, batch
from tests.waiting import wait_for


def test_a_replica_removed_while_its_events_flow_is_not_registered_again() -> None:
    """Removing a replica stops its events before the index forgets it: a batch applied in
    between would register the replica again, with entries nothing would remove. Its
    publisher keeps sending throughout, 50 batches at a time with a millisecond between."""
    pub = LossyPublisher(LOOPBACK, topic="")
    core = RoutingCore(RoutingConfig(), EppMetrics())
    stop = threading.Event()

    def publish() -> None:
        i = 0
        while not stop.is_set():
            pub.publish(batch(i))
            i += 1
            if i % 50 == 0:
                stop.wait(0.001)

    sender = threading.Thread(target=publish, daemon=True)
    try:
        core.add_replica(ReplicaConfig(url="http://127.0.0.1:1", name="r0", events=pub.endpoint))
        core._subscribe(core.pool.replicas["r0"].config)  # what start() does, without the checks
        sender.start()
        wait_for(lambda: core.index.stats()["stored_blocks"] > 20)
        core.remove_replica("r0")
        stored = core.index.stats()["stored_blocks"]
        stop.wait(0.2)  # the publisher goes on
        assert "r0" not in core.index.replicas()
        assert core.index.stats()["stored_blocks"] == stored
        assert core._hub is not None and core.subscribers == {}
    finally:
        stop.set()
        sender.join(2)
        if core._hub is not None:
            core._hub.close()
        pub.close()
