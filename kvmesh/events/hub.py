"""One thread for many replicas' KV-event streams: a ``zmq.Poller`` over their SUB sockets.

An :class:`~kvmesh.events.EventSubscriber` owns a thread by default. At 1,000 replicas that
is 1,000 threads contending for the GIL: each batch wakes one, and a thread that wants the
GIL while another computes waits out the interpreter's switch interval (5 ms), so lag
grew to seconds at 10k events/s (``kvmesh bench scale``). Subscribers given a hub
(``EventSubscriber(..., hub=hub)``) are served by the hub's one thread instead: it polls
every socket at once and drains the readable ones, each at most ``burst`` messages per
round so that one busy replica cannot starve the others.

Gap repair works as without a hub, on the hub's thread: a replay (a round trip to the
replica's replay socket, at most its ``replay_timeout_s``) holds up the other replicas'
streams meanwhile, so a hub suits fleets whose replicas are up when they are added (the
bench); a router whose replicas come and go may prefer a thread per replica.

The sockets are the subscribers' own, so each carries its ``ZMQ_MAXMSGSIZE``
(:data:`~kvmesh.events.subscriber.MAX_MESSAGE_BYTES`) here as well.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

import zmq

from kvmesh.errors import ClosedError

if TYPE_CHECKING:
    from kvmesh.events.subscriber import EventSubscriber

log = logging.getLogger(__name__)

_POLL_MS = 100


class EventHub:
    """The thread that serves its subscribers' sockets; see the module docstring."""

    def __init__(self, burst: int = 64, name: str = "kvmesh-event-hub") -> None:
        if burst <= 0:
            raise ValueError(f"burst must be positive, got {burst}")
        self.burst = burst
        self._changes: queue.SimpleQueue[tuple[str, EventSubscriber, threading.Event]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, sub: EventSubscriber) -> None:
        """Serve ``sub`` from the next poll round on (called by its constructor)."""
        if self._stop.is_set():
            raise ClosedError("the event hub is closed")
        self._changes.put(("add", sub, threading.Event()))

    def remove(self, sub: EventSubscriber, timeout: float = 2.0) -> bool:
        """Stop serving ``sub``; True once the hub's thread has let go of its sockets."""
        if self._stop.is_set() or not self._thread.is_alive():
            return True
        done = threading.Event()
        self._changes.put(("remove", sub, done))
        return done.wait(timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread (subscribers still registered stop receiving). Idempotent."""
        self._stop.set()
        self._thread.join(timeout)

    def __enter__(self) -> EventHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket: dict[zmq.Socket[bytes], EventSubscriber] = {}
        while not self._stop.is_set():
            while not self._changes.empty():
                op, sub, done = self._changes.get()
                if op == "add":
                    for sock in (sub._sub, sub._monitor):
                        poller.register(sock, zmq.POLLIN)
                        by_socket[sock] = sub
                    sub._started()  # its replay on start, on this thread
                elif sub._sub in by_socket:
                    for sock in (sub._sub, sub._monitor):
                        poller.unregister(sock)
                        del by_socket[sock]
                done.set()
            try:
                ready = poller.poll(_POLL_MS) if by_socket else []
            except zmq.ZMQError as exc:
                log.warning("KV event hub: %s", exc)
                time.sleep(_POLL_MS / 1000)
                continue
            for sock, _ in ready:
                owner = by_socket.get(sock)
                if owner is None:
                    continue
                if sock is owner._monitor:
                    owner._on_monitor()
                    continue
                for _ in range(self.burst):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except zmq.ZMQError as exc:
                        log.warning("KV event hub, %s: %s", owner.replica, exc)
                        break
                    owner._on_live(frames)
