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
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvmesh.admin.server import AdminServer, start_admin
from kvmesh.core.engine import CacheEngine
from kvmesh.core.keys import ChunkKey, as_token_array
from kvmesh.integrations.vllm.metadata import KVMeshConnectorMetadata, LoadSpec, SaveSpec
from kvmesh.integrations.vllm.paged import chunk_to_paged, paged_to_chunk
from kvmesh.integrations.vllm.rpc import Handler
from kvmesh.integrations.vllm.saver import BackgroundSaver
from kvmesh.integrations.vllm.tracker import EventTracker

log = logging.getLogger(__name__)


def _tokens(ids: Sequence[int]) -> np.ndarray:
    # as_token_array checks list items one by one; a numpy array takes its fast path.
    return as_token_array(np.asarray(ids, dtype=np.int64))


class WorkerSide:
    def __init__(
        self, engine: CacheEngine, layers: Sequence[torch.Tensor], block_size: int, events: bool = True
    ) -> None:
        self.engine = engine
        self.layers = list(layers)
        self.block_size = block_size
        self.chunk_size = engine.config.chunk_size
        self.events = EventTracker(engine, block_size, enabled=events)
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()  # the ledger and counters: the RPC thread shares them
        self._ledger: dict[str, tuple[int, np.ndarray]] = {}  # req -> (lookup seq, pinned tokens)
        self._load_errors: set[int] = set()
        self._failed_at: dict[str, int] = {}  # this step: req -> first token whose KV is bad
        self._in_kvmesh: dict[str, int] = {}  # req -> leading tokens loaded from kvmesh
        self._saver = BackgroundSaver()
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
        return {"engine": self.engine.stats(), "connector": connector}

    def clear(self, tier: str | None = None, force: bool = False) -> dict[str, int]:
        self._saver.drain()  # a save still in flight would land after the clear
        out = self.engine.clear(tier, force=force)
        self.events.resync()
        return out

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
        for req, seq in meta.releases:
            self.release(req, seq)
        for spec in meta.loads:
            self._load(spec)

    def _load(self, spec: LoadSpec) -> None:
        bs, end = self.block_size, spec.end
        loaded = 0
        try:
            tokens = _tokens(spec.token_ids)
            with self.engine.retrieve_chunks(tokens, max_tokens=len(tokens)) as chunks:
                for c in chunks:
                    if c.start != loaded or loaded >= end:
                        break
                    stop = min(c.end, end)
                    if stop > spec.skip:  # blocks below skip are vLLM's own shared blocks
                        s = max(c.start, spec.skip)
                        chunk_to_paged(
                            c.kv[:, :, s - c.start : stop - c.start],
                            self.layers,
                            spec.block_ids[s // bs : -(-stop // bs)],
                        )
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
        try:
            for spec in meta.saves:
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
        """Snapshot the blocks of the chunks to save (the next forward may overwrite them
        once this step ends) and let the saver thread store them."""
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
        ids = torch.as_tensor(spec.block_ids[b0 : -(-end // bs)], dtype=torch.long)
        snapshot = [layer.index_select(0, ids) for layer in self.layers]
        nbytes = sum(t.numel() * t.element_size() for t in snapshot)
        self._saver.submit(lambda: self._store(spec, arr, start, keys[lacking:], snapshot), nbytes)

    def _store(
        self, spec: SaveSpec, arr: np.ndarray, start: int, keys: list[ChunkKey], snapshot: list[torch.Tensor]
    ) -> None:
        """The saver thread's half of a save: chunks ``start..len(arr)`` (``keys``) from
        ``snapshot`` (the blocks from ``start // block_size`` on) into the pool, then their
        events."""
        cs, bs = self.chunk_size, self.block_size
        b0 = start // bs

        def fill(s: int, e: int, out: torch.Tensor) -> None:
            paged_to_chunk(snapshot, list(range(s // bs - b0, -(-e // bs) - b0)), out)

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

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def finished(self, req_ids: set[str]) -> None:
        for req in req_ids:
            self._in_kvmesh.pop(req, None)
            self.release(req)  # normally released already; a safety net against leaked pins

    def close(self, timeout: float = 10.0) -> None:
        if self.admin is not None:
            self.admin.stop()
        self._saver.close(timeout)
        self.events.close()
        self.engine.close(timeout)
