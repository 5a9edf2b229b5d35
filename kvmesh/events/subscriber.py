"""Subscriber to one replica's KV-event stream, with sequence-gap repair.

One daemon thread per replica owns a SUB socket (and, when a replay endpoint is given, a
DEALER socket for replay requests), or, given an :class:`~kvmesh.events.hub.EventHub`, the
hub's one thread serves it with every other replica's. Batches reach ``on_batch`` strictly
in sequence order.

A hole in the sequence numbers means the router's view of that replica is now wrong: a
missed ``BlockRemoved`` would leave an entry that routes requests to a prefix that is gone.
So a gap is either repaired from the publisher's replay buffer (protocol: see
:mod:`kvmesh.events.publisher`, identical to vLLM's) or reported through
``on_gap_unrepaired(replica)``, after which the router drops that replica's entries and
rebuilds them from the events that follow. A sequence number going *backwards* means the
publisher restarted (its cache is empty); that is reported the same way.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import zmq

from kvmesh.errors import EventDecodeError
from kvmesh.events.codec import EventBatch, decode_batch
from kvmesh.events.publisher import END_SEQ

if TYPE_CHECKING:
    from kvmesh.events.hub import EventHub

log = logging.getLogger(__name__)

_POLL_MS = 100
# ZMQ_MAXMSGSIZE of every subscriber socket: a peer announcing a larger message is
# disconnected before it is buffered (ZMQ's default is no limit: a hostile publisher could
# make the router allocate whatever it announces). A real batch (one engine step's blocks
# with their token ids) is well under a MiB.
MAX_MESSAGE_BYTES = 16 << 20

# A whole replay takes at most this many replay timeouts (vLLM's buffer of 10,000 batches
# replays in a few seconds; each answer must still come within one timeout).
REPLAY_BUDGET = 10

# Sockets one context may hold: a subscriber holds up to four (SUB, its monitor's pair, the
# replay DEALER), so ZMQ's default of 1,023 would stop a router near 250 replicas.
MAX_SOCKETS = 1 << 16


def dual_stack(sock: zmq.Socket[bytes]) -> None:
    """ZMQ reaches an IPv6 address (``tcp://[fd00::7]:5557``: a pod's IP in an IPv6 cluster,
    or a name with only an AAAA record) only with ZMQ_IPV6 set; set, it reaches IPv4 too."""
    sock.setsockopt(zmq.IPV6, 1)


def _context() -> zmq.Context[zmq.Socket[bytes]]:
    """The process's ZMQ context, allowed :data:`MAX_SOCKETS` (the cap takes effect only
    before its first socket; a context another module started keeps its own)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    with contextlib.suppress(zmq.ZMQError):
        if ctx.get(zmq.MAX_SOCKETS) < MAX_SOCKETS:
            ctx.set(zmq.MAX_SOCKETS, min(MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT)))
    return ctx


BatchCallback = Callable[[str, EventBatch], None]
GapCallback = Callable[[str], None]
ReplayOutcome = Literal["ok", "reported", "failed"]


