"""vLLM KV events for what kvmesh holds, keyed by vLLM's own block hashes.

A router indexes vLLM's ``medium="GPU"`` events by block hash; announcing kvmesh's chunks
with the same hashes (``maybe_convert_block_hash`` of ``request.block_hashes``, passed from
the scheduler in the save metadata) lets it score every medium alike:

* ``BlockStored(medium="CPU")`` when a chunk enters the worker's CPU pool;
* ``BlockStored(medium="DISK" | "REMOTE")`` once its write-behind to that tier has landed
  (checked by a background thread, so the forward pass never waits on disk or network);
* ``BlockRemoved(medium="CPU")`` when the pool evicts or clears a chunk announced here.

Lower-tier removals (disk eviction, Redis expiry) are not announced: those tiers evict on
their own schedule and a router treats a stale entry as a miss after a failed load.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvmesh.core.engine import CacheEngine
from kvmesh.core.keys import ChunkKey
from kvmesh.core.memory import MemoryObj
from kvmesh.errors import TierError
from kvmesh.integrations.vllm.metadata import BlockHash

log = logging.getLogger(__name__)
MEDIA = {"cpu": "CPU", "disk": "DISK", "remote": "REMOTE"}
CONFIRM_WAIT_S = 60.0  # a write that has not landed by then is not announced
MAX_PENDING_CONFIRMS = 1024
HELD_RECORDS = 16_384  # chunks remembered for the admin API's ``held`` (a restarted router)


@dataclass
class _Confirm:
    marks: dict[str, int]  # writer -> jobs submitted when the chunks were stored
    keys: list[ChunkKey]
    events: list[BlockStored]


class EventTracker:
    def __init__(
        self, engine: CacheEngine, block_size: int, enabled: bool = True, group: int | None = None
    ) -> None:
        self.engine = engine
        self.block_size = block_size
        # A hybrid model: the engine's chunks are this KV cache group's (the full-attention one),
        # said in every event as vLLM 0.32 says it, so a router indexes them with that group.
        self.group = group
        self._group_fields: dict[str, Any] = (
            {} if group is None else {"group_idx": group, "kv_cache_spec_kind": "full_attention"}
        )
        # Off when vLLM publishes no KV events: nothing would read them.
        self.enabled = enabled
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []
        # chunk key -> the vLLM hashes announced for it in CPU; bounded by the pool size
        self._announced: OrderedDict[str, list[BlockHash]] = OrderedDict()
        self._limit = 2 * engine.cpu.pool.num_slots
        self._confirms: queue.Queue[_Confirm | None] = queue.Queue(MAX_PENDING_CONFIRMS)
        # chunk key -> (key, its CPU event, tiers it landed in): what `held` pages through
        self._held: OrderedDict[str, tuple[ChunkKey, BlockStored, set[str]]] = OrderedDict()
        self._thread: threading.Thread | None = None
        if not enabled:
            return
        if engine.writers:
            self._thread = threading.Thread(target=self._confirm_loop, name="kvmesh-events", daemon=True)
            self._thread.start()
        previous = engine.cpu.on_evict
        engine.cpu.on_evict = self._evict_hook(previous)

    # -- producers -----------------------------------------------------------------------
    def stored(
        self,
        tokens: np.ndarray,
        keys: Sequence[ChunkKey],
        first: int,
        hashes: Sequence[BlockHash],
        lora: tuple[str, int] | None = None,
    ) -> None:
        """Chunks ``keys`` (chunk indexes ``first``, ``first + 1``, ...) of ``tokens`` just
        entered the CPU pool. ``hashes``: vLLM's block hashes of ``tokens`` (may be empty:
        vLLM computes none without prefix caching, and then nothing is announced). ``lora``:
        the request's ``(lora_name, lora_int_id)``, announced as vLLM announces its own blocks
        (a router keeps an adapter's blocks apart from the base model's by that name)."""
        if not self.enabled:
            return
        cs = self.engine.config.chunk_size
        per_chunk = cs // self.block_size
        events: list[BlockStored] = []
        for i, key in enumerate(keys):
            b0 = (first + i) * per_chunk
            if len(hashes) < b0 + per_chunk:
                break
            chunk_hashes = list(hashes[b0 : b0 + per_chunk])
            events.append(
                BlockStored(
                    block_hashes=chunk_hashes,
                    parent_block_hash=hashes[b0 - 1] if b0 else None,
                    token_ids=tokens[b0 * self.block_size : (b0 + per_chunk) * self.block_size].tolist(),
                    block_size=self.block_size,
                    lora_id=lora[1] if lora is not None else None,
                    medium=MEDIA["cpu"],
                    lora_name=lora[0] if lora is not None else None,
                    **self._group_fields,
                )
            )
            with self._lock:
                self._announced[key.text] = chunk_hashes
                self._announced.move_to_end(key.text)
                while len(self._announced) > self._limit:
                    self._announced.popitem(last=False)
                self._held[key.text] = (key, events[-1], {"cpu"})
                self._held.move_to_end(key.text)
                while len(self._held) > HELD_RECORDS:
                    self._held.popitem(last=False)
        with self._lock:
            self._events.extend(events)
        if events and self._thread is not None:
            marks = {name: w.submitted for name, w in self.engine.writers.items()}
            try:
                self._confirms.put_nowait(_Confirm(marks, list(keys[: len(events)]), events))
            except queue.Full:
                log.debug("kvmesh: event confirmation queue full; lower-tier events dropped")

    def _evict_hook(
        self, previous: Callable[[ChunkKey, MemoryObj], None] | None
    ) -> Callable[[ChunkKey, MemoryObj], None]:
        def on_evict(key: ChunkKey, obj: MemoryObj) -> None:
            if previous is not None:
                previous(key, obj)  # the engine's write-back comes first
            self._removed([key.text])

        return on_evict

    def _removed(self, texts: Sequence[str]) -> None:
        with self._lock:
            hashes = [h for t in texts for h in self._announced.pop(t, [])]
            if hashes:
                self._events.append(
                    BlockRemoved(block_hashes=hashes, medium=MEDIA["cpu"], group_idx=self.group)
                )

    def resync(self) -> None:
        """After a clear: announce the removal of every announced chunk no longer in CPU."""
        if not self.enabled:
            return
        with self._lock:
            texts = list(self._announced)
        held = set(self.engine.cpu.keys())
        self._removed([t for t in texts if t not in held])

    # -- consumer ------------------------------------------------------------------------
    def take(self) -> list[KVCacheEvent]:
        """Events since the last call, without duplicates (vLLM's aggregator counts an
        event once per worker; a duplicate would look like a second worker)."""
        with self._lock:
            events, self._events = self._events, []
        return list(dict.fromkeys(events))

    def _confirm_loop(self) -> None:
        while True:
            job = self._confirms.get()
            if job is None:
                return
            for name, mark in job.marks.items():
                writer, tier = self.engine.writers.get(name), self.engine.lower.get(name)
                if writer is None or tier is None or not writer.wait(CONFIRM_WAIT_S, upto=mark):
                    continue
                try:
                    held = tier.contains(job.keys)
                except TierError:
                    continue
                landed = [
                    msgspec.structs.replace(ev, medium=MEDIA[name])
                    for ev, h in zip(job.events, held, strict=True)
                    if h
                ]
                with self._lock:
                    self._events.extend(landed)
                    for key, h in zip(job.keys, held, strict=True):
                        rec = self._held.get(key.text)
                        if h and rec is not None:
                            rec[2].add(name)

    def held(self, cursor: int, limit: int) -> dict[str, Any]:
        """A page of the chunks announced here that a tier still holds, oldest first (parents
        before children), as JSON ``BlockStored`` events, one per chunk and tier."""
        with self._lock:
            page = list(self._held.values())[cursor : cursor + limit]
            total = len(self._held)
        keys = [rec[0] for rec in page]
        holds = {"cpu": self.engine.cpu.contains(keys)}
        for name, tier in self.engine.lower.items():
            try:
                holds[name] = tier.contains(keys)
            except TierError:
                holds[name] = [False] * len(keys)
        out: list[dict[str, Any]] = []
        for i, (_, ev, media) in enumerate(page):
            for name in media:
                if holds.get(name, [False] * len(keys))[i]:
                    held = {
                        "block_hashes": [_hash_json(h) for h in ev.block_hashes],
                        "parent_block_hash": _hash_json(ev.parent_block_hash),
                        "token_ids": ev.token_ids,
                        "block_size": ev.block_size,
                        "medium": MEDIA[name],
                        **self._group_fields,
                    }
                    if ev.lora_name is not None:  # an adapter's chunk: the router roots its chain apart
                        held.update(lora_name=ev.lora_name, lora_id=ev.lora_id)
                    out.append(held)
        end = cursor + len(page)
        return {"events": out, "next": end if end < total else None, "total": total}

    def close(self) -> None:
        if self._thread is not None:
            with contextlib.suppress(queue.Full):
                self._confirms.put(None, timeout=1.0)
            self._thread.join(2.0)


def _hash_json(h: BlockHash | None) -> int | str | None:
    """vLLM hashes are ints by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), else bytes."""
    return "hex:" + h.hex() if isinstance(h, bytes) else h
