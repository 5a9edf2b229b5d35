"""The forward thread's half of asynchronous loads: the worker copies the chunks a reader
thread brought into the pool (asyncload.py) into vLLM's pages, and names each request once
(vLLM's ``finished_recving``). A mixin of :class:`~kvmesh.integrations.vllm.worker.WorkerSide`,
kept apart so the worker module stays small."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvmesh.integrations.vllm.asyncload import LoadJob, LoadJobs
from kvmesh.integrations.vllm.hybrid import GroupStore, copy_in
from kvmesh.integrations.vllm.layouts import PageLayout
from kvmesh.integrations.vllm.metadata import LoadSpec
from kvmesh.integrations.vllm.stepclock import StepClock

if TYPE_CHECKING:
    from kvmesh.core.engine import RetrievedChunk
    from kvmesh.integrations.vllm.transfer import Transfer

log = logging.getLogger(__name__)

# A load the cost model predicts to end soon after the step's forward is waited for when
# vLLM asks what finished, up to this share of the forward just run and at most
# FINISH_WAIT_S: its request then starts computing at the next step instead of the one after
# (a whole step later). Each load is waited for once at most, so the batch's step grows by at
# most half of itself, once per load. A load the cost model has no figure for yet (a tier's
# first loads in this process) is waited for once too, at the first step after it started:
# never waiting cost each of a fresh engine's first lower-tier hits a step.
# Measured (bench stall, 2,000 tokens from cold disk beside 4 decodes): see docs/datapath.md.
FINISH_WAIT_SHARE = 0.5
FINISH_WAIT_S = 0.005


class AsyncLoadSteps:
    # Provided by WorkerSide.
    loads: LoadJobs
    xfer: Transfer | None
    page: PageLayout
    layers: list[torch.Tensor]
    counters: Counter[str]
    _lock: threading.Lock
    groups: list[GroupStore]
    block_size: int
    clock: StepClock

    def _copies(
        self, spec: LoadSpec, chunks: Sequence[RetrievedChunk]
    ) -> tuple[list[tuple[torch.Tensor, list[int]]], int]:
        raise NotImplementedError

    def _account(self, spec: LoadSpec, loaded: int) -> None:
        raise NotImplementedError

    def finished_loading(self, finished: set[str]) -> set[str]:
        """vLLM's ``finished_recving``: asynchronous loads whose blocks now hold their KV
        (or are reported invalid), each named once. Runs on the forward thread: it also
        copies the chunks of reads that have ended into the pages."""
        for req in finished:
            self.loads.abort(req)  # finished while waiting: vLLM frees its blocks once named
        self._await_nearly_done()
        out: set[str] = set()
        now = time.monotonic()
        for job in self.loads.snapshot():
            if job.copy_done is not None:  # host-device copy queued at an earlier step
                if job.copy_done.query():
                    out.add(self._finish_load(job, job.loaded))
                continue
            if not job.done.is_set():
                if job.aborted and self.loads.give_up(job):
                    # Nobody waits for it: named now, so vLLM frees its blocks at once rather
                    # than when the read ends (a pull from a hung producer: its whole budget).
                    # give_up waited for any chunk being copied, and none follows.
                    out.add(self._finish_load(job, 0, count=False))
                elif now > job.deadline and self.loads.give_up(job):
                    log.warning(
                        "kvmesh: request %s: its load overran its %.1f s budget; vLLM recomputes it",
                        job.spec.req_id,
                        self.loads.budget_s,
                    )
                    with self._lock:
                        self.counters["load_timeouts"] += 1
                    out.add(self._finish_load(job, 0))
                continue
            if job.aborted:
                out.add(self._finish_load(job, 0, count=False))
                continue
            if job.copied is not None:  # the reader copied it into the pages (vLLM-CPU)
                out.add(self._finish_load(job, job.copied))
                continue
            out.add(self._copy_async(job))
        return {r for r in out if r}

    def _await_nearly_done(self) -> None:
        """Wait, for at most ``FINISH_WAIT_SHARE`` of the forward just run (and
        ``FINISH_WAIT_S``), for the loads predicted to end within that time, or with no
        figure yet; each load once at most. Only where the reader copies into the pages
        itself (vLLM-CPU), so that an ended read is a request ready to compute; never for a
        PD pull (a transfer of the whole prompt, not predicted)."""
        last = self.clock.last_s
        if self.loads.copy_in is None or not last:
            return
        end = time.monotonic() + min(FINISH_WAIT_S, FINISH_WAIT_SHARE * last)
        for job in self.loads.snapshot():
            if job.done.is_set() or job.aborted or job.waited or job.spec.pd is not None:
                continue
            now = time.monotonic()
            if now >= end or (job.expect_s is not None and job.started + job.expect_s > end):
                continue  # predicted to end later: named at a later step
            job.waited = True
            ended = job.done.wait(end - now)
            with self._lock:
                self.counters["load_finish_waits"] += 1
                self.counters["load_finish_waits_missed"] += not ended

    def copy_in_reader(self, job: LoadJob) -> int | None:
        """``LoadJobs.copy_in`` (vLLM-CPU, one KV cache group): the job's chunks into its
        pages, on the reader thread, one chunk at a time under ``job.copy_lock``. ``None``
        when the job was given up or aborted before its last chunk: nothing more is copied
        into blocks vLLM may have handed on."""
        items, loaded = self._copies(job.spec, job.chunks)
        for view, ids in items:
            with job.copy_lock:
                if job.given_up or job.aborted:
                    return None
                self.page.scatter(view, self.layers, ids)
        return loaded

    def _copy_async(self, job: LoadJob) -> str:
        items, loaded = self._copies(job.spec, job.chunks)
        try:
            if self.xfer is None:
                for view, ids in items:
                    self.page.scatter(view, self.layers, ids)
                if self.groups:  # a hybrid model's other groups (hybrid.py)
                    loaded = min(loaded, copy_in(self.groups, job.spec, job.extra, self.block_size))
            else:
                job.copy_done = self.xfer.load_now(items)
                job.loaded = loaded
                if not job.copy_done.query():
                    return ""  # named at a later step, once the copy has completed
        except Exception:
            log.exception("kvmesh: copying request %s's KV failed; vLLM recomputes it", job.spec.req_id)
            loaded = 0
        return self._finish_load(job, loaded)

    def _finish_load(self, job: LoadJob, loaded: int, count: bool = True) -> str:
        self.loads.take(job.spec.req_id)
        if not job.given_up:
            job.close()  # the read's pool references (a given-up read closes its own)
        if count:
            self._account(job.spec, loaded)
        return job.spec.req_id
