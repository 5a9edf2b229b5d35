"""One thread for many replicas' KV-event streams: epoll over their sockets.

An :class:`~kvmesh.events.EventSubscriber` owns a thread by default. At 1,000 replicas that
is 1,000 threads contending for the GIL: each batch wakes one, and a thread that wants the
GIL while another computes waits out the interpreter's switch interval (5 ms), so lag
grew to seconds at 10k events/s (``kvmesh bench scale``). Subscribers given a hub
(``EventSubscriber(..., hub=hub)``) are served by the hub's one thread instead: it waits on
every socket at once and drains the readable ones, each at most ``burst`` messages per
round so that one busy replica cannot starve the others.

Gap repair (a replay: a round trip to the replica's replay socket, at most its
``replay_timeout_s``) runs on a small pool of repair threads, never on the hub's: the
replica under repair is taken out of the poll, its live messages wait in its socket, and it
comes back once its replay has delivered. A replica that is down, or a hostile one that
never answers, costs its own stream its timeout and every other replica nothing. The replay
each subscriber makes when it joins (``replay_on_start``) goes the same way, so a router
that starts with 1,000 replicas, some of them not up yet, serves the others' events at once.

The hub waits with epoll on each socket's ZMQ_FD, so a wait costs what is ready, not what
is registered: ``zmq_poll`` over the 2,000 sockets of 1,000 replicas (a SUB and a monitor
each) takes ~1 ms a call here even when none is ready, epoll ~1 µs, and at 1,000 replicas
most waits end with one or two batches to read.

The sockets are the subscribers' own, so each carries its ``ZMQ_MAXMSGSIZE``
(:data:`~kvmesh.events.subscriber.MAX_MESSAGE_BYTES`) here as well.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import selectors
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import zmq

from kvmesh.errors import ClosedError

if TYPE_CHECKING:
    from kvmesh.events.subscriber import EventSubscriber

log = logging.getLogger(__name__)

_POLL_MS = 100
REPAIR_THREADS = 4
_Change = tuple[str, "EventSubscriber", threading.Event | None]  # op, whom, set when done


class EventHub:
    """The thread that serves its subscribers' sockets; see the module docstring.

    ``repair_threads``: how many replicas' replays may run at once, off the hub's thread.
    """

    def __init__(
        self, burst: int = 64, name: str = "kvmesh-event-hub", repair_threads: int = REPAIR_THREADS
    ) -> None:
        if burst <= 0:
            raise ValueError(f"burst must be positive, got {burst}")
        if repair_threads <= 0:
            raise ValueError(f"repair_threads must be positive, got {repair_threads}")
        self.burst = burst
        self._changes: queue.SimpleQueue[_Change] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # _repairing, and a subscriber's stop against a new repair
        self._repairing: dict[EventSubscriber, Future[None]] = {}
        # Subscribers whose close stopped waiting for the hub: it closes their sockets itself
        # once neither its thread nor a repair uses them.
        self._orphans: set[EventSubscriber] = set()
        self._repairs = ThreadPoolExecutor(repair_threads, thread_name_prefix=f"{name}-repair")
        # A pipe the poll watches: changes (a replica added, removed, back from a repair) are
        # seen at once, not at the poll's next timeout.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()  # no write to the pipe once it is closed
        self._wake_closed = False
        # The hub's thread alone uses these: the poll, whom each socket serves, and the sockets
        # to look at again without waiting (see _run).
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._by_socket: dict[zmq.Socket[bytes], EventSubscriber] = {}
        self._pending: set[zmq.Socket[bytes]] = set()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, sub: EventSubscriber) -> None:
        """Serve ``sub`` from the next poll round on (called by its constructor); its replay
        on start, if it makes one, runs first, on a repair thread."""
        if self._stop.is_set():
            raise ClosedError("the event hub is closed")
        self._post("add", sub)

    def remove(self, sub: EventSubscriber, timeout: float = 2.0) -> bool:
        """Stop serving ``sub`` (whose stop flag is set); True once neither the hub's thread
        nor a repair thread uses its sockets."""
        if self._stop.is_set() or not self._thread.is_alive():
            return True
        deadline = time.monotonic() + timeout
        with self._lock:  # after sub's stop flag: no repair starts for it from here on
            running = self._repairing.get(sub)
        if running is not None:
            try:
                running.result(timeout)
            except FutureTimeout:
                return False
        done = threading.Event()
        self._post("remove", sub, done)
        return done.wait(max(0.0, deadline - time.monotonic()))

    def close_when_released(self, sub: EventSubscriber) -> None:
        """``sub`` (stopped) stopped waiting for :meth:`remove`: close its sockets when the
        hub's thread and any repair have let go of them, so that a remove that timed out
        (a replay hanging on a dead replica) leaks none."""
        with self._lock:
            self._orphans.add(sub)
        self._post("remove", sub)

    def _release(self, sub: EventSubscriber) -> None:
        """The hub's thread, after a remove or the end of a repair (or :meth:`close`, once
        that thread has ended): close an orphan's sockets once no repair uses them. A stopped
        subscriber is out of the poll by then (dropped by its remove or before its repair,
        never served again)."""
        with self._lock:
            if sub not in self._orphans or sub in self._repairing:
                return
            self._orphans.discard(sub)
        try:
            sub._close_sockets()
        except Exception:  # never the end of the hub's thread
            log.exception("KV event hub: closing %s's sockets", sub.replica)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread (subscribers still registered stop receiving). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        self._thread.join(timeout)
        self._repairs.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            for sub in list(self._orphans):  # what no repair holds any more
                self._release(sub)
            with self._wake_lock:  # a repair still running may post its resume: not to a reused fd
                self._wake_closed = True
                os.close(self._wake_r)
                os.close(self._wake_w)

    def __enter__(self) -> EventHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the hub's thread --------------------------------------------------------------------------

    def _post(self, op: str, sub: EventSubscriber, done: threading.Event | None = None) -> None:
        self._changes.put((op, sub, done))
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock, contextlib.suppress(BlockingIOError):  # full: a wake-up is pending
            if not self._wake_closed:
                os.write(self._wake_w, b"\0")

    def _repair(self, sub: EventSubscriber, fn: Callable[..., None], *args: Any) -> bool:
        """Run ``fn`` (a replay and what it delivers) for ``sub`` on a repair thread; ``sub``
        comes back to the poll when it is done. False if ``sub`` is stopping."""

        def run() -> None:
            try:
                fn(*args)
            except Exception:  # the stream goes on; the subscriber's own errors are counted there
                log.exception("KV event repair for %s failed", sub.replica)
            finally:
                with self._lock:
                    self._repairing.pop(sub, None)
                self._post("resume", sub)

        with self._lock:
            if sub._stop.is_set() or self._stop.is_set():
                return False
            self._repairing[sub] = self._repairs.submit(run)
        return True

    def _run(self) -> None:
        # epoll over each socket's ZMQ_FD: a wait costs what is ready, not what is registered
        # (see the module docstring). The FD says "look at ZMQ_EVENTS": it signals when
        # messages arrive at an empty queue, not per message, so a socket is read until
        # EAGAIN, or kept in ``_pending`` and looked at again without waiting.
        try:
            while not self._stop.is_set():
                while not self._changes.empty():
                    op, sub, done = self._changes.get()
                    if op == "add":
                        if not sub._wants_start_replay() or not self._repair(sub, sub._started):
                            self._serve(sub)
                    elif op == "resume":
                        self._serve(sub)
                        self._release(sub)
                    else:
                        self._drop(sub)
                        self._release(sub)
                    if done is not None:
                        done.set()
                try:
                    events = self._sel.select(0 if self._pending else _POLL_MS / 1000)
                except OSError as exc:
                    log.warning("KV event hub: %s", exc)
                    time.sleep(_POLL_MS / 1000)
                    continue
                look = self._pending.copy()
                self._pending.clear()
                for key, _ in events:
                    if key.data is None:
                        with contextlib.suppress(BlockingIOError, OSError):
                            while os.read(self._wake_r, 4096):
                                pass
                    else:
                        look.add(key.data)
                for sock in look:
                    try:
                        self._serve_socket(sock)
                    except Exception:  # one replica's fault must not end every replica's events
                        owner = self._by_socket.get(sock)
                        log.exception("KV event hub, %s", owner.replica if owner else "a removed replica")
        finally:
            self._sel.close()

    def _serve(self, sub: EventSubscriber) -> None:
        if sub._stop.is_set() or sub._sub in self._by_socket:
            return
        for sock in (sub._sub, sub._monitor):
            self._sel.register(_fd(sock), selectors.EVENT_READ, sock)
            self._by_socket[sock] = sub
            self._pending.add(sock)  # what arrived before is not signalled again

    def _drop(self, sub: EventSubscriber) -> None:
        if sub._sub in self._by_socket:
            for sock in (sub._sub, sub._monitor):
                self._sel.unregister(_fd(sock))
                del self._by_socket[sock]
                self._pending.discard(sock)

    def _serve_socket(self, sock: zmq.Socket[bytes]) -> None:
        owner = self._by_socket.get(sock)
        if owner is None:  # taken out earlier in this round (a repair)
            return
        try:
            readable = int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN  # also re-arms the FD
        except zmq.ZMQError as exc:
            log.warning("KV event hub, %s: %s", owner.replica, exc)
            return
        if not readable:
            return
        if sock is owner._monitor:
            owner._on_monitor()  # reads it until EAGAIN
            return
        for _ in range(self.burst):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                log.warning("KV event hub, %s: %s", owner.replica, exc)
                return
            if owner._wants_replay(frames):
                # Out of the loop until its replay has delivered: its later messages wait in
                # its socket, in order; everyone else's go on.
                self._drop(owner)
                if not self._repair(owner, owner._on_live, frames):
                    self._serve(owner)  # stopping: the remove that follows takes it out
                return
            owner._on_live(frames)
        self._pending.add(sock)  # a burst's worth read: the rest next round, after the others


def _fd(sock: zmq.Socket[bytes]) -> int:
    """The file descriptor that signals ``sock``'s events (ZMQ_FD)."""
    return int(sock.getsockopt(zmq.FD))
