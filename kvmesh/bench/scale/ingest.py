"""KV-event ingest at fleet scale: simulated replicas publish, a separate process indexes.

The *sink* is its own process, as the router is: one :class:`~kvmesh.events.EventSubscriber`
per replica (the router's subscriber), all served by one :class:`~kvmesh.events.hub.EventHub`
thread (``hub=False``: one thread each, as before), feeding one
:class:`~kvmesh.index.BlockIndex`. It records, per batch, the lag from the batch's timestamp
(set when the replica sent it) to the end of its ``apply``. Python's GIL makes it one core.

The *sender* is this process: one thread over R PUB sockets, each batch encoded by
:func:`kvmesh.events.codec.encode_batch` (vLLM 0.32's map shape) and sent in
:class:`~kvmesh.events.EventPublisher`'s three frames (topic, 8-byte seq, payload). One
EventPublisher per simulated replica would put 1,000 publisher threads in the sending
process: that would measure the sender, not the router. Batches are paced to an offered
event rate; each holds ``EVENTS_PER_BATCH`` events of one replica (one engine step), 3 of 4
a ``BlockStored`` of ``BLOCKS_PER_EVENT`` 16-token blocks chained to that replica's last
one, 1 of 4 a ``BlockRemoved`` of blocks it stored earlier (so the index stays bounded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import zmq

from kvmesh.events import BlockRemoved, BlockStored, EventBatch, EventSubscriber
from kvmesh.events.codec import encode_batch
from kvmesh.index import BlockIndex

EVENTS_PER_BATCH = 16
BLOCKS_PER_EVENT = 4
BLOCK_SIZE = 16
LAG_TARGET_S = 0.1


def _allow_sockets(n: int) -> None:
    """ZMQ's default context stops at 1,023 sockets; a 1,000-replica fleet needs more."""
    zmq.Context.instance().set(zmq.MAX_SOCKETS, max(4096, 2 * n + 64))


def sink_main(endpoints: list[str], expected: int, max_blocks: int, hub: bool = True) -> None:
    """Subscribe to every endpoint, apply until ``expected`` events (or 5 s of quiet), print JSON."""
    _allow_sockets(len(endpoints))
    index = BlockIndex(max_blocks=max_blocks)
    lags: list[float] = []
    got = [0]
    first: list[float] = []
    last = [time.monotonic()]
    done = threading.Event()
    lock = threading.Lock()

    def on_batch(replica: str, batch: EventBatch) -> None:
        index.apply(replica, batch)
        now = time.time()
        with lock:
            if not first:
                first.append(now)
            lags.append(now - batch.ts)
            got[0] += len(batch.events)
            last[0] = time.monotonic()
            if got[0] >= expected:
                done.set()

    from kvmesh.events.hub import EventHub

    shared = EventHub() if hub else None
    subs = [
        EventSubscriber(ep, on_batch, f"r{i}", replay_on_start=False, hub=shared)
        for i, ep in enumerate(endpoints)
    ]
    time.sleep(1.0 + len(endpoints) / 500)  # PUB/SUB: let every subscription reach its publisher
    print("ready", flush=True)
    c0 = time.process_time()
    while not done.wait(0.2):
        if time.monotonic() - last[0] > 5.0 and got[0]:
            break
    cpu_s = time.process_time() - c0
    end = time.time()
    arr = np.array(lags) if lags else np.array([float("nan")])
    span = end - first[0] if first else float("nan")
    out = {
        "events": got[0],
        "lag_p50_ms": round(float(np.percentile(arr, 50)) * 1e3, 2),
        "lag_p99_ms": round(float(np.percentile(arr, 99)) * 1e3, 2),
        "sink_cpu_s": round(cpu_s, 2),
        "span_s": round(span, 2),
        "index": index.stats(),
    }
    print(json.dumps(out), flush=True)
    # Closing 1,000 busy subscribers one by one takes minutes; this process is done: leave.
    del subs
    os._exit(0)


