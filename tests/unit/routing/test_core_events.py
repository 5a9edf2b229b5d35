"""The routing core's KV-event subscriptions: one hub thread, and a removed replica stays gone."""

from __future__ import annotations

import threading
from typing import Any

from kvmesh.epp.metrics import EppMetrics
from kvmesh.router.app import RouterService
from kvmesh.router.config import RouterConfig
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


def test_a_batch_still_being_delivered_when_the_replica_is_removed_is_dropped() -> None:
    """Fault injection: the index holds one batch inside the subscriber's callback until the
    replica is removed. The close then stops waiting for the hub (0.5 s) and the index forgets
    the replica; the held batch, applied after, must not register it again."""
    pub = LossyPublisher(LOOPBACK, topic="")
    core = RoutingCore(RoutingConfig(), EppMetrics())
    hold, held, release = threading.Event(), threading.Event(), threading.Event()
    apply = core.index._apply

    def slow_apply(*args: Any) -> None:
        if hold.is_set() and not held.is_set():
            held.set()
            release.wait(10)
        apply(*args)

    core.index._apply = slow_apply  # type: ignore[method-assign]
    try:
        core.add_replica(ReplicaConfig(url="http://127.0.0.1:1", name="r0", events=pub.endpoint))
        core._subscribe(core.pool.replicas["r0"].config)
        i = 0

        def sent() -> bool:
            nonlocal i
            pub.publish(batch(i))
            i += 1
            return core.index.stats()["stored_blocks"] > 0

        wait_for(sent, 5, "the subscriber's first batch in the index")
        hold.set()
        wait_for(lambda: sent() and held.is_set(), 5, "a batch held inside the callback")
        core.remove_replica("r0")  # its close gives up on the hub after 0.5 s
        assert "r0" not in core.index.replicas()
        stored = core.index.stats()["stored_blocks"]
        release.set()
        wait_for(lambda: core.index.stats()["unregistered"] >= 1, 5, "the held batch dropped")
        assert "r0" not in core.index.replicas()
        assert core.index.stats()["stored_blocks"] == stored
    finally:
        release.set()
        if core._hub is not None:
            core._hub.close()
        pub.close()


def test_a_rebuild_page_that_lands_after_its_replica_was_removed_registers_nothing() -> None:
    """A restarted router pages each replica's held chunks into the index through the same
    feed as its events: a page still on its way when the replica is removed is dropped."""
    replica = ReplicaConfig(url="http://127.0.0.1:1", name="r0")
    svc = RouterService(RouterConfig.from_dict({"replicas": [replica]}))
    svc.rebuilder._apply("r0", batch(1))
    assert svc.index.replicas() == ["r0"] and svc.index.stats()["stored_blocks"] == 1
    svc.core.remove_replica("r0")
    svc.rebuilder._apply("r0", batch(2))
    assert svc.index.replicas() == [] and svc.index.stats()["unregistered"] == 1
