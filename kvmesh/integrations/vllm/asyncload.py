"""Loads and lookups that run beside vLLM's step instead of inside it.

vLLM's connector API has an asynchronous load path: ``get_num_new_matched_tokens`` answers
``(n, True)``, the scheduler allocates the blocks and parks the request in
``WAITING_FOR_REMOTE_KVS``, the worker reads the KV while the rest of the batch keeps
stepping, and ``get_finished`` names the request once its blocks hold the KV (blocks it
could not fill are reported by ``get_block_ids_with_load_errors`` and vLLM recomputes them:
``kv_load_failure_policy: recompute``).

This module holds the worker's two kinds of background work:

* :class:`LookupJobs` — the scheduler's lookup, which may have to ask a remote tier. The
  worker waits a few milliseconds for it (a local or CPU answer is that fast) and otherwise
  answers "pending": the scheduler then answers vLLM "not known yet" and asks again at a
  later step, so a slow or hung Redis delays that request only.
* :class:`LoadJobs` — the reads of a load: a PD pull from the producer (if any), then the
  chunks from the tiers into the pool (``retrieve_chunks``, under the remote deadline),
  held until the forward thread has copied them into vLLM's blocks. A job that outlives
  its budget is given up: its request is reported finished with every block invalid, and
  whatever the job reads later is dropped (those blocks may belong to someone else by then).

On vLLM-CPU the reader also copies the chunks into the request's pages (``copy_in``): the
blocks are the parked request's alone until vLLM is told the load ended, and a copy on the
forward thread was a step of its own for every decode in the batch (4-14 ms for 2,000
tokens of the bench model against 3 ms decode steps). Each chunk is copied holding the job's
``copy_lock``, which :meth:`LoadJobs.give_up` takes too: once a job is given up (reported,
so vLLM may recompute into its blocks) no copy into them follows. Where a copy must be
queued on a device stream (the host-device path) or spans several KV cache groups (hybrid
models), it stays on the forward thread (asyncsteps.py), at the step after the read ended.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvmesh.core.engine import CacheEngine, RetrievedChunk
from kvmesh.core.saylimit import SayLimit, held_back
from kvmesh.integrations.vllm.cpus import background_thread
from kvmesh.integrations.vllm.device import Event
from kvmesh.integrations.vllm.metadata import LoadSpec

log = logging.getLogger(__name__)

# A new lookup answered within this is answered at once (cpu, disk, a near Redis); a slower
# one answers "pending" and costs its own request a step. The wait is inside the scheduler's
# step, so every running request's next token waits with it: 20 ms showed as one 20 ms gap
# per request that asked a far Redis (bench stall).
LOOKUP_WAIT_S = 0.005
# While a reader runs, the GIL changes hands every 0.2 ms instead of CPython's 5 ms: the
# forward loop is busy Python, so each time a reader came back from a system call it waited
# a whole interval for the GIL. Measured in real vllm-cpu (bench stall, 2,000 tokens of the
# bench model from cold disk beside 4 decodes, a loaded machine): 2.26 s with the default
# interval, 0.34-0.36 s with this one (docs/datapath.md).
READ_SWITCH_INTERVAL_S = 0.0002


class GilShare:
    """Lowers ``sys.setswitchinterval`` while at least one reader is active, and restores
    the interval that was in force when the last one ends."""

    def __init__(self, interval_s: float = READ_SWITCH_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._active = 0
        self._saved = sys.getswitchinterval()

    def __enter__(self) -> GilShare:
        with self._lock:
            if self._active == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, self.interval_s))
            self._active += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                sys.setswitchinterval(self._saved)


GIL_SHARE = GilShare()  # one per process: the interval is process-wide
PullFn = Callable[[str, list[int], dict[str, Any]], Any]


@dataclass
class _Lookup:
    seq: int
    started: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] | None = None
    released: bool = False  # the scheduler gave it up before it ended: unpin at once
    answered: bool = False  # its result was handed out (its pins belong to the ledger)


class LookupJobs:
    """Lookups on a small thread pool; ``run`` answers at once or ``{"pending": True}``, and
    a miss once a lookup has run ``budget_s`` (its request is computed, not held)."""

    def __init__(
        self,
        lookup: Callable[[np.ndarray, str | None], dict[str, Any]],
        unpin: Callable[[Any], Any],
        inline: bool = False,
        budget_s: float | None = None,
    ):
        self._lookup = lookup
        self._unpin = unpin
        # A remote tier's lookup ends within remote_timeout_s, but a tier with no deadline of
        # its own can hang for ever (a stat on a hung NFS server, a wedged client library):
        # its request would stay "not known yet", and once the pool's threads all hung, every
        # new request too. Past this budget the lookup is a miss; its late result unpins.
        self.budget_s = budget_s
        self.given_up = 0
        self._say = SayLimit()
        # Nothing the lookup asks can block (the cpu tier alone): it runs in the caller's
        # thread. The pool's hand-off (two thread wake-ups, each waiting for the GIL beside
        # vLLM's busy worker) cost a cpu-only lookup ~0.5 ms of the scheduler's step.
        self.inline = inline
        self._lock = threading.Lock()
        self._jobs: dict[str, _Lookup] = {}
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvmesh-lookup", initializer=background_thread)

    def run(self, req: str, seq: int, arr: np.ndarray, adapter: str | None = None) -> dict[str, Any]:
        """The answer of lookup ``(req, seq)`` (``adapter``: a LoRA request's adapter
        fingerprint): started now if it is new, waited for a few milliseconds;
        ``{"pending": True}`` while it runs on. A result's ``pinned`` is what ``unpin`` takes."""
        with self._lock:
            old = self._jobs.get(req)
            new = old is None or old.seq != seq
            if old is not None and new:
                old.released = True  # an older lookup of the same request
            if old is None or new:
                job = self._jobs[req] = _Lookup(seq)
                if not self.inline:
                    self._pool.submit(self._run, req, job, arr, adapter)
            else:
                job = old
        if new and self.inline:
            self._run(req, job, arr, adapter)
        # Only a new lookup is waited for: the scheduler asks again at every step while one
        # runs on, and its step (every running request's next token) waited LOOKUP_WAIT_S
        # each time: +20 ms per step for as long as a far or hung Redis took to answer.
        if not job.done.wait(LOOKUP_WAIT_S if new else 0.0):
            if self.budget_s is None or time.monotonic() - job.started < self.budget_s:
                return {"pending": True}
            with self._lock:
                hung = job.result is None  # else it ended meanwhile: its answer below
                if hung:
                    job.released = True  # its result unpins when (if ever) it comes
                    first, job.answered = not job.answered, True
                    self.given_up += first
            if hung:
                self._said_hung(req)
                return {"tokens": 0, "lower": False, "first": first}
        # Kept until released: another poll with the same seq (a tensor-parallel peer was
        # still pending) gets the same answer, not a second set of pins.
        with self._lock:
            first, job.answered = not job.answered, True
        return dict(job.result or {"tokens": 0}, first=first)

    def _said_hung(self, req: str) -> None:
        held = self._say.due()
        if held is not None:
            log.warning(
                "kvmesh: the lookup for %s has not ended in %.1f s; a miss, the request is computed "
                "(a tier that hangs: a hung network filesystem, a wedged store client)%s",
                req,
                self.budget_s,
                held_back(held),
            )

    def _run(self, req: str, job: _Lookup, arr: np.ndarray, adapter: str | None) -> None:
        try:
            with GIL_SHARE:
                result = self._lookup(arr, adapter)
        except Exception:  # a cache problem is a miss, never a dead lookup
            log.exception("kvmesh: lookup for %s failed; a miss", req)
            result = {"tokens": 0}
        with self._lock:  # with the give-up in run(): one of the two unpins a late result
            job.result = result
            gone = job.released
            if gone and self._jobs.get(req) is job:
                del self._jobs[req]
        if gone and job.result.get("pinned") is not None:
            self._unpin(job.result["pinned"])
        job.done.set()

    def release(self, req: str, seq: int | None = None) -> None:
        """Forget ``req``'s lookup (``seq``, or any): one still running unpins when done."""
        with self._lock:
            job = self._jobs.get(req)
            if job is None or (seq is not None and job.seq != seq):
                return
            if not job.done.is_set():
                job.released = True
                return
            del self._jobs[req]
            orphan = None if job.answered or job.result is None else job.result.get("pinned")
        if orphan is not None:  # ended, never handed out: its pins are nobody's
            self._unpin(orphan)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class LoadJob:
    spec: LoadSpec
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    chunks: list[RetrievedChunk] = field(default_factory=list)
    stack: contextlib.ExitStack | None = None
    aborted: bool = False  # vLLM finished the request while it waited: report at once, copy nothing
    given_up: bool = False  # past its budget, or aborted mid-read: reported already, drop what it reads
    copy_done: Event | None = None  # the host-device copy queued by the forward thread
    loaded: int = 0  # tokens copied (set by the forward thread)
    read_ended: bool = False  # set with the lock held, before ``done``
    copied: int | None = None  # tokens the reader copied into the pages (``LoadJobs.copy_in``)
    copy_lock: threading.Lock = field(default_factory=threading.Lock)  # a chunk's copy vs give_up
    extra: list[list[RetrievedChunk]] = field(default_factory=list)  # hybrid: the other groups' chunks
    started: float = field(default_factory=time.monotonic)
    expect_s: float | None = None  # the cost model's predicted duration (None: not measured yet)
    waited: bool = False  # get_finished waited for it once (asyncsteps.py): never again

    def close(self) -> None:
        if self.stack is not None:
            self.stack.close()
            self.stack = None