class _Sender:
    """R PUB sockets, one thread; every replica keeps its own chain of stored blocks."""

    def __init__(self, replicas: int, seed: int = 0) -> None:
        _allow_sockets(replicas)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.socks: list[zmq.Socket[bytes]] = []
        self.endpoints: list[str] = []
        for _ in range(replicas):
            s = self.ctx.socket(zmq.PUB)
            s.setsockopt(zmq.SNDHWM, 1_000_000)
            s.bind("tcp://127.0.0.1:0")
            ep = s.getsockopt(zmq.LAST_ENDPOINT)
            self.endpoints.append(ep.decode() if isinstance(ep, bytes) else str(ep))
            self.socks.append(s)
        rng = np.random.default_rng(seed)
        n = BLOCKS_PER_EVENT * BLOCK_SIZE
        self.tokens = [tuple(rng.integers(0, 100_000, n).tolist()) for _ in range(256)]
        self.seq = [0] * replicas
        self.parent: list[int | None] = [None] * replicas
        self.held: list[deque[tuple[int, ...]]] = [deque() for _ in range(replicas)]
        self.next_hash = 1

    def batch(self, r: int) -> EventBatch:
        events: list[BlockStored | BlockRemoved] = []
        for k in range(EVENTS_PER_BATCH):
            if k % 4 == 3 and self.held[r]:
                events.append(BlockRemoved(self.held[r].popleft()))
                continue
            hashes = tuple(range(self.next_hash, self.next_hash + BLOCKS_PER_EVENT))
            self.next_hash += BLOCKS_PER_EVENT
            toks = self.tokens[(self.next_hash // BLOCKS_PER_EVENT) % len(self.tokens)]
            events.append(BlockStored(hashes, self.parent[r], toks, BLOCK_SIZE))
            self.parent[r] = hashes[-1]
            self.held[r].append(hashes)
        return EventBatch(time.time(), tuple(events))

    def send(self, r: int, batch: EventBatch) -> None:
        seq = self.seq[r]
        self.seq[r] = seq + 1
        self.socks[r].send_multipart([b"kv", seq.to_bytes(8, "big"), encode_batch(batch)])

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=2000)


def measure(
    replicas: int, rate: float, seconds: float, max_blocks: int = 1_000_000, hub: bool = True
) -> dict[str, Any]:
    """Offer ``rate`` events/s for ``seconds`` from ``replicas`` replicas; the sink's figures
    (``hub``: the sink's subscribers share one thread, else one thread each)."""
    sender = _Sender(replicas)
    batches = max(1, int(rate * seconds / EVENTS_PER_BATCH))
    expected = batches * EVENTS_PER_BATCH
    cmd = [
        sys.executable,
        "-m",
        "kvmesh.bench.scale.ingest",
        json.dumps([sender.endpoints, expected, max_blocks, hub]),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            return {"replicas": replicas, "offered_events_per_s": rate, "error": "sink did not start"}
        interval = EVENTS_PER_BATCH / rate
        t0 = time.perf_counter()
        for i in range(batches):
            due = t0 + i * interval
            wait = due - time.perf_counter()
            if wait > 0.001:
                time.sleep(wait)
            r = i % replicas
            sender.send(r, sender.batch(r))
        send_s = time.perf_counter() - t0
        line = proc.stdout.readline()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        sender.close()
    res: dict[str, Any] = json.loads(line) if line.strip() else {"error": "sink gave no result"}
    out: dict[str, Any] = {
        "replicas": replicas,
        "hub": hub,
        "offered_events_per_s": rate,
        "sent_events_per_s": round(expected / send_s),
        **res,
    }
    if "events" in res and res.get("span_s"):
        out["ingested_events_per_s"] = round(res["events"] / max(res["span_s"], send_s))
        out["blocks_per_event"] = BLOCKS_PER_EVENT * 3 / 4
        # Sustained: everything arrived at (nearly) the offered rate, and the lag stayed bounded.
        out["sustained"] = bool(
            res["events"] >= expected
            and out["ingested_events_per_s"] >= 0.9 * rate
            and res["lag_p99_ms"] <= LAG_TARGET_S * 1e3
        )
    return out


if __name__ == "__main__":
    eps, exp, mb, use_hub = json.loads(sys.argv[1])
    sink_main(eps, exp, mb, use_hub)
