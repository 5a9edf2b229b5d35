"""ZMQ publisher for KV events, wire-compatible with vLLM's ``ZmqEventPublisher``.

Live stream, PUB socket, three frames per batch::

    [topic, seq (8-byte big-endian), payload]

``seq`` counts batches from 0. The last ``buffer`` payloads are kept so that a subscriber
which saw a hole in ``seq`` can ask for them again on the replay socket (ROUTER). A replay
request is one message ``[b"", start_seq (8-byte big-endian)]`` from a DEALER (a REQ socket
adds the empty frame itself); the answer is one message per buffered batch with
``seq >= start_seq``::

    [b"", topic, seq, payload]

and then an end marker ``[b"", b"", (-1 as 8-byte signed big-endian), b""]``.

Every socket is owned by one background thread, because ZMQ sockets are not thread-safe;
``publish`` only puts the batch on a queue.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Literal

import zmq

from kvmesh.errors import ClosedError
from kvmesh.events.codec import Event, EventBatch, encode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind and return the real endpoint (``tcp://host:0`` picks a free port)."""
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)  # an IPv6 address: ZMQ takes it only so
    sock.bind(endpoint)
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else endpoint


class EventPublisher:
    """Publishes :class:`EventBatch` es with sequence numbers and a replay buffer.

    ``endpoint`` and ``replay_endpoint`` are bound (``tcp://*:5557``, ``tcp://127.0.0.1:0``,
    ``ipc://…``); the bound addresses are in :attr:`endpoint` / :attr:`replay_endpoint`.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "kv",
        buffer: int = 10_000,
        shape: Literal["map", "array"] = "map",
        hwm: int = 100_000,
    ) -> None:
        if buffer <= 0:
            raise ValueError(f"buffer must be a positive number of batches, got {buffer}")
        if shape not in ("map", "array"):
            raise ValueError(f"shape must be 'map' or 'array', got {shape!r}")
        self._shape = shape
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._queue: queue.Queue[EventBatch | None] = queue.Queue()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        # Sockets are created here so a bad endpoint fails the constructor, then used only by
        # the thread (handing a socket over before Thread.start() is safe in ZMQ).
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self.endpoint = _bind(self._pub, endpoint)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"cannot bind KV event publisher on {endpoint!r}: {exc}") from exc
        self._seq = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvmesh-event-pub", daemon=True)
        self._thread.start()

    def publish(self, events: EventBatch | Sequence[Event]) -> None:
        """Queue one batch; it gets the next sequence number when the thread sends it."""
        if self._closed:
            raise ClosedError("EventPublisher is closed; create a new one to publish")
        if not isinstance(events, EventBatch):
            events = EventBatch(time.time(), tuple(events))
        self._queue.put(events)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch has been sent; False if that took over ``timeout``."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, stop the thread and close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("KV event publisher thread did not stop within %.1fs", timeout)
        else:
            self._close_sockets()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                with contextlib.suppress(zmq.ZMQError):
                    while self._replay.poll(0):
                        self._serve_replay(self._replay)
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            try:
                if batch is None:
                    return
                self._send(batch)
            except Exception:  # keep publishing: one bad batch must not stop the stream
                log.exception("KV event publisher failed to send a batch")
            finally:
                self._queue.task_done()

    def _send(self, batch: EventBatch) -> None:
        seq = self._seq
        self._seq += 1
        payload = encode_batch(batch, shape=self._shape)
        self._buffer.append((seq, payload))
        self._send_live(seq, [self._topic, seq.to_bytes(8, "big"), payload])

    def _send_live(self, seq: int, frames: list[bytes]) -> None:
        """The one place a batch goes onto the live stream (tests override it to lose one)."""
        self._pub.send_multipart(frames)

    def _serve_replay(self, sock: zmq.Socket[bytes]) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring malformed KV event replay request (%d frames)", len(frames))
            return
        client, empty, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in self._buffer:
            if seq >= start:
                sock.send_multipart([client, empty, self._topic, seq.to_bytes(8, "big"), payload])
        sock.send_multipart([client, empty, b"", END_SEQ, b""])

    def _close_sockets(self) -> None:
        # A short linger lets the last batches leave; the replay socket has nothing to finish.
        self._pub.close(linger=200)
        if self._replay is not None:
            self._replay.close(linger=0)