class EventSubscriber:
    """Consumes one publisher's batches on a daemon thread; see the module docstring.

    ``last_event_time`` is the ``time.monotonic()`` of the last message received (None
    before the first), so the router can tell that a replica has gone quiet.
    """

    def __init__(
        self,
        endpoint: str,
        on_batch: BatchCallback,
        replica: str,
        replay_endpoint: str | None = None,
        on_gap_unrepaired: GapCallback | None = None,
        topic: str = "",
        replay_timeout_s: float = 1.0,
        replay_on_start: bool = True,
        hub: EventHub | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self.replica = replica
        self.max_message_bytes = max_message_bytes
        self._hub = hub
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._on_batch = on_batch
        self._on_gap = on_gap_unrepaired
        self._replay_timeout_ms = max(1, int(replay_timeout_s * 1000))
        # Joining a running publisher: what it sent before is in its replay buffer.
        self._replay_on_start = replay_on_start
        self.last_event_time: float | None = None
        self._last_seq: int | None = None  # last delivered (live or replayed)
        self._live_seq: int | None = None  # last seen on the live socket
        self._counts = dict.fromkeys(
            (
                "batches",
                "events",
                "malformed",
                "gaps",
                "repaired",
                "unrepaired",
                "restarts",
                "callback_errors",
                "reconnects",
            ),
            0,
        )
        self._ctx: zmq.Context[zmq.Socket[bytes]] = _context()
        self._sub: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # before connect: it applies to new peers
        dual_stack(self._sub)
        try:
            self._sub.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sub.close(linger=0)
            raise ValueError(f"cannot connect KV event subscriber to {endpoint!r}: {exc}") from exc
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        # Tells us when the publisher's connection drops (see _on_monitor).
        self._monitor: zmq.Socket[bytes] = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._dealer: zmq.Socket[bytes] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvmesh-event-sub-{replica}", daemon=True)
        if hub is not None:
            hub.add(self)
        else:
            self._thread.start()

    def stats(self) -> dict[str, int]:
        """Counters: batches, events, malformed, gaps, repaired, unrepaired, restarts,
        callback_errors, reconnects."""
        return dict(self._counts)

    @property
    def last_seq(self) -> int | None:
        return self._last_seq

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread and close the sockets. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._hub is not None:
            if not self._hub.remove(self, timeout):
                log.warning("KV event hub did not let go of %s within %.1fs; it closes its sockets "
                            "when it does", self.replica, timeout)  # fmt: skip
                self._hub.close_when_released(self)
                return
        else:
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("KV event subscriber for %s did not stop within %.1fs", self.replica, timeout)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        """Once nothing else uses them: this thread stopped, or the hub let go (its thread
        calls this for a subscriber whose close stopped waiting)."""
        self._sub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)
        self._drop_dealer()

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- thread ---------------------------------------------------------------------------

    def _wants_start_replay(self) -> bool:
        return self.replay_endpoint is not None and self._replay_on_start

    def _wants_replay(self, frames: list[bytes]) -> bool:
        """Whether :meth:`_on_live` would ask for a replay on these frames (so that a hub
        runs it off its thread); no state changes."""
        if self.replay_endpoint is None or len(frames) != 3 or len(frames[1]) != 8:
            return False
        seq = int.from_bytes(frames[1], "big")
        restarted = self._live_seq is not None and seq <= self._live_seq
        last = None if restarted else self._last_seq
        if last is None:
            return seq > 0 and self._replay_on_start
        return seq > last + 1

    def _started(self) -> None:
        if self._wants_start_replay():
            # A (re)started router must not wait for the replica's next event to learn what it
            # already holds: an idle replica may send none for a long time. A replica not up
            # yet times out here, and the first live message asks again.
            self._replay(0)

    def _run(self) -> None:
        self._started()
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(_POLL_MS))
                if self._monitor in ready:
                    self._on_monitor()
                if self._sub not in ready:
                    continue
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                log.warning("KV event subscriber for %s: %s", self.replica, exc)
                time.sleep(_POLL_MS / 1000)
                continue
            self._on_live(frames)

    def _on_monitor(self) -> None:
        """The publisher's connection dropped. libzmq reconnects by itself after a network
        error, but never after a protocol error, and a message over ``ZMQ_MAXMSGSIZE`` is one:
        connect again, so that one oversized (or hostile) message does not cut this replica's
        events off for good. Whatever was lost meanwhile shows as a sequence gap."""
        while True:
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
        if self._stop.is_set():
            return
        self._counts["reconnects"] += 1
        self._sub.disconnect(self.endpoint)
        self._sub.connect(self.endpoint)

    def _on_live(self, frames: list[bytes]) -> None:
        self.last_event_time = time.monotonic()
        if len(frames) != 3 or len(frames[1]) != 8:
            self._counts["malformed"] += 1
            return
        seq = int.from_bytes(frames[1], "big")
        if self._live_seq is not None and seq <= self._live_seq:
            # Going backwards on the live stream (replayed copies are not counted here).
            self._counts["restarts"] += 1
            self._unrepaired()
            self._last_seq = None
        self._live_seq = seq
        last = self._last_seq
        if last is not None and seq <= last:
            return  # already delivered by a replay
        if last is None:
            if seq > 0 and self.replay_endpoint is not None and self._replay_on_start:
                self._replay(0)
        elif seq > last + 1:
            self._counts["gaps"] += 1
            outcome = self._replay(last + 1) if self.replay_endpoint is not None else "failed"
            caught_up = self._last_seq is not None and self._last_seq >= seq - 1
            if outcome == "ok" and caught_up:
                self._counts["repaired"] += 1
            elif outcome == "failed" or not caught_up:
                # Not everything came back: the entries are wrong from here on.
                self._unrepaired()
        if self._last_seq is None or seq > self._last_seq:
            self._deliver(seq, frames[2])

    def _replay(self, start: int) -> ReplayOutcome:
        """Ask for every buffered batch from ``start``; deliver the ones in order.

        ``"ok"``: the answer was complete and contiguous. ``"reported"``: the buffer no longer
        reached back far enough, ``on_gap_unrepaired`` was called and the rest delivered.
        ``"failed"``: no complete answer (timeout); nothing was reported yet.
        """
        dealer = self._get_dealer()
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        outcome: ReplayOutcome = "ok"
        # Each answer within the timeout, and the whole replay within REPLAY_BUDGET of them:
        # a replay socket that drips stale or malformed frames forever must not hold this
        # stream (or, with a hub, a repair thread) forever.
        deadline = time.monotonic() + REPLAY_BUDGET * self._replay_timeout_ms / 1000
        while True:
            wait_ms = min(self._replay_timeout_ms, int((deadline - time.monotonic()) * 1000))
            if wait_ms <= 0 or not dealer.poll(wait_ms):
                log.warning("KV event replay from %s timed out", self.replay_endpoint)
                self._drop_dealer()  # late answers must not be read as the next replay's
                return "failed"
            frames = dealer.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                self._counts["malformed"] += 1
                continue
            if frames[2] == END_SEQ:
                return outcome
            seq = int.from_bytes(frames[2], "big")
            last = self._last_seq
            if last is not None and seq <= last:
                continue
            if last is not None and seq > last + 1 and outcome == "ok":
                # The buffer has rolled past what we need: report once, then keep what we get.
                self._unrepaired()
                outcome = "reported"
            self._deliver(seq, frames[3])

    def _deliver(self, seq: int, payload: bytes) -> None:
        if self._stop.is_set():
            # Closed: nothing more reaches the callback, also while a hub that has not let go
            # yet (its remove timed out) still reads the socket. A router that removes a
            # replica forgets its entries next, and a batch after that would add them back.
            return
        self._last_seq = seq
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            self._counts["malformed"] += 1
            log.debug("dropping malformed KV event batch %d from %s: %s", seq, self.replica, exc)
            return
        self._counts["batches"] += 1
        self._counts["events"] += len(batch.events)
        try:
            self._on_batch(self.replica, batch)
        except Exception:  # the stream must go on; the callback's bug is logged and counted
            self._counts["callback_errors"] += 1
            log.exception("KV event callback failed for %s", self.replica)

    def _unrepaired(self) -> None:
        self._counts["unrepaired"] += 1
        if self._on_gap is None:
            return
        try:
            self._on_gap(self.replica)
        except Exception:
            self._counts["callback_errors"] += 1
            log.exception("gap callback failed for %s", self.replica)

    def _get_dealer(self) -> zmq.Socket[bytes]:
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            dual_stack(self._dealer)
            self._dealer.connect(self.replay_endpoint or "")
        return self._dealer

    def _drop_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
