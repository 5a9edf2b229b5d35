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
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from kvmesh.admin.server import AdminServer, start_admin
from kvmesh.core.engine import CacheEngine
from kvmesh.core.keys import ChunkKey, as_token_array
from kvmesh.integrations.vllm.device import Event
from kvmesh.integrations.vllm.layouts import CpuPackedPages, PageLayout
from kvmesh.integrations.vllm.metadata import KVMeshConnectorMetadata, LoadSpec, SaveSpec
from kvmesh.integrations.vllm.rpc import Handler
from kvmesh.integrations.vllm.saver import BackgroundSaver
from kvmesh.integrations.vllm.tracker import EventTracker
from kvmesh.integrations.vllm.transfer import Transfer

Fill = Callable[[int, int, torch.Tensor], None]

log = logging.getLogger(__name__)


def _tokens(ids: Sequence[int]) -> np.ndarray:
    # as_token_array checks list items one by one; a numpy array takes its fast path.
    return as_token_array(np.asarray(ids, dtype=np.int64))


class WorkerSide:
    def __init__(
        self,
        engine: CacheEngine,
        layers: Sequence[torch.Tensor],
        block_size: int,
        events: bool = True,
        page: PageLayout | None = None,
        layer_names: Sequence[str] = (),
        layerwise: bool = True,
    ) -> None:
        self.engine = engine
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
        self._after_forward: Event | None = None
        self._saves_cond = threading.Condition()
        self._in_flight: Counter[str] = Counter()  # req -> device-path saves not yet in the pool
        self._saving: set[str] = set()  # reqs that got a SaveSpec: vLLM holds their blocks for us
        self._finishing: set[str] = set()  # finished, waiting for their saves
        self.chunk_size = engine.config.chunk_size
        self.events = EventTracker(engine, block_size, enabled=events)
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()  # the ledger and counters: the RPC thread shares them
        self._ledger: dict[str, tuple[int, np.ndarray]] = {}  # req -> (lookup seq, pinned tokens)
        self._load_errors: set[int] = set()
        self._failed_at: dict[str, int] = {}  # this step: req -> first token whose KV is bad
        self._in_kvmesh: dict[str, int] = {}  # req -> leading tokens loaded from kvmesh
        self._saver = BackgroundSaver()
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

    def lookup(self, req: str, seq: int, tokens: list[int]) -> int:
        """Leading tokens held in any tier, pinned under ``(req, seq)`` until released."""
        arr = _tokens(tokens)
        self.release(req)  # a request looked up again replaces its earlier pins
        n = self.engine.lookup(arr, pin=True)
        with self._lock:
            self.counters["lookups"] += 1
            self.counters["lookup_hit_tokens"] += n
            if n:
                self._ledger[req] = (seq, arr[:n])
        return n

    def release(self, req: str, seq: int | None = None) -> bool:
        """Unpin what lookup ``seq`` (any, if ``None``) pinned for ``req``. A release for
        an older lookup than the current one is ignored."""
        with self._lock:
            entry = self._ledger.get(req)
            if entry is None or (seq is not None and entry[0] != seq):
                return False
            del self._ledger[req]
        self.engine.unpin(entry[1])
        return True

    def stats(self) -> dict[str, Any]:
        with self._lock:
            connector = dict(self.counters)
            connector["pinned_requests"] = len(self._ledger)
        connector["save_queue"] = self._saver.pending
        connector["save_failures"] = connector.get("save_failures", 0) + self._saver.failed
        connector["save_waits"] = self._saver.waits
        for hook in self.stats_hooks:
            connector.update(hook())
        return {"engine": self.engine.stats(), "connector": connector}

    def clear(self, tier: str | None = None, force: bool = False) -> dict[str, int]:
        self._saver.drain()  # a save still in flight would land after the clear
        out = self.engine.clear(tier, force=force)
        self.events.resync()
        return out

    def drain_saves(self, timeout: float | None = None) -> bool:
        """Block until every save handed over so far is in the pool. ``False`` on timeout."""
        return bool(self._saver.drain(timeout))

    def wait_for_writes(self, timeout: float | None = None) -> bool:
        """Block until every save handed over so far is in the pool and its tier writes
        have landed. ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._saver.drain(timeout):
            return False
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.engine.wait_for_writes(left)

    # -- one engine step (worker process) ------------------------------------------------
    def start_step(self, meta: KVMeshConnectorMetadata) -> None:
        self._close_loads()
        for req, seq in meta.releases:
            self.release(req, seq)
        if self.xfer is None:
            for spec in meta.loads:
                self._load(spec, None)
            return
        stack = contextlib.ExitStack()  # the retrieved chunks stay held until copied
        items: list[tuple[torch.Tensor, list[int]]] = []
        try:
            for spec in meta.loads:
                self._load(spec, (stack, items))
            self.xfer.load(items, layerwise=self._layerwise)
        except Exception:  # a cache problem must never fail vLLM's step: recompute them all
            log.exception("kvmesh: queueing this step's loads failed; vLLM recomputes them")
            with self._lock:
                for spec in meta.loads:
                    self._load_errors.update(spec.block_ids[spec.skip // self.block_size :])
                    self._failed_at[spec.req_id] = spec.skip
                    self._in_kvmesh.pop(spec.req_id, None)
                    self.counters["load_failures"] += 1
        finally:
            self._loads_open = stack
        if not self._layerwise:  # until vLLM is seen calling the layer hooks: wait for all
            self.xfer.wait_all_layers()

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

    def _load(
        self, spec: LoadSpec, queue: tuple[contextlib.ExitStack, list[tuple[torch.Tensor, list[int]]]] | None
    ) -> None:
        bs, end = self.block_size, spec.end
        loaded = 0
        try:
            tokens = _tokens(spec.token_ids)
            with contextlib.ExitStack() as local:
                holder = queue[0] if queue is not None else local
                chunks = holder.enter_context(self.engine.retrieve_chunks(tokens, max_tokens=len(tokens)))
                for c in chunks:
                    if c.start != loaded or loaded >= end:
                        break
                    stop = min(c.end, end)
                    if stop > spec.skip:  # blocks below skip are vLLM's own shared blocks
                        s = max(c.start, spec.skip)
                        view = c.kv[:, :, s - c.start : stop - c.start]
                        ids = spec.block_ids[s // bs : -(-stop // bs)]
                        if queue is not None:
                            queue[1].append((view, ids))
                        else:
                            self.page.scatter(view, self.layers, ids)
                    loaded = stop
        except Exception:
            log.exception("kvmesh: loading request %s failed; vLLM will recompute it", spec.req_id)
        finally:
            self.release(spec.req_id, spec.seq)
        self._in_kvmesh[spec.req_id] = loaded
        with self._lock:
            if loaded >= end:
                self.counters["loads"] += 1
                self.counters["load_tokens"] += end - spec.skip
                return
            first = max(loaded, spec.skip)
            self._load_errors.update(spec.block_ids[first // bs : -(-end // bs)])
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
        first = skip // cs
        keys = self.engine.keys.keys_for_array(arr)[first:]
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

            self._saver.submit(lambda: self._store(spec, arr, start, keys[lacking:], from_snapshot), nbytes)
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
            self._saver.submit(job, (end - start) * self.engine.layout.bytes_per_token)
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
        stored = self.engine.store_with(arr, fill, skip_tokens=start)
        new = [i for i in range(len(keys)) if not before[i] and (first + i + 1) * cs <= stored]
        with self._lock:
            self.counters["saves"] += 1
            self.counters["saved_tokens"] += len(new) * cs
        # Announce only chunks that entered the pool now, in runs of consecutive indexes.
        run: list[int] = []
        for i in [*new, -1]:
            if run and (i != run[-1] + 1):
                self.events.stored(arr, [keys[j] for j in run], first + run[0], spec.block_hashes)
                run = []
            if i >= 0:
                run.append(i)

    def wait_for_preempted(self, req_ids: Iterable[str], timeout: float | None = None) -> bool:
        """Block until the saves of ``req_ids`` have read their blocks (vLLM frees a
        preempted request's blocks at once and the next forward may overwrite them)."""
        reqs = set(req_ids)
        with self._saves_cond:
            return self._saves_cond.wait_for(lambda: not reqs & set(self._in_flight), timeout)

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
        self._close_loads()
        self._saver.close(timeout)
        self.events.close()
        self.engine.close(timeout)
