"""One hub thread serving many subscribers: in-order delivery, gap repair, close."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvmesh.events import EventSubscriber
from kvmesh.events.hub import EventHub
from tests.unit.events.test_pubsub import LOOPBACK, LossyPublisher, Recorder, batch, warm_up
from tests.waiting import wait_for


def test_one_thread_serves_every_replica_in_order_and_repairs_gaps() -> None:
    pubs = [LossyPublisher(LOOPBACK, replay_endpoint=LOOPBACK, topic="kv", buffer=100) for _ in range(5)]
    recs = [Recorder() for _ in pubs]
    before = threading.active_count()
    try:
        with EventHub(burst=2, repair_threads=1) as hub:
            subs = [
                EventSubscriber(p.endpoint, r.on_batch, f"r{i}", p.replay_endpoint, r.on_gap, hub=hub)
                for i, (p, r) in enumerate(zip(pubs, recs, strict=True))
            ]
            # The hub's thread and (once a replay has run) its one repair thread; none per replica.
            assert not any(t.name.startswith("kvmesh-event-sub-") for t in threading.enumerate())
            assert threading.active_count() <= before + 2
            starts = [warm_up(p, r) for p, r in zip(pubs, recs, strict=True)]
            firsts = [r.ts for r in recs]  # PUB drops what it sends before a subscription arrives
            pubs[2].drop = {starts[2] + 3}  # one replica loses a batch: repaired by replay
            for k in range(12):  # interleaved, more than a burst per replica
                for p, n in zip(pubs, starts, strict=True):
                    p.publish(batch(n + k))
            for r, n, f in zip(recs, starts, firsts, strict=True):
                wait_for(lambda r=r, f=f: len(r.batches) == len(f) + 12)  # type: ignore[misc]
                assert r.ts == f + [float(n + k) for k in range(12)] and r.gaps == []
            # The last batch can arrive inside the replay, before its outcome is counted.
            wait_for(lambda: subs[2].stats()["repaired"] + subs[2].stats()["unrepaired"] >= 1)
            assert subs[2].stats()["repaired"] == 1
            for s in subs:
                s.close()
            pubs[0].publish(batch(starts[0] + 12))  # closed: no longer delivered
            assert len(recs[0].batches) == len(firsts[0]) + 12
    finally:
        for p in pubs:
            p.close()


def test_a_replay_that_never_answers_holds_up_no_other_replica() -> None:
    """A gap is repaired off the hub's thread: while one replica's replay hangs (its replay
    socket takes requests and never answers), another's batches keep arriving; the first
    comes back when its replay times out, its gap reported, its stream in order. Closing a
    subscriber in the middle of its replay waits for the replay to let go of its sockets."""
    ctx = zmq.Context.instance()
    hung = ctx.socket(zmq.ROUTER)  # takes replay requests, never answers
    hung_ep = f"tcp://127.0.0.1:{hung.bind_to_random_port('tcp://127.0.0.1')}"
    pub_a = LossyPublisher(LOOPBACK, topic="kv")
    pub_b = LossyPublisher(LOOPBACK, replay_endpoint=LOOPBACK, topic="kv", buffer=100)
    rec_a, rec_b = Recorder(), Recorder()
    try:
        with EventHub() as hub:
            sub_a = EventSubscriber(pub_a.endpoint, rec_a.on_batch, "a", hung_ep, rec_a.on_gap,
                                    replay_timeout_s=3.0, replay_on_start=False, hub=hub)  # fmt: skip
            sub_b = EventSubscriber(
                pub_b.endpoint, rec_b.on_batch, "b", pub_b.replay_endpoint, rec_b.on_gap, hub=hub
            )
            na, nb = warm_up(pub_a, rec_a), warm_up(pub_b, rec_b)
            # PUB drops what it sends before a subscription arrives: count from what came
            a0, b0 = rec_a.ts, len(rec_b.batches)
            pub_a.drop = {na}
            pub_a.publish(batch(na))
            pub_a.publish(batch(na + 1))  # a gap: a's replay starts, and hangs
            wait_for(lambda: hung.poll(0) != 0)  # the replay request has reached the hung socket
            for k in range(3):
                pub_b.publish(batch(nb + k))
            wait_for(lambda: len(rec_b.batches) == b0 + 3, timeout_s=2.0)
            # b was served while a's replay was still pending: a's gap is not reported yet
            assert rec_a.gaps == [] and rec_a.ts == a0
            wait_for(lambda: rec_a.gaps == ["a"], timeout_s=5.0)  # timed out: reported, and on
            wait_for(lambda: rec_a.ts[-1] == float(na + 1))
            pub_a.publish(batch(na + 2))  # back in the hub's loop
            wait_for(lambda: rec_a.ts[-1] == float(na + 2))
            assert rec_a.ts == [*a0, float(na + 1), float(na + 2)]
            assert sub_a.stats()["unrepaired"] == 1 and rec_b.gaps == []

            pub_a.drop = {na + 3}
            pub_a.publish(batch(na + 3))
            pub_a.publish(batch(na + 4))  # another hanging replay; a is closed in its middle
            wait_for(lambda: sub_a.stats()["gaps"] == 2)
            sub_a.close(timeout=5.0)
            pub_b.publish(batch(nb + 3))  # the hub still serves b
            wait_for(lambda: len(rec_b.batches) == b0 + 4)
            assert sub_b.stats()["gaps"] == 0
            sub_b.close()
    finally:
        pub_a.close()
        pub_b.close()
        hung.close(linger=0)


def test_two_hundred_replicas_each_burst_past_the_read_limit_all_arrive_in_order() -> None:
    """epoll signals a socket once when its queue stops being empty: a socket left with
    messages after a burst (``burst=3`` here, 10 batches each) must be read again without a
    new signal, and a replica whose batches all arrived at once must not wait for another."""
    pubs = [LossyPublisher(LOOPBACK, topic="kv") for _ in range(200)]
    recs = [Recorder() for _ in pubs]
    try:
        with EventHub(burst=3) as hub:
            subs = [
                EventSubscriber(p.endpoint, r.on_batch, f"r{i}", replay_on_start=False, hub=hub)
                for i, (p, r) in enumerate(zip(pubs, recs, strict=True))
            ]
            starts = [warm_up(p, r) for p, r in zip(pubs, recs, strict=True)]
            for p, n in zip(pubs, starts, strict=True):
                for k in range(10):
                    p.publish(batch(n + k))
            for r, n in zip(recs, starts, strict=True):
                wait_for(lambda r=r, n=n: len(r.batches) == n + 10)  # type: ignore[misc]
                assert r.ts == [float(i) for i in range(n + 10)]
            for s in subs:
                s.close()
    finally:
        for p in pubs:
            p.close()


def test_a_fault_in_one_replica_s_stream_ends_no_other_s() -> None:
    """Fault injection (a stand-in for any bug a payload could reach): one subscriber's live
    handling raises. The hub logs it and keeps serving everyone; its one thread had ended."""
    pubs = [LossyPublisher(LOOPBACK, topic="kv") for _ in range(2)]
    recs = [Recorder() for _ in pubs]
    try:
        with EventHub() as hub:
            subs = [
                EventSubscriber(p.endpoint, r.on_batch, f"r{i}", None, hub=hub)
                for i, (p, r) in enumerate(zip(pubs, recs, strict=True))
            ]
            starts = [warm_up(p, r) for p, r in zip(pubs, recs, strict=True)]

            def broken(frames: list[bytes]) -> None:
                raise RuntimeError("injected")

            subs[0]._on_live = broken  # type: ignore[method-assign]
            pubs[0].publish(batch(starts[0]))
            pubs[0].flush()
            for k in range(3):
                pubs[1].publish(batch(starts[1] + k))
            wait_for(lambda: recs[1].ts[-1] == float(starts[1] + 2))
            assert hub._thread.is_alive()
            for s in subs:
                s.close()
    finally:
        for p in pubs:
            p.close()


def test_a_closed_subscriber_delivers_nothing_more_while_the_hub_still_holds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fault injection: the hub's thread does not answer the remove in time (a loaded host), so
    the close gives up waiting and the hub still reads the socket. The routing core forgets the
    replica's entries right after the close; a batch delivered after that would add them back."""
    rec = Recorder()
    with LossyPublisher(LOOPBACK, topic="kv") as pub, EventHub() as hub:
        sub = EventSubscriber(pub.endpoint, rec.on_batch, "r0", None, rec.on_gap, hub=hub)
        n = warm_up(pub, rec)
        monkeypatch.setattr(hub, "remove", lambda sub, timeout=2.0: False)
        sub.close(timeout=0.1)
        seen = len(rec.batches)
        for i in range(n, n + 20):
            pub.publish(batch(i))
        pub.flush()
        time.sleep(0.5)  # the hub would have delivered them by now, had they gone on
        assert len(rec.batches) == seen and sub.stats()["batches"] == seen
        wait_for(lambda: sub._sub.closed and sub._monitor.closed)  # the hub closed them itself


