"""A background thread that finishes the worker's saves after the step that computed them.

``wait_for_save`` runs inside vLLM's step, before the step's tokens are sampled and sent: a
new prompt's time to first token includes it. The worker therefore does only what must
happen before the next forward can overwrite the blocks — one contiguous gather of the
blocks to save, per layer — and hands the rest (the transposing copy into the pool, the
pool insert, the write-behind submission, the events) to this thread.

Bounded: jobs hold their block snapshots until done, and a submit that would take the
pending bytes over ``max_pending_bytes`` waits for the thread to catch up (nothing is
dropped). The thread runs at a lower CPU priority (``nice``) than the process: on a busy
core the step's own work goes first.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import zlib
from collections.abc import Callable

from kvmesh.core.offload import InFlight
from kvmesh.errors import ClosedError
from kvmesh.integrations.vllm.cpus import background_cpus, background_thread

log = logging.getLogger(__name__)

MAX_PENDING_BYTES = 256 << 20
NICE = 5  # added to the thread's niceness (Linux: per thread)


class BackgroundSaver:
    """``workers`` threads; jobs with the same ``key`` (a request) run on the same thread, in
    order, so a request's chunks are stored and announced in prompt order, while different
    requests' saves run side by side (one slow save no longer holds every other back)."""

    def __init__(
        self, max_pending_bytes: int = MAX_PENDING_BYTES, nice: int = NICE, workers: int = 1
    ) -> None:
        self.max_pending_bytes = max_pending_bytes
        self._nice = nice
        self._cond = threading.Condition()
        self._queues: list[collections.deque[tuple[Callable[[], None], int, int]]] = [
            collections.deque() for _ in range(max(1, workers))
        ]
        self._pending_bytes = 0
        self._busy = 0
        self._jobs = InFlight()  # what settle() waits for
        self._closed = False
        self.done = 0
        self.failed = 0
        self.waits = 0  # submits that had to wait for room
        self._threads = [
            threading.Thread(target=self._run, args=(q,), name="kvmesh-save", daemon=True)
            for q in self._queues
        ]
        for t in self._threads:
            t.start()

    @property
    def pending(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues) + self._busy

    def submit(self, job: Callable[[], None], nbytes: int, key: str = "") -> None:
        """Queue ``job``; waits while the queues hold more than ``max_pending_bytes`` (a
        single job larger than that still goes, once nothing else is pending)."""
        with self._cond:
            if self._closed:
                raise ClosedError("the saver is closed")

            def room() -> bool:
                return not self._pending_bytes or self._pending_bytes + nbytes <= self.max_pending_bytes

            if not room():
                self.waits += 1
                self._cond.wait_for(room)
            self._queues[zlib.crc32(key.encode()) % len(self._queues)].append(
                (job, nbytes, self._jobs.begin())
            )
            self._pending_bytes += nbytes
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Block until every job submitted so far is done. ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not any(self._queues) and not self._busy, timeout)

    def settle(self, timeout: float | None = None) -> bool:
        """Block until every job submitted before this call is done; later ones may still
        run (a busy replica's saver never drains). ``False`` on timeout."""
        return self._jobs.settle(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued jobs (up to ``timeout``), then stop the threads."""
        self.drain(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)

    def _run(self, jobs: collections.deque[tuple[Callable[[], None], int, int]]) -> None:
        # Off vLLM-CPU's compute cores (cpus.py) it competes with no forward: full priority
        # there (at nice +5 beside the engine core's busy polling a save reached the pool
        # too late for the next request's lookup); on a shared core, below the forward.
        if background_cpus():
            background_thread()
        elif self._nice and hasattr(os, "setpriority"):
            try:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self._nice)
            except OSError:
                pass
        while True:
            with self._cond:
                self._cond.wait_for(lambda: jobs or self._closed)
                if not jobs:
                    return
                job, nbytes, seq = jobs.popleft()
                self._busy += 1
            try:
                job()
                ok = True
            except Exception:
                log.exception("kvmesh: a background save failed (a cache miss later, nothing worse)")
                ok = False
            with self._cond:
                self._busy -= 1
                self._jobs.end(seq)
                self._pending_bytes -= nbytes
                self.done += ok
                self.failed += not ok
                self._cond.notify_all()
