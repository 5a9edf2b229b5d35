"""WriteBehind and Prefetcher (core/offload.py): writes land, references are held exactly as
long as a write is pending, the queue is bounded and drops (counted) when full, duplicates
are queued once, a failing tier never kills the writer thread, and ``wait`` / ``close``
keep their word.

The tier is the real in-memory ``mem://`` tier; :class:`GatedTier` (a ``MemoryTier`` whose
``put`` waits on a gate) and ``faulty://`` are fault injection: a stalled and a failing tier.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from kvmesh.core.keys import ChunkKey, KeyBuilder, KVLayout
from kvmesh.core.memory import MemoryObj, MemoryPool
from kvmesh.core.offload import BATCH, Prefetcher, WriteBehind
from kvmesh.errors import TierUnavailableError
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import ChunkData, TierOptions
from kvmesh.tiers.testing import FaultyTier, MemoryTier, reset_memory_stores

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=8, dtype="float16")
CS = 4
CHUNK_BYTES = CS * LAYOUT.bytes_per_token


class GatedTier(MemoryTier):
    """A MemoryTier whose ``put`` blocks until ``gate`` is set; records each batch size."""

    def __init__(self, name: str) -> None:
        super().__init__(name, TierOptions(name="gated", metrics=TierMetrics("gated")))
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.batches: list[int] = []

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[ChunkData]) -> list[bool]:
        self.entered.set()
        assert self.gate.wait(10), "test forgot to open the gate"
        self.batches.append(len(keys))
        return super().put(keys, chunks)


@pytest.fixture(autouse=True)
def _fresh_stores() -> Iterator[None]:
    reset_memory_stores()
    yield
    reset_memory_stores()


@pytest.fixture
def pool() -> MemoryPool:
    return MemoryPool(64 * CHUNK_BYTES, CHUNK_BYTES)


def chunk(pool: MemoryPool, i: int) -> tuple[ChunkKey, MemoryObj]:
    toks = np.arange(i * CS, (i + 1) * CS, dtype=np.uint32) + 1000 * i
    key = KeyBuilder("m", LAYOUT, CS).keys_for_array(toks)[0]
    obj = pool.allocate(CHUNK_BYTES)
    assert obj is not None
    obj.layout, obj.tokens = LAYOUT, toks
    obj.byte_view().numpy()[:] = np.frombuffer(toks.tobytes() * (CHUNK_BYTES // toks.nbytes), dtype=np.uint8)
    return key, obj


def mem_tier(name: str = "t") -> MemoryTier:
    return MemoryTier(name, TierOptions(name=name, metrics=TierMetrics(name)))


def test_writes_land_with_their_bytes_and_references_are_released(pool: MemoryPool) -> None:
    tier = mem_tier()
    wb = WriteBehind(tier, maxsize=16)
    items = [chunk(pool, i) for i in range(3)]
    try:
        for key, obj in items:
            assert wb.submit(key, obj)
        assert wb.wait(5) and wb.pending == 0 and wb.submitted == 3
        got = tier.get([k for k, _ in items])
        for g, (_, obj) in zip(got, items, strict=True):
            assert g is not None and bytes(g.data) == bytes(obj.raw())
        assert all(obj.refs == 1 for _, obj in items)  # only the caller's own reference is left
    finally:
        wb.close()


def test_pending_write_holds_a_reference_so_the_slot_is_not_reused(pool: MemoryPool) -> None:
    tier = GatedTier("g")
    wb = WriteBehind(tier, maxsize=16)
    key, obj = chunk(pool, 0)
    want = bytes(obj.raw())
    try:
        assert wb.submit(key, obj)
        obj.release()  # the caller (e.g. cpu eviction) lets go at once
        assert tier.entered.wait(5)
        assert obj.refs == 1 and pool.free_slots < pool.num_slots  # the writer still holds it
        assert wb.pending == 1 and not wb.wait(0.05)
        tier.gate.set()
        assert wb.wait(5)
        assert obj.refs == 0 and pool.free_slots == pool.num_slots  # released after landing
        got = tier.get([key])[0]
        assert got is not None and bytes(got.data) == want
    finally:
        tier.gate.set()
        wb.close()


def test_a_key_already_queued_is_queued_once(pool: MemoryPool) -> None:
    tier = GatedTier("dup")
    wb = WriteBehind(tier, maxsize=16)
    key, obj = chunk(pool, 0)
    other = chunk(pool, 1)
    try:
        assert wb.submit(*other)
        assert tier.entered.wait(5)  # the writer is busy with `other`
        assert wb.submit(key, obj) and wb.submit(key, obj)
        assert wb.pending == 2 and wb.submitted == 2 and obj.refs == 2  # one reference, not two
        tier.gate.set()
        assert wb.wait(5)
        assert tier.metrics.counters["stores"] == 2
        assert wb.submit(key, obj)  # once landed, the key may be queued again
        assert wb.wait(5) and tier.metrics.counters["stores"] == 3
    finally:
        tier.gate.set()
        wb.close()


def test_full_queue_drops_and_counts_without_leaking_references(pool: MemoryPool) -> None:
    tier = GatedTier("full")
    wb = WriteBehind(tier, maxsize=2)
    items = [chunk(pool, i) for i in range(5)]
    try:
        assert wb.submit(*items[0])
        assert tier.entered.wait(5)  # items[0] is out of the queue, in put
        assert wb.submit(*items[1]) and wb.submit(*items[2])  # the queue holds two
        t0 = time.monotonic()
        assert wb.submit(*items[3]) is False  # full: dropped at once (wait_s = 0)
        assert time.monotonic() - t0 < 0.5
        assert tier.metrics.counters["skipped_stores"] == 1
        assert items[3][1].refs == 1  # its reference was given back
        tier.gate.set()
        assert wb.wait(5)
        assert tier.contains([k for k, _ in items]) == [True, True, True, False, False]
    finally:
        tier.gate.set()
        wb.close()


def test_full_queue_waits_up_to_wait_s(pool: MemoryPool) -> None:
    tier = GatedTier("wait")
    wb = WriteBehind(tier, maxsize=1, wait_s=0.3)
    items = [chunk(pool, i) for i in range(3)]
    try:
        assert wb.submit(*items[0]) and tier.entered.wait(5)
        assert wb.submit(*items[1])
        t0 = time.monotonic()
        assert wb.submit(*items[2]) is False
        assert 0.25 <= time.monotonic() - t0 < 2.0
        # Room appears while a submit waits: it gets in.
        threading.Timer(0.1, tier.gate.set).start()
        assert wb.submit(*items[2])
        assert wb.wait(5) and tier.contains([k for k, _ in items]) == [True] * 3
    finally:
        tier.gate.set()
        wb.close()


def test_jobs_are_batched_up_to_batch(pool: MemoryPool) -> None:
    tier = GatedTier("batch")
    wb = WriteBehind(tier, maxsize=64)
    first = chunk(pool, 0)
    rest = [chunk(pool, i) for i in range(1, BATCH + 3)]
    try:
        assert wb.submit(*first) and tier.entered.wait(5)
        for item in rest:
            assert wb.submit(*item)
        tier.gate.set()
        assert wb.wait(5)
        assert tier.batches == [1, BATCH, 2]
    finally:
        tier.gate.set()
        wb.close()


def test_a_failing_tier_never_kills_the_writer(pool: MemoryPool) -> None:
    tier = FaultyTier("f", TierOptions(name="f", metrics=TierMetrics("f")))
    wb = WriteBehind(tier, maxsize=16)
    a, b = chunk(pool, 0), chunk(pool, 1)
    try:
        tier.down = True  # put raises TierUnavailableError
        assert wb.submit(*a) and wb.wait(5)
        assert tier.metrics.counters["errors"] == 1 and a[1].refs == 1
        tier.down = False
        assert wb.submit(*a) and wb.submit(*b) and wb.wait(5)
        assert tier.contains([a[0], b[0]]) == [True, True]
    finally:
        wb.close()


class BuggyTier(MemoryTier):
    """Fault injection: a tier bug (not a TierError) on the first put."""

    calls = 0

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[ChunkData]) -> list[bool]:
        self.calls += 1
        if self.calls == 1:
            raise KeyError("a bug in a tier")
        return super().put(keys, chunks)


def test_a_tier_bug_is_counted_and_the_writer_carries_on(pool: MemoryPool) -> None:
    tier = BuggyTier("bug", TierOptions(name="bug", metrics=TierMetrics("bug")))
    wb = WriteBehind(tier, maxsize=16)
    a, b = chunk(pool, 0), chunk(pool, 1)
    try:
        assert wb.submit(*a) and wb.wait(5)
        assert tier.metrics.counters["errors"] == 1
        assert wb.submit(*b) and wb.wait(5)
        assert tier.contains([a[0], b[0]]) == [False, True]
    finally:
        wb.close()


def test_wait_upto_a_mark_ignores_later_jobs(pool: MemoryPool) -> None:
    tier = GatedTier("mark")
    wb = WriteBehind(tier, maxsize=16)
    try:
        assert wb.submit(*chunk(pool, 0)) and tier.entered.wait(5)
        mark = wb.submitted
        assert not wb.wait(0.05, upto=mark)
        tier.gate.set()
        assert wb.wait(5, upto=mark)
        tier.gate.clear()
        tier.entered.clear()
        assert wb.submit(*chunk(pool, 1)) and tier.entered.wait(5)
        assert wb.wait(0, upto=mark)  # the later job does not count against the mark
        assert not wb.wait(0.05)
    finally:
        tier.gate.set()
        wb.close()


def test_close_drains_the_queue_then_stops(pool: MemoryPool) -> None:
    tier = mem_tier("close")
    wb = WriteBehind(tier, maxsize=16)
    items = [chunk(pool, i) for i in range(4)]
    for item in items:
        assert wb.submit(*item)
    wb.close(5)
    assert tier.contains([k for k, _ in items]) == [True] * 4
    assert not wb._thread.is_alive()


def test_prefetcher_runs_jobs_survives_failures_and_bounds_its_queue() -> None:
    pf = Prefetcher(maxsize=2)
    ran: list[int] = []
    started, gate = threading.Event(), threading.Event()

    def gated() -> None:
        started.set()
        gate.wait(5)

    def boom() -> None:
        raise TierUnavailableError("injected")

    try:
        assert pf.submit(gated) and started.wait(5)  # the thread is busy; the queue is empty
        assert pf.submit(boom) and pf.submit(lambda: ran.append(1))
        assert pf.submit(lambda: ran.append(2)) is False  # a queue of two is full
        gate.set()
        assert pf.wait(5)
        assert ran == [1]  # the failing job did not stop the thread
    finally:
        gate.set()
        pf.close()