class LoadJobs:
    """Reads of asynchronous loads, on a small thread pool (never the forward thread)."""

    def __init__(
        self,
        engine: CacheEngine,
        budget_s: float,
        release: Callable[[str, int], Any],
        tokens: Callable[[list[int]], np.ndarray],
        pd_budget_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self.budget_s = budget_s
        self.pd_budget_s = pd_budget_s
        self._release = release
        self._tokens = tokens
        self.pd_pull: PullFn | None = None  # set by the connector when PD is on
        # Hybrid models (hybrid.py): reads the other KV cache groups' chunks of a load.
        self.extra_read: Callable[[LoadSpec, np.ndarray, contextlib.ExitStack], list[Any]] | None = None
        # vLLM-CPU: copies a job's chunks into its pages on the reader thread; returns the
        # tokens loaded, or None if the job was given up or aborted on the way (worker.py).
        self.copy_in: Callable[[LoadJob], int | None] | None = None
        self._lock = threading.Lock()
        self.jobs: dict[str, LoadJob] = {}
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvmesh-load", initializer=background_thread)

    def submit(self, spec: LoadSpec, expect_s: float | None = None) -> None:
        """Start ``spec``'s read; ``expect_s``: its predicted duration, if the cost model has one."""
        budget = self.budget_s + (self.pd_budget_s if spec.pd is not None else 0.0)
        now = time.monotonic()
        job = LoadJob(spec, now + budget, started=now, expect_s=None if spec.pd is not None else expect_s)
        with self._lock:
            self.jobs[spec.req_id] = job
        self._pool.submit(self._read, job)

    def _read(self, job: LoadJob) -> None:
        spec = job.spec
        stack = contextlib.ExitStack()
        try:
            with GIL_SHARE:
                if spec.pd is not None and self.pd_pull is not None:
                    self.pd_pull(spec.req_id, list(spec.token_ids), dict(spec.pd))
                arr = self._tokens(spec.token_ids)
                engine = self.engine.for_adapter(spec.adapter)
                job.chunks = stack.enter_context(engine.retrieve_chunks(arr, max_tokens=len(arr)))
                if self.extra_read is not None:
                    job.extra = self.extra_read(spec, arr, stack)
        except Exception:  # a cache problem: what was read is kept, the rest is recomputed
            log.exception("kvmesh: reading request %s's KV failed; vLLM recomputes it", spec.req_id)
        finally:
            self._release(spec.req_id, spec.seq)
        if self.copy_in is not None:
            try:
                job.copied = self.copy_in(job)
            except Exception:  # the blocks may hold part of it: all of them are recomputed
                log.exception("kvmesh: copying request %s's KV failed; vLLM recomputes it", spec.req_id)
                job.copied = 0
        with self._lock:
            drop = job.given_up or job.aborted
            job.stack = stack
            job.read_ended = True
        if drop:
            job.close()  # nobody will copy it: the blocks may be someone else's now
        job.done.set()

    def abort(self, req: str) -> None:
        with self._lock:
            job = self.jobs.get(req)
            if job is not None:
                job.aborted = True

    def take(self, req: str) -> LoadJob | None:
        with self._lock:
            return self.jobs.pop(req, None)

    def snapshot(self) -> list[LoadJob]:
        with self._lock:
            return list(self.jobs.values())

    def give_up(self, job: LoadJob) -> bool:
        """Mark ``job`` as past its budget unless its read has just ended. ``True``: given up."""
        with job.copy_lock, self._lock:  # a chunk's copy in progress ends first
            if job.read_ended:
                return False
            job.given_up = True
            return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for job in self.snapshot():
            if job.done.is_set():
                job.close()
