"""Async write-behind to one lower tier, and background prefetch.

A :class:`WriteBehind` owns a bounded queue and one worker thread. Each job holds a
reference on the pool object it writes, so the bytes are neither copied nor reused until
they have landed: a burst of evictions costs pool slots (a fixed budget), never unbounded
memory. When the queue is full, :meth:`WriteBehind.submit` waits up to ``wait_s`` and then
drops the write (counted) — the caller's request never waits on disk or the network by
default. A key already queued is not queued twice.

:class:`InFlight` counts work that runs out of order (stores on several threads, a saver's
jobs) so that a caller can wait for what began before it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from kvmesh.core.keys import ChunkKey
from kvmesh.core.memory import MemoryObj
from kvmesh.errors import TierError
from kvmesh.tiers.base import ChunkData, Tier

log = logging.getLogger(__name__)
BATCH = 8  # jobs per tier.put call: lets Redis pipeline several chunks


class InFlight:
    """Numbered work items between :meth:`begin` and :meth:`end`, and :meth:`settle`: a wait
    for the items begun before the call only, not for an idle moment (a busy engine or saver
    may never have one)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0
        self._open: set[int] = set()

    def begin(self) -> int:
        with self._cond:
            n = self._next
            self._next += 1
            self._open.add(n)
            return n

    def end(self, n: int) -> None:
        with self._cond:
            self._open.discard(n)
            self._cond.notify_all()

    def settle(self, timeout: float | None = None) -> bool:
        """Block until every item begun before this call has ended. ``False`` on timeout."""
        with self._cond:
            mark = self._next
            return self._cond.wait_for(lambda: not any(n < mark for n in self._open), timeout)


class WriteBehind:
    def __init__(self, tier: Tier, maxsize: int, wait_s: float = 0.0) -> None:
        self.tier = tier
        self.wait_s = wait_s
        self._q: queue.Queue[tuple[ChunkKey, MemoryObj, str] | None] = queue.Queue(maxsize)
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._submitted = 0
        self._landed = 0
        self._thread = threading.Thread(target=self._run, name=f"kvmesh-write-{tier.name}", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    @property
    def submitted(self) -> int:
        with self._lock:
            return self._submitted

    def submit(self, key: ChunkKey, obj: MemoryObj, lifetime: str = "") -> bool:
        """Queue ``obj`` for writing (``lifetime``: its class, see kvmesh.tiers.placement);
        takes its own reference. ``False`` if dropped."""
        with self._lock:
            if key.text in self._queued:
                return True
            self._queued.add(key.text)
            self._pending += 1
            self._submitted += 1
        obj.ref_up()
        try:
            self._q.put((key, obj, lifetime), timeout=self.wait_s) if self.wait_s > 0 else self._q.put_nowait(
                (key, obj, lifetime)
            )
        except queue.Full:
            obj.release()
            self._done([key.text], landed=False)
            self.tier.metrics.skip("queue_full")
            return False
        self.tier.metrics.set("write_queue_depth", self._q.qsize())
        return True

    def wait(self, timeout: float | None = None, upto: int | None = None) -> bool:
        """Block until every job submitted so far (or the first ``upto``) has been handled."""
        with self._lock:
            target = self._submitted if upto is None else upto
            return self._idle.wait_for(lambda: self._landed >= target, timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.wait(timeout)
        self._q.put(None)
        self._thread.join(timeout)

    def _done(self, texts: list[str], landed: bool) -> None:
        with self._lock:
            for t in texts:
                self._queued.discard(t)
            self._pending -= len(texts)
            self._landed += len(texts)
            self._idle.notify_all()

    def _run(self) -> None:
        while True:
            first = self._q.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while len(batch) < BATCH:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            self.tier.metrics.set("write_queue_depth", self._q.qsize())
            self._write(batch)
            if stop:
                return

    def _write(self, batch: list[tuple[ChunkKey, MemoryObj, str]]) -> None:
        keys = [k for k, _, _ in batch]
        chunks = []
        for k, obj, lifetime in batch:
            assert obj.layout is not None and obj.tokens is not None  # set before submit
            chunks.append(ChunkData(k, obj.layout, obj.tokens, obj.raw(), lifetime=lifetime))
        try:
            self.tier.put(keys, chunks)  # a chunk it cannot keep it counts itself, with the reason
        except TierError as exc:
            self.tier.metrics.inc("errors")
            self.tier.metrics.skip("tier_error", len(keys))
            log.debug("write-behind to %s failed: %s", self.tier.name, exc)
        except Exception:  # a tier bug must not kill the writer thread
            self.tier.metrics.inc("errors")
            self.tier.metrics.skip("tier_error", len(keys))
            log.exception("write-behind to %s crashed", self.tier.name)
        finally:
            for _, obj, _ in batch:
                obj.release()
            self._done([k.text for k in keys], landed=True)


class Prefetcher:
    """One background thread running prefetch jobs (callables) from a bounded queue."""

    def __init__(self, maxsize: int = 64) -> None:
        self._q: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize)
        self._thread = threading.Thread(target=self._run, name="kvmesh-prefetch", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> bool:
        try:
            self._q.put_nowait(job)
            return True
        except queue.Full:
            return False

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every job submitted so far has run; ``False`` on timeout. (A marker
        job queued behind them: it waits for room in a full queue rather than give up.)"""
        done = threading.Event()
        end = None if timeout is None else time.monotonic() + timeout
        try:
            self._q.put(done.set, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(None if end is None else max(0.0, end - time.monotonic()))

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                log.exception("prefetch job failed")
