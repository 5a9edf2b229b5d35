"""A replica's replay socket that answers without end costs its own stream a bounded wait.

The router asks a replica's replay socket for what a gap lost. A compromised or broken
replica can answer forever: a stale or malformed frame every 50 ms, each within the replay
timeout, none of them the end. Each answer restarted the wait, so the replay never ended:
that replica's stream stopped for good, and on the event hub one of its few repair threads
was held for good too. A whole replay now takes at most ``REPLAY_BUDGET`` replay timeouts;
then the gap is reported (the replica's entries are relearnt) and its stream goes on. The
hostile socket is a real ZMQ ROUTER of the test's own; the publisher is kvmesh's.
"""

from __future__ import annotations

import threading

import zmq

from kvmesh.events import EventSubscriber
from kvmesh.events.hub import EventHub
from kvmesh.events.subscriber import REPLAY_BUDGET
from tests.unit.events.test_pubsub import LOOPBACK, LossyPublisher, Recorder, batch, warm_up
from tests.waiting import wait_for

TIMEOUT_S = 0.2


def _drip(sock: zmq.Socket[bytes], stop: threading.Event) -> None:
    """Answer every replay request with a stale frame every 50 ms, forever."""
    clients: list[bytes] = []
    while not stop.is_set():
        if sock.poll(50):
            clients.append(sock.recv_multipart()[0])
        for client in clients:
            sock.send_multipart([client, b"", b"kv", (0).to_bytes(8, "big"), b"stale"])


def test_a_replay_that_drips_without_end_is_cut_off_and_reported() -> None:
    ctx = zmq.Context.instance()
    hostile = ctx.socket(zmq.ROUTER)
    endpoint = f"tcp://127.0.0.1:{hostile.bind_to_random_port('tcp://127.0.0.1')}"
    stop = threading.Event()
    dripper = threading.Thread(target=_drip, args=(hostile, stop), daemon=True)
    dripper.start()
    pub = LossyPublisher(LOOPBACK, topic="kv")
    rec = Recorder()
    try:
        with EventHub() as hub:
            sub = EventSubscriber(pub.endpoint, rec.on_batch, "r0", endpoint, rec.on_gap,
                                  replay_timeout_s=TIMEOUT_S, replay_on_start=False, hub=hub)  # fmt: skip
            n = warm_up(pub, rec)
            pub.drop = {n}
            pub.publish(batch(n))
            pub.publish(batch(n + 1))  # a gap: the replay asks the hostile socket
            wait_for(lambda: rec.gaps == ["r0"], timeout_s=REPLAY_BUDGET * TIMEOUT_S + 3.0)
            wait_for(lambda: rec.ts[-1] == float(n + 1))  # the batch after the gap, delivered
            pub.publish(batch(n + 2))
            wait_for(lambda: rec.ts[-1] == float(n + 2))  # and the stream goes on
            assert sub.stats()["unrepaired"] == 1
            sub.close()
    finally:
        stop.set()
        dripper.join(2)
        pub.close()
        hostile.close(linger=0)
