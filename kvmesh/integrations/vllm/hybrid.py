"""The KV cache groups of a hybrid model beyond the main one (groups.py), in the worker.

The worker's own :class:`~kvmesh.CacheEngine` caches the main (first full-attention)
group exactly as it caches a dense model. Every other group gets a :class:`GroupStore`: its
own engine, whose key namespace carries the group's tag, over that group's layers and
page layout. A full-attention group stores and loads every chunk like the main one; a
sliding-window group only the chunks holding the last ``window`` tokens before the load
point (before the end of what a save covers), since vLLM frees the rest of its blocks and
attention never reads them: that is what makes a hybrid model's stored bytes per token
smaller than a dense model's.

A load point is a hit only if every group has what it needs there (:func:`best_point`).
Loads of a hybrid model are always asynchronous (scheduler.py): vLLM cannot take back
block-level load errors with several groups, so a short load is reported as a failed
receive and vLLM recomputes the request.

Supported on vLLM-CPU's page path (the snapshot saves of worker.py); the host-device path
refuses hybrid models by name (connector.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvmesh.core.engine import CacheEngine, RetrievedChunk
from kvmesh.core.keys import ChunkKey
from kvmesh.integrations.vllm.groups import Group
from kvmesh.integrations.vllm.layouts import PageLayout
from kvmesh.integrations.vllm.metadata import LoadSpec, SaveSpec

NULL_BLOCK = 0  # vLLM's null block: a sliding window's freed positions point at it; never written


@dataclass
class GroupStore:
    group: Group
    engine: CacheEngine
    layers: list[torch.Tensor]
    page: PageLayout

    def first_chunk(self, point: int, bounds: Sequence[tuple[int, int]]) -> int:
        """Index of the first chunk a load up to ``point`` needs from this group."""
        first = self.group.first_needed(point)
        return sum(1 for _, e in bounds if e <= first)


Pins = list[tuple[CacheEngine, list[ChunkKey]]]


def best_point(
    main_chunks: int,
    bounds: Sequence[tuple[int, int]],
    stores: Sequence[GroupStore],
    held: Sequence[list[bool]],
) -> int:
    """Chunks of the longest prefix (at most ``main_chunks``, what the main group holds)
    for which every other group holds the chunks it needs (``held[i][j]``: store ``i``
    holds chunk ``j``)."""
    for j in range(main_chunks, 0, -1):
        point = bounds[j - 1][1]
        if all(all(h[st.first_chunk(point, bounds) : j]) for st, h in zip(stores, held, strict=True)):
            return j
    return 0


def lookup(main: CacheEngine, stores: Sequence[GroupStore], arr: np.ndarray) -> tuple[int, Pins, bool]:
    """``(tokens, pins, lower)``: the hit every group can serve, its chunks pinned in every
    group's engine, and whether any of them lies below the cpu tier."""
    n = main.lookup(arr, pin=False)
    if not n:
        return 0, [], False
    bounds = main.keys.chunk_bounds(n)
    keys = [st.engine.keys.keys_for_array(arr[:n]) for st in stores]
    where = [st.engine.where(k) for st, k in zip(stores, keys, strict=True)]
    j = best_point(len(bounds), bounds, stores, [[w is not None for w in ws] for ws in where])
    if not j:
        return 0, [], False
    point = bounds[j - 1][1]
    main_keys = main.keys.keys_for_array(arr[:point])
    pins: Pins = [(main, main_keys)]
    lower = not all(main.cpu.contains(main_keys))
    for st, k, ws in zip(stores, keys, where, strict=True):
        first = st.first_chunk(point, bounds)
        pins.append((st.engine, k[first:j]))
        lower = lower or any(w != "cpu" for w in ws[first:j])
    for engine, k in pins:
        engine.pin_keys(k)
    return point, pins, lower


def unpin(pins: Pins) -> None:
    for engine, keys in pins:
        engine.unpin_keys(keys)


def read(
    stores: Sequence[GroupStore], spec: LoadSpec, arr: np.ndarray, stack: contextlib.ExitStack
) -> list[Any]:
    """Each store's chunks for ``spec`` (held until ``stack`` closes): a load reader's half."""
    out: list[Any] = []
    for st in stores:
        bounds = st.engine.keys.chunk_bounds(len(arr))
        first = bounds[st.first_chunk(spec.end, bounds)][0] if bounds else 0
        out.append(stack.enter_context(st.engine.retrieve_chunks(arr, max_tokens=len(arr), from_token=first)))
    return out


def copy_in(
    stores: Sequence[GroupStore], spec: LoadSpec, extra: Sequence[Sequence[RetrievedChunk]], bs: int
) -> int:
    """Scatter each store's chunks into its group's blocks (never below ``spec.skip``:
    vLLM's own shared blocks, never a null block); returns the tokens every group reached."""
    end, reached = spec.end, spec.end
    for st, chunks in zip(stores, extra, strict=False):
        blocks = spec.group_blocks[st.group.index] if st.group.index < len(spec.group_blocks) else []
        need = st.group.first_needed(end)
        at: int | None = None
        for c in chunks:
            if at is None:
                if not c.start <= need < c.end:
                    break  # the window's first chunk is missing: nothing of this group loads
                at = c.start
            if c.start != at or at >= end:
                break
            stop = min(c.end, end)
            s = max(c.start, spec.skip)
            while s < stop and blocks[s // bs] == NULL_BLOCK:
                s = (s // bs + 1) * bs
            if stop > s:
                view = c.kv[:, :, s - c.start : stop - c.start]
                st.page.scatter(view, st.layers, blocks[s // bs : -(-stop // bs)])
            at = stop
        reached = min(reached, at or 0)
    return reached


def save(stores: Sequence[GroupStore], spec: SaveSpec, arr: np.ndarray, skip: int, bs: int) -> list[Any]:
    """Snapshot what each store lacks of ``spec`` (the window before its end, for a
    sliding window) and return the saver jobs that store it."""
    jobs: list[Any] = []
    end = len(arr)
    for st in stores:
        blocks = spec.group_blocks[st.group.index] if st.group.index < len(spec.group_blocks) else []
        bounds = st.engine.keys.chunk_bounds(end)
        if not bounds or len(blocks) < -(-end // bs):
            continue
        first = st.first_chunk(end, bounds)
        start = max(bounds[first][0], skip // st.engine.config.chunk_size * st.engine.config.chunk_size)
        keys = st.engine.keys.keys_for_array(arr)
        lo = sum(1 for _, e in bounds if e <= start)
        if lo >= len(keys) or all(st.engine.cpu.contains(keys[lo:])):
            continue
        b0 = start // bs
        ids = blocks[b0 : -(-end // bs)]
        if NULL_BLOCK in ids:  # vLLM freed part of what a save needs: never store the null block
            continue
        index = torch.as_tensor(ids, dtype=torch.long)
        snapshot = [layer.index_select(0, index) for layer in st.layers]

        def job(
            st: GroupStore = st, snapshot: list[torch.Tensor] = snapshot, b0: int = b0, start: int = start
        ) -> None:
            def fill(begin: int, stop: int, out: torch.Tensor) -> None:
                st.page.gather(snapshot, list(range(begin // bs - b0, -(-stop // bs) - b0)), out)

            st.engine.store_with(arr, fill, skip_tokens=start)

        jobs.append(job)
    return jobs
