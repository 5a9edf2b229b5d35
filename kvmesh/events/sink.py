"""One bound SUB socket that many publishers connect to: llm-d's central KV-event layout.

In that layout each vLLM pod's publisher *connects* to the endpoint picker (vLLM connects to
any endpoint that is not a wildcard: ``--kv-events-config`` endpoint
``tcp://<epp-service>:5557``) and names itself in its topic, ``kv@<pod>@<model>``, with
``topic: kv@$(POD_IP)@<model>`` in its config. :class:`BoundEventSink` binds that endpoint,
reads each message's publisher from its topic, keeps each publisher's sequence numbers, and
hands each batch to ``on_batch(name, batch)`` for every endpoint ``resolve(pod)`` names (the
topic's pod is the endpoint's ``ip:port``, as llm-d matches it, or its IP). One publisher per
topic: vLLM's data-parallel ranks connect to the endpoint's port plus their rank, which this
sink does not bind, so only rank 0 is heard in this layout.

There is no replay address to ask for a hole: a gap, or a sequence going backwards (the
publisher restarted, its cache empty), is reported through ``on_gap(name)`` for the pod's
endpoints, whose entries the router drops and rebuilds from the events that follow (as a
subscriber's unrepaired gap). A topic naming no known pod is counted and dropped.

Unauthenticated, as every KV-event socket is (docs/security.md): a publisher that can reach
the port can claim any pod and steer routing, never change the KV served. Bounded: a message
over ``max_message_bytes`` drops the connection before it is buffered, a topic over
``MAX_TOPIC_BYTES`` is malformed, and sequence numbers are kept only for topics naming a known
pod, at most ``MAX_PUBLISHERS`` of them (the least recent forgotten).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import zmq

from kvmesh.errors import EventDecodeError
from kvmesh.events.codec import EventBatch, decode_batch
from kvmesh.events.subscriber import MAX_MESSAGE_BYTES, _context, dual_stack

log = logging.getLogger(__name__)

MAX_PUBLISHERS = 65536
MAX_TOPIC_BYTES = 256  # kv@<pod>@<model>; longer is malformed (a frame may be 16 MiB)
_POLL_MS = 100
_DRAIN = 256  # messages read per wake-up at most


class BoundEventSink:
    """See the module docstring. ``resolve(pod)``: the endpoint names at that pod (its IP as
    the topic gives it), read on this sink's thread."""

    def __init__(
        self,
        endpoint: str,
        on_batch: Callable[[str, EventBatch], None],
        on_gap: Callable[[str], None],
        resolve: Callable[[str], Sequence[str]],
        topic_filter: str = "kv@",
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self._on_batch, self._on_gap, self._resolve = on_batch, on_gap, resolve
        self._seq: OrderedDict[str, int] = OrderedDict()  # topic -> last sequence number
        self.counts = dict.fromkeys(("batches", "events", "malformed", "unknown_pod", "gaps", "restarts"), 0)
        self._sock: zmq.Socket[bytes] = _context().socket(zmq.SUB)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        try:
            self.endpoint = self._bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise ValueError(f"cannot bind the KV event sink on {endpoint!r}: {exc}") from exc
        self._sock.setsockopt(zmq.SUBSCRIBE, topic_filter.encode())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-event-sink", daemon=True)
        self._thread.start()

    def _bind(self, endpoint: str) -> str:
        """An IPv6 address, or a wildcard (``*``, ``0.0.0.0``, llm-d's spelling) on both
        families where the host has IPv6 (IPv4 alone where not); an IPv4 address as it is."""
        if endpoint.startswith("tcp://0.0.0.0:"):
            endpoint = "tcp://*:" + endpoint.rsplit(":", 1)[1]
        if not endpoint.startswith(("tcp://*", "tcp://[")):
            self._sock.bind(endpoint)
        else:
            dual_stack(self._sock)
            try:
                self._sock.bind(endpoint)
            except zmq.ZMQError:
                if endpoint.startswith("tcp://["):
                    raise
                self._sock.setsockopt(zmq.IPV6, 0)
                self._sock.bind(endpoint)
        bound = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        return bound.decode() if isinstance(bound, bytes) else endpoint

    def stats(self) -> dict[str, int]:
        return {**self.counts, "publishers": len(self._seq)}

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread; it closes the socket (the port is free once it has)."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("KV event sink did not stop within %.1fs; it closes its socket when it does", timeout)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    if not self._sock.poll(_POLL_MS):
                        continue
                    for _ in range(_DRAIN):
                        if self._stop.is_set():
                            break
                        self.on_message(self._sock.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    continue
                except zmq.ZMQError as exc:
                    if self._stop.is_set():
                        return
                    log.warning("KV event sink: %s", exc)
                except Exception:  # one bad message must not end the thread
                    log.exception("KV event sink: a message failed")
        finally:
            self._sock.close(linger=0)

    def on_message(self, frames: list[bytes]) -> None:
        """One ``[topic, seq, payload]`` message (public for tests: no socket needed)."""
        if len(frames) != 3 or len(frames[1]) != 8 or len(frames[0]) > MAX_TOPIC_BYTES:
            self.counts["malformed"] += 1
            return
        topic = frames[0].decode("utf-8", "replace")
        parts = topic.split("@")
        names = tuple(self._resolve(parts[1])) if len(parts) == 3 and parts[1] else ()
        if not names:  # nothing kept for it: a topic per message costs nothing
            self.counts["unknown_pod"] += 1
            return
        seq = int.from_bytes(frames[1], "big")
        last = self._seq.pop(topic, None)
        if len(self._seq) >= MAX_PUBLISHERS:
            self._seq.popitem(last=False)
        self._seq[topic] = seq
        if last is not None and seq == last:
            return  # a duplicate
        if last is not None and seq < last:
            self.counts["restarts"] += 1
            self._gap(names)
        elif last is not None and seq > last + 1:
            self.counts["gaps"] += 1
            self._gap(names)
        try:
            batch = decode_batch(frames[2])
        except EventDecodeError as exc:
            self.counts["malformed"] += 1
            log.debug("dropping a malformed KV event batch from %s: %s", topic, exc)
            return
        self.counts["batches"] += 1
        self.counts["events"] += len(batch.events)
        for name in names:
            self._on_batch(name, batch)

    def _gap(self, names: Sequence[str]) -> None:
        for name in names:
            self._on_gap(name)