def test_a_close_during_a_hanging_replay_leaks_no_socket() -> None:
    """A replica whose replay hangs (its replay socket takes the request and never answers, as
    a dead one's can) is removed: the close stops waiting at its timeout, and its sockets are
    closed by the hub when the replay has timed out, not left open."""
    ctx = zmq.Context.instance()
    hung = ctx.socket(zmq.ROUTER)
    hung_ep = f"tcp://127.0.0.1:{hung.bind_to_random_port('tcp://127.0.0.1')}"
    rec = Recorder()
    try:
        with LossyPublisher(LOOPBACK, topic="kv") as pub, EventHub() as hub:
            sub = EventSubscriber(pub.endpoint, rec.on_batch, "a", hung_ep, rec.on_gap,
                                  replay_timeout_s=3.0, replay_on_start=False, hub=hub)  # fmt: skip
            n = warm_up(pub, rec)
            pub.drop = {n}
            pub.publish(batch(n))
            pub.publish(batch(n + 1))  # a gap: the replay asks the hung socket
            wait_for(lambda: hung.poll(0) != 0)
            t0 = time.monotonic()
            sub.close(timeout=0.1)
            assert time.monotonic() - t0 < 2.0  # the close did not wait the replay out
            assert not sub._sub.closed  # the repair thread may still use the subscriber
            wait_for(lambda: sub._sub.closed and sub._monitor.closed and sub._dealer is None, timeout_s=10)
            assert rec.gaps == ["a"]  # the timed-out replay, reported
    finally:
        hung.close(linger=0)
