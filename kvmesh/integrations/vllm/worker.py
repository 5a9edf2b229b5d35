"""The worker half of the connector: owns the :class:`~kvmesh.CacheEngine` in vLLM's
worker process, answers the scheduler's lookups, and moves KV between the paged cache and
kvmesh.

Loads are synchronous (done in ``start_load_kv``, before the forward that needs them).
Saves happen once per step, in ``wait_for_save``, after every layer has written its KV,
and in two halves: the step itself only snapshots the blocks of the newly computed prompt
chunks that the pool lacks (one contiguous gather per layer; the next forward may
overwrite those blocks); the saver thread (saver.py) then copies them into the engine's
pool, queues the disk / remote writes and announces them. A new prompt's first token thus
waits neither on I/O nor on the pool copy.

A chunk that cannot be loaded (evicted despite the pin, corrupt, tier down) turns its
blocks into "load errors": vLLM then recomputes from the first of them (connector policy
``kv_load_failure_policy="recompute"``). Whatever this step computed after that point was
computed on bad KV, so it is not saved either.

KV on a GPU (or any page layout but vLLM-CPU's) takes the host-device path instead
(transfer.py): loads are queued on a load stream, layer-major, and the forward waits per
layer (``wait_for_layer``); saves take no snapshot: the saver thread gathers the blocks on
a save stream after the step's compute event and copies them into the (pinned) pool, while
vLLM holds the blocks: a request that had saves is reported finished (``finished``) only
once they are done, and a preempted request's saves complete before the next forward
(``wait_for_preempted``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from kvmesh.admin.server import AdminServer, start_admin
from kvmesh.core.engine import CacheEngine, RetrievedChunk
from kvmesh.core.keys import ChunkKey, as_token_array
from kvmesh.integrations.vllm import hybrid
from kvmesh.integrations.vllm.asyncload import LoadJobs, LookupJobs
from kvmesh.integrations.vllm.asyncsteps import AsyncLoadSteps
from kvmesh.integrations.vllm.device import Event
from kvmesh.integrations.vllm.hybrid import GroupStore
from kvmesh.integrations.vllm.layouts import CpuPackedPages, PageLayout
from kvmesh.integrations.vllm.metadata import KVMeshConnectorMetadata, LoadSpec, SaveSpec
from kvmesh.integrations.vllm.prom import StatsGate
from kvmesh.integrations.vllm.rpc import Handler
from kvmesh.integrations.vllm.saver import BackgroundSaver
from kvmesh.integrations.vllm.stepclock import StepClock
from kvmesh.integrations.vllm.tracker import EventTracker
from kvmesh.integrations.vllm.transfer import Transfer

Fill = Callable[[int, int, torch.Tensor], None]

log = logging.getLogger(__name__)
SAVERS = 2  # saver threads on the host-device path


def _tokens(ids: Sequence[int]) -> np.ndarray:
    # as_token_array checks list items one by one; a numpy array takes its fast path.
    return as_token_array(np.asarray(ids, dtype=np.int64))


class WorkerSide(AsyncLoadSteps):
    def __init__(
        self,
        engine: CacheEngine,
        layers: Sequence[torch.Tensor],
        block_size: int,
        events: bool = True,
        page: PageLayout | None = None,
        layer_names: Sequence[str] = (),
        layerwise: bool = False,
        async_loads: str = "lower",
        pd_budget_s: float = 0.0,
        groups: Sequence[GroupStore] = (),
        main_group: int = 0,
    ) -> None:
        self.engine = engine
        # A hybrid model's other KV cache groups (hybrid.py); the engine caches the main one.
        self.groups = list(groups)
        self._failed_recv: set[str] = set()  # hybrid: loads that fell short (failed receives)
        self.layers = list(layers)
        self.block_size = block_size
        self.page = page if page is not None else CpuPackedPages(block_size)
        on_device = bool(self.layers) and self.layers[0].device.type != "cpu"
        # vLLM-CPU keeps its tuned snapshot path; everything else goes through Transfer.
        self.xfer: Transfer | None = None
        if on_device or not isinstance(self.page, CpuPackedPages):
            self.xfer = Transfer(self.page, self.layers, engine.layout, engine.config.chunk_size)
        # Layer-wise waits only when allowed and once vLLM is seen calling the hook.
        self._layer_index = {name: i for i, name in enumerate(layer_names)} if layerwise else {}
        self._layerwise = False  # vLLM called wait_for_layer_load: per-layer waits are safe
        self._loads_open: contextlib.ExitStack | None = None
        self._submitted: KVMeshConnectorMetadata | None = None  # whose async loads are started
        self._after_forward: Event | None = None
        self._saves_cond = threading.Condition()
        self._in_flight: Counter[str] = Counter()  # req -> device-path saves not yet in the pool
        self._saving: set[str] = set()  # reqs that got a SaveSpec: vLLM holds their blocks for us
        self._finishing: set[str] = set()  # finished, waiting for their saves
        self.chunk_size = engine.config.chunk_size
        self.events = EventTracker(
            engine, block_size, enabled=events, group=main_group if self.groups else None
        )
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()  # the ledger and counters: the RPC thread shares them
        self._ledger: dict[str, tuple[int, Any]] = {}  # req -> (lookup seq, pins: tokens or hybrid.Pins)
        self._expect: dict[str, tuple[int, float]] = {}  # req -> (lookup seq, its load's predicted seconds)
        self._load_errors: set[int] = set()
        self._failed_at: dict[str, int] = {}  # this step: req -> first token whose KV is bad
        self._in_kvmesh: dict[str, int] = {}  # req -> leading tokens loaded from kvmesh
        # Host-device path: saves of different requests run side by side (each thread its
        # own save stream and staging, transfer.py); vLLM-CPU's snapshot path keeps one.
        self._saver = BackgroundSaver(workers=SAVERS if self.xfer is not None else 1)
        for e in (engine, *(g.engine for g in self.groups)):
            e.store_barriers.append(self._saver.settle)  # what "stored so far" waits for
        # Asynchronous loads (asyncload.py): "lower" = chunks below the cpu tier (and PD pulls)
        # load beside the steps, cpu hits within their step; "all" = every load; "off" = none.
        self.async_loads = async_loads
        # skip_slow_loads weighs a recompute by the batch it would stall (loadcost.py)
        engine.costs.loads_beside_batch = async_loads != "off"
        # A lookup that asks no lower tier (the cpu tier alone: the default config) cannot
        # block, and runs in the RPC thread that received it. One with a disk tier keeps the
        # pool too: in-thread, its cold-disk reload read 0.03-0.07 higher against
        # ExampleConnector in each of three interleaved A/B pairs (docs/bench/ttft.md).
        blocking = any(e.lower for e in (engine, *(g.engine for g in self.groups)))
        look = functools.partial(self._lookup_now, fetch=True)
        budget = engine.config.remote_timeout_s + 1.0  # a load's too (LoadJobs below)
        self._lookups = LookupJobs(look, self._unpin, inline=not blocking, budget_s=budget)
        self.loads = LoadJobs(engine, budget, self.release, _tokens, pd_budget_s=pd_budget_s)
        if self.groups:
            self.loads.extra_read = lambda spec, arr, stack: hybrid.read(self.groups, spec, arr, stack)
        elif self.xfer is None:  # vLLM-CPU: the reader copies into the pages too (asyncload.py)
            self.loads.copy_in = self.copy_in_reader
        # Forward times against scheduled tokens: the engine's prefill rate (loadcost.py).
        self.clock = StepClock(engine.costs, self.layers[0].device if self.layers else torch.device("cpu"))
        self.cost_stats = StatsGate(engine.cost_figures)  # vLLM's /metrics (prom.py)
        self.stats_hooks: list[Callable[[], dict[str, Any]]] = []  # merged into stats' connector
        # The admin HTTP API (on unless admin_enabled is false); rank r listens on admin_port + r.
        self.admin: AdminServer | None = start_admin(
            engine,
            default_on=True,
            port_offset=engine.keys.shard,
            on_clear=self.events.resync,
            extra_stats=lambda: {"connector": self.stats()["connector"]},
            held=self.events.held,
        )

    # -- RPC (scheduler process) ---------------------------------------------------------
    def handlers(self) -> dict[str, Handler]:
        return {
            "lookup": self.lookup,
            "release": self.release,
            "stats": self.stats,
            "clear": self.clear,
            "wait_for_writes": self.wait_for_writes,
        }

    def lookup(
        self, req: str, seq: int, tokens: list[int], detail: bool = False, adapter: str | None = None
    ) -> Any:
        """Leading tokens held in any tier, pinned under ``(req, seq)`` until released;
        ``adapter``: a LoRA request's adapter fingerprint (its chunks have their own keys).

        ``detail``: answer ``{"tokens": n, "lower": bool}`` (``lower``: some of them are
        below the cpu tier, so vLLM should load them asynchronously) within a few
        milliseconds, or ``{"pending": True}`` while the lookup waits on a slow tier (the
        scheduler asks again with the same ``seq``)."""
        arr = _tokens(tokens)
        if not detail:
            self.release(req)  # a request looked up again replaces its earlier pins
            return self._record(req, seq, self._lookup_now(arr, adapter))["tokens"]
        with self._lock:
            current = self._ledger.get(req)
        if current is not None and current[0] != seq:
            self.release(req)  # a request looked up again replaces its earlier pins
        got = self._lookups.run(req, seq, arr, adapter)
        if got.pop("pending", False):
            return {"pending": True}
        if not got.pop("first"):
            got.pop("pinned", None)
            got.pop("expect_s", None)
            return got  # the same lookup asked again: same answer, pins taken once
        return self._record(req, seq, got)

    def _lookup_now(self, arr: np.ndarray, adapter: str | None = None, fetch: bool = False) -> dict[str, Any]:
        if self.groups:
            # A hybrid model's group engines have no adapter views: the scheduler never sends
            # a LoRA request's lookup here (SchedulerSide._adapter), and one that came would
            # find nothing rather than another adapter's KV.
            if adapter is not None:
                return {"tokens": 0, "lower": False, "pinned": None}
            n, pins, below = hybrid.lookup(self.engine, self.groups, arr)
            lower = below or self.async_loads == "all"
            return {"tokens": n, "lower": bool(n and lower), "pinned": pins or None}
        engine = self.engine.for_adapter(adapter)
        # An asynchronous lookup runs beside the steps: it reads what only the remote holds
        # (one round trip, not a lookup's and then a load's), and the load that follows
        # still goes beside the batch (the copy into the pages on the reader thread).
        held = engine.lookup_detail(arr, pin=True, fetch=fetch)
        n = held.tokens
        lower = self.async_loads == "all" or (self.async_loads == "lower" and held.below)
        return {
            "tokens": n,
            "lower": bool(n and lower),
            "pinned": (adapter, arr[:n]) if n else None,
            "expect_s": held.expect_s,
        }

    def _unpin(self, pinned: Any) -> None:
        """Undo a lookup's pins (``pinned``: a hybrid model's group pins, or the adapter and
        tokens of :meth:`_lookup_now`)."""
        if isinstance(pinned, list):
            hybrid.unpin(pinned)
        else:
            self.engine.for_adapter(pinned[0]).unpin(pinned[1])

    def _record(self, req: str, seq: int, got: dict[str, Any]) -> dict[str, Any]:
        n = int(got["tokens"])
        pinned = got.pop("pinned", None)
        expect = got.pop("expect_s", None)  # the worker's own: the scheduler plans without it
        with self._lock:
            self.counters["lookups"] += 1
            self.counters["lookup_hit_tokens"] += n
            if n and pinned is not None:
                self._ledger[req] = (seq, pinned)
                if expect is not None:
                    self._expect[req] = (seq, float(expect))
        return got

    def release(self, req: str, seq: int | None = None) -> bool:
        """Unpin what lookup ``seq`` (any, if ``None``) pinned for ``req``. A release for
        an older lookup than the current one is ignored."""
        with self._lock:
            entry = self._ledger.get(req)
            if entry is None or (seq is not None and entry[0] != seq):
                if entry is None:
                    self._lookups.release(req, seq)  # one still running unpins by itself
                return False
            del self._ledger[req]
            self._expect.pop(req, None)
        self._lookups.release(req, seq)
        self._unpin(entry[1])
        return True

    def stats(self) -> dict[str, Any]:
        with self._lock:
            connector = dict(self.counters)
            connector["pinned_requests"] = len(self._ledger)
        connector["save_queue"] = self._saver.pending
        connector["save_failures"] = connector.get("save_failures", 0) + self._saver.failed
        connector["save_waits"] = self._saver.waits
        connector["lookup_timeouts"] = self._lookups.given_up
        for hook in self.stats_hooks:
            connector.update(hook())
        out = {"engine": self.engine.stats(), "connector": connector, "costs": self.engine.cost_figures()}
        if self.groups:  # a hybrid model: every other KV cache group's engine, by its tag
            out["groups"] = {st.group.tag: st.engine.stats() for st in self.groups}
        return out

    def clear(self, tier: str | None = None, force: bool = False) -> dict[str, int]:
        self._saver.drain()  # a save still in flight would land after the clear
        out = self.engine.clear(tier, force=force)
        for st in self.groups:  # a hybrid model's other groups go with it
            st.engine.clear(tier, force=force)
        self.events.resync()
        return out

    def drain_saves(self, timeout: float | None = None) -> bool:
        """Block until every save handed over so far is in the pool. ``False`` on timeout."""
        return bool(self._saver.drain(timeout))

    def wait_for_writes(self, timeout: float | None = None) -> bool:
        """Block until every save handed over so far is in the pool and its tier writes
        have landed. ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        # Each engine's wait settles the saver first (its store barrier).
        for engine in [self.engine, *(st.engine for st in self.groups)]:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not engine.wait_for_writes(left):
                return False
        return True

    # -- one engine step (worker process) ------------------------------------------------
    def bound(self, meta: KVMeshConnectorMetadata) -> None:
        """vLLM bound this step's metadata: its forward comes next. vLLM 0.32 calls
        ``start_load_kv`` *after* the forward when the step has no synchronous loads
        (``SchedulerOutput.has_sync_kv_loads``), so the step clock starts here; a step with
        synchronous loads restarts it once they are issued (:meth:`start_step`)."""
        self.clock.begin(meta.scheduled_tokens, meta.scheduled_requests)
        self.engine.costs.batch = meta.scheduled_requests
        # Asynchronous loads start now, beside this step's forward: from start_load_kv (after
        # the forward, see above) a read could not end before this step's get_finished, and
        # its request waited one more step to be named.
        self._submit_async(meta)

    def _submit_async(self, meta: KVMeshConnectorMetadata) -> None:
        if self._submitted is meta:
            return
        self._submitted = meta
        for spec in meta.loads:
            if spec.load_async:
                with self._lock:
                    seq, expect = self._expect.get(spec.req_id, (None, None))
                # read beside the steps; named once in its pages
                self.loads.submit(spec, expect if seq == spec.seq else None)

    def start_step(self, meta: KVMeshConnectorMetadata) -> None:
        self._close_loads()
        for req, seq in meta.releases:
            self.release(req, seq)
        self._submit_async(meta)  # unless bound() did
        loads = [spec for spec in meta.loads if not spec.load_async]  # this step's synchronous loads
        if self.xfer is None:
            for spec in loads:
                self._load(spec, None)
            if loads:  # vLLM runs the forward after this call only when it has sync loads
                self.clock.begin(meta.scheduled_tokens, meta.scheduled_requests)
            return
        stack = contextlib.ExitStack()  # the retrieved chunks stay held until copied
        items: list[tuple[torch.Tensor, list[int]]] = []
        try:
            for spec in loads:
                self._load(spec, (stack, items))
            self.xfer.load(items, layerwise=self._layerwise)
        except Exception:  # a cache problem must never fail vLLM's step: recompute them all
            log.exception("kvmesh: queueing this step's loads failed; vLLM recomputes them")
            with self._lock:
                for spec in loads:
                    self._load_errors.update(spec.block_ids[spec.skip // self.block_size :])
                    self._failed_at[spec.req_id] = spec.skip
                    self._in_kvmesh.pop(spec.req_id, None)
                    self.counters["load_failures"] += 1
        finally:
            self._loads_open = stack
        if not self._layerwise:  # until vLLM is seen calling the layer hooks: wait for all
            self.xfer.wait_all_layers()
        if loads:  # the forward starts now, not at bind time (see bound)
            self.clock.begin(meta.scheduled_tokens, meta.scheduled_requests)

    def wait_for_layer(self, layer_name: str) -> None:
        """vLLM's ``wait_for_layer_load``: the compute stream waits for this layer's loads."""
        i = self._layer_index.get(layer_name)
        if self.xfer is None or i is None:
            return
        self._layerwise = True
        self.xfer.wait_layer(i)

    def _close_loads(self) -> None:
        if self._loads_open is not None:
            if self.xfer is not None:
                self.xfer.finish_loads()
            self._loads_open.close()
            self._loads_open = None

    def _copies(
        self, spec: LoadSpec, chunks: Sequence[RetrievedChunk]
    ) -> tuple[list[tuple[torch.Tensor, list[int]]], int]:
        """``(chunk view, block ids)`` to copy for ``spec`` from the leading ``chunks``, and
        the tokens they reach."""
        bs, end = self.block_size, spec.end
        loaded = 0
        items: list[tuple[torch.Tensor, list[int]]] = []
        for c in chunks:
            if c.start != loaded or loaded >= end:
                break
            stop = min(c.end, end)
            if stop > spec.skip:  # blocks below skip are vLLM's own shared blocks
                s = max(c.start, spec.skip)
                view = c.kv[:, :, s - c.start : stop - c.start]
                items.append((view, spec.block_ids[s // bs : -(-stop // bs)]))
            loaded = stop
        return items, loaded

    def _load(
        self, spec: LoadSpec, queue: tuple[contextlib.ExitStack, list[tuple[torch.Tensor, list[int]]]] | None
    ) -> None:
        loaded = 0
        try:
            tokens = _tokens(spec.token_ids)
            with contextlib.ExitStack() as local:
                holder = queue[0] if queue is not None else local
                engine = self.engine.for_adapter(spec.adapter)
                chunks = holder.enter_context(engine.retrieve_chunks(tokens, max_tokens=len(tokens)))
                t0 = time.perf_counter()  # the reads are done: what follows is the copy into pages
                items, loaded = self._copies(spec, chunks)
                if queue is not None:
                    queue[1].extend(items)
                else:
                    for view, ids in items:
                        self.page.scatter(view, self.layers, ids)
                if queue is None and loaded > spec.skip:
                    # the cpu tier's load cost: the copy into vLLM's pages (kvmesh.core.loadcost)
                    nbytes = (loaded - spec.skip) * self.engine.layout.bytes_per_token
                    self.engine.costs.observe_load("cpu", nbytes, time.perf_counter() - t0)
        except Exception:
            log.exception("kvmesh: loading request %s failed; vLLM will recompute it", spec.req_id)
            loaded = 0
        finally:
            self.release(spec.req_id, spec.seq)
        self._account(spec, loaded)

    def _account(self, spec: LoadSpec, loaded: int) -> None:
        """Counters, and the blocks vLLM must recompute when ``loaded`` falls short (a
        synchronous load's step then computes on bad KV past them: nothing saved there)."""
        bs, end = self.block_size, spec.end
        self._in_kvmesh[spec.req_id] = loaded
        with self._lock:
            if loaded >= end:
                self.counters["loads"] += 1
                self.counters["load_tokens"] += end - spec.skip
                return
            first = max(loaded, spec.skip)
            if self.groups:  # block ids are per group: vLLM takes a failed receive instead
                self._failed_recv.add(spec.req_id)
                first = 0
            else:
                self._load_errors.update(spec.block_ids[first // bs : -(-end // bs)])
            if not spec.load_async:
                self._failed_at[spec.req_id] = first
            self.counters["load_failures"] += 1
            self.counters["failed_tokens"] += end - first
        log.warning(
            "kvmesh: request %s: loaded %d of %d tokens; vLLM recomputes from token %d",
            spec.req_id,
            max(0, loaded - spec.skip),
            end - spec.skip,
            first,
        )

    def end_step(self, meta: KVMeshConnectorMetadata) -> None:
        self.clock.end()
        if self._loads_open is not None and self.xfer is not None and self.xfer.loads_done():
            self._close_loads()  # else at the next step: the host never waits for a copy here
        if self.xfer is not None and meta.saves:
            self._after_forward = self.xfer.after_forward()
        try:
            for spec in meta.saves:
                if self.xfer is not None:
                    self._saving.add(spec.req_id)
                try:
                    self._save(spec)
                except Exception:  # a cache problem must never fail vLLM's step
                    log.exception(
                        "kvmesh: saving request %s failed (a cache miss later, nothing worse)", spec.req_id
                    )
                    with self._lock:
                        self.counters["save_failures"] += 1
        finally:
            self._failed_at.clear()

    def _save(self, spec: SaveSpec) -> None:
        """Hand the chunks to save to the saver thread: on vLLM-CPU with a snapshot of their
        blocks (the next forward may overwrite them once this step ends); on the
        host-device path with the step's compute event (vLLM holds the blocks for us)."""
        cs, bs = self.chunk_size, self.block_size
        end = len(spec.token_ids)
        bad = self._failed_at.get(spec.req_id)
        if bad is not None:
            end = min(end, bad // cs * cs)
        skip = max(spec.skip, self._in_kvmesh.get(spec.req_id, 0))
        if end <= skip:
            return
        arr = _tokens(spec.token_ids[:end])
        for group_job in hybrid.save(self.groups, spec, arr, skip, bs) if self.xfer is None else ():
            self._saver.submit(group_job, 0, spec.req_id)  # the other groups' chunks (hybrid.py)
        first = skip // cs
        keys = self.engine.for_adapter(spec.adapter).keys.keys_for_array(arr)[first:]
        held = self.engine.cpu.contains(keys)
        if all(held):
            return
        # From the first chunk the pool lacks: a follow-up's prompt mostly re-sends chunks
        # that are already there, and those need no copy.
        lacking = held.index(False)
        start = (first + lacking) * cs
        b0 = start // bs
        block_ids = spec.block_ids[b0 : -(-end // bs)]
        if self.xfer is None:
            ids = torch.as_tensor(block_ids, dtype=torch.long)
            snapshot = [layer.index_select(0, ids) for layer in self.layers]
            nbytes = sum(t.numel() * t.element_size() for t in snapshot)

            def from_snapshot(s: int, e: int, out: torch.Tensor) -> None:
                self.page.gather(snapshot, list(range(s // bs - b0, -(-e // bs) - b0)), out)

            self._saver.submit(
                lambda: self._store(spec, arr, start, keys[lacking:], from_snapshot), nbytes, spec.req_id
            )
            return
        xfer, after, req = self.xfer, self._after_forward, spec.req_id

        def from_device(s: int, e: int, out: torch.Tensor) -> None:
            xfer.save(block_ids[s // bs - b0 : -(-e // bs) - b0], out, after)

        def job() -> None:
            try:
                self._store(spec, arr, start, keys[lacking:], from_device)
            finally:
                with self._saves_cond:
                    self._in_flight[req] -= 1
                    if self._in_flight[req] <= 0:
                        del self._in_flight[req]
                    self._saves_cond.notify_all()

        with self._saves_cond:
            self._in_flight[req] += 1
        try:
            self._saver.submit(job, (end - start) * self.engine.layout.bytes_per_token, req)
        except BaseException:
            with self._saves_cond:
                self._in_flight[req] -= 1
                if self._in_flight[req] <= 0:
                    del self._in_flight[req]
            raise

    def _store(self, spec: SaveSpec, arr: np.ndarray, start: int, keys: list[ChunkKey], fill: Fill) -> None:
        """The saver thread's half of a save: chunks ``start..len(arr)`` (``keys``) into the
        pool through ``fill``, then their events."""
        cs = self.chunk_size
        first = start // cs
        before = self.engine.cpu.contains(keys)
        stored = self.engine.for_adapter(spec.adapter).store_with(arr, fill, skip_tokens=start)
        new = [i for i in range(len(keys)) if not before[i] and (first + i + 1) * cs <= stored]
        with self._lock:
            self.counters["saves"] += 1
            self.counters["saved_tokens"] += len(new) * cs
        # Announce only chunks that entered the pool now, in runs of consecutive indexes.
        run: list[int] = []
        for i in [*new, -1]:
            if run and (i != run[-1] + 1):
                self.events.stored(arr, [keys[j] for j in run], first + run[0], spec.block_hashes, spec.lora)
                run = []
            if i >= 0:
                run.append(i)

    def wait_for_preempted(self, req_ids: Iterable[str], timeout: float | None = None) -> bool:
        """Block until the saves of ``req_ids`` have read their blocks (vLLM frees a
        preempted request's blocks at once and the next forward may overwrite them)."""
        reqs = set(req_ids)
        with self._saves_cond:
            return self._saves_cond.wait_for(lambda: not reqs & set(self._in_flight), timeout)

    def take_failed_loads(self) -> set[str]:
        """Hybrid models: requests whose asynchronous load fell short (vLLM recomputes them)."""
        with self._lock:
            failed, self._failed_recv = self._failed_recv, set()
        return failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def finished(self, req_ids: set[str]) -> set[str]:
        """Forget finished requests; returns those whose blocks vLLM held for kvmesh's
        saves (every request that got a SaveSpec on the host-device path) and that are now
        done: vLLM frees their blocks."""
        for req in req_ids:
            self._in_kvmesh.pop(req, None)
            self.release(req)  # normally released already; a safety net against leaked pins
            if req in self._saving:
                self._saving.discard(req)
                self._finishing.add(req)
        with self._saves_cond:
            done = {r for r in self._finishing if r not in self._in_flight}
        self._finishing -= done
        return done

    def close(self, timeout: float = 10.0) -> None:
        if self.admin is not None:
            self.admin.stop()
        self._lookups.close()
        self.loads.close()
        self._close_loads()
        self._saver.close(timeout)
        self.events.close()
        self.engine.close(timeout)
        for st in self.groups:
            st.engine.close(timeout)
