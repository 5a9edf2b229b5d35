"""CPUTier with LRU eviction, driven by random operations and checked against an OrderedDict."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvmesh.core.keys import ChunkKey, KeyBuilder, KVLayout
from kvmesh.core.memory import MemoryObj, MemoryPool
from kvmesh.tiers.cpu import CPUTier

SLOT = 32
SLOTS = 4
NKEYS = 8
_KB = KeyBuilder("m", KVLayout(1, 1, 4, "float32"), 1)
KEYS = [_KB.keys([i])[0] for i in range(NKEYS)]
KEY_INDEX = st.integers(0, NKEYS - 1)


def _pattern(serial: int) -> bytes:
    return ((np.arange(SLOT, dtype=np.int64) * 7 + serial * 13 + 1) % 251).astype(np.uint8).tobytes()


class CPUTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.evicted: list[tuple[str, bytes, int]] = []
        self.tier = CPUTier(MemoryPool(SLOTS * SLOT, SLOT), "lru", on_evict=self._on_evict)
        # Reference model: resident keys, least recently used first.
        self.model: OrderedDict[str, tuple[MemoryObj, bytes]] = OrderedDict()
        self.pins: Counter[str] = Counter()
        self.readers: list[tuple[MemoryObj, bytes]] = []
        self.serial = 0
        self.skipped = 0
        self.hits = 0
        self.misses = 0

    def _on_evict(self, key: ChunkKey, obj: MemoryObj) -> None:
        self.evicted.append((key.text, bytes(obj.raw()), obj.refs))

    def _held(self, obj: MemoryObj) -> bool:
        return any(r is obj for r, _ in self.readers)

    def _orphans(self) -> int:
        """Objects only readers still hold (dropped from the tier while being read)."""
        resident = {id(o) for o, _ in self.model.values()}
        return len({id(r) for r, _ in self.readers if id(r) not in resident})

    def _expected_victim(self) -> str | None:
        for text, (obj, _) in self.model.items():
            if self.pins[text] == 0 and not self._held(obj):
                return text
        return None

    # -- rules ---------------------------------------------------------------------------
    @rule(k=KEY_INDEX)
    def store(self, k: int) -> None:
        key = KEYS[k]
        free = SLOTS - len(self.model) - self._orphans()
        victim = None if free > 0 else self._expected_victim()
        n_evicted = len(self.evicted)
        obj = self.tier.allocate(SLOT)
        new_evictions = self.evicted[n_evicted:]
        if free > 0:
            assert obj is not None
            assert new_evictions == []
        elif victim is None:
            assert obj is None, "allocated although every chunk is pinned or being read"
            assert new_evictions == []
            self.skipped += 1
            return
        else:
            assert obj is not None
            assert [t for t, _, _ in new_evictions] == [victim], "did not evict the LRU evictable chunk"
            _, seen_bytes, refs = new_evictions[0]
            assert seen_bytes == self.model[victim][1], "victim's bytes were damaged before eviction"
            assert refs == 1, "evicted an object somebody else still references"
            del self.model[victim]
        assert obj is not None
        self.serial += 1
        pat = _pattern(self.serial)
        obj.raw()[:] = pat
        inserted = self.tier.put(key, obj)
        if key.text in self.model:
            assert inserted is False
            self.model.move_to_end(key.text)
        else:
            assert inserted is True
            self.model[key.text] = (obj, pat)

    @rule(k=KEY_INDEX, hold=st.booleans())
    def get(self, k: int, hold: bool) -> None:
        key = KEYS[k]
        (got,) = self.tier.get([key])
        if key.text not in self.model:
            assert got is None
            self.misses += 1
            return
        obj, pat = self.model[key.text]
        assert got is obj
        self.hits += 1
        self.model.move_to_end(key.text)
        if hold:
            self.readers.append((got, pat))
        else:
            got.release()

    @rule(i=st.integers(0, 100))
    def release_reader(self, i: int) -> None:
        if self.readers:
            obj, _ = self.readers.pop(i % len(self.readers))
            obj.release()

    @rule(k=KEY_INDEX)
    def pin(self, k: int) -> None:
        self.tier.pin([KEYS[k]])
        self.pins[KEYS[k].text] += 1

    @rule(k=KEY_INDEX)
    def unpin(self, k: int) -> None:
        self.tier.unpin([KEYS[k]])
        text = KEYS[k].text
        if self.pins[text] > 0:
            self.pins[text] -= 1

    @rule(k=KEY_INDEX, force=st.booleans())
    def delete(self, k: int, force: bool) -> None:
        text = KEYS[k].text
        expect = int(text in self.model and (force or self.pins[text] == 0))
        assert self.tier.delete([KEYS[k]], force=force) == expect
        if expect:
            del self.model[text]

    @rule(force=st.booleans())
    def clear(self, force: bool) -> None:
        gone = [t for t in self.model if force or self.pins[t] == 0]
        assert self.tier.clear(force=force) == len(gone)
        for t in gone:
            del self.model[t]

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def same_keys_as_model(self) -> None:
        assert set(self.tier.keys()) == set(self.model)
        assert len(self.tier) == len(self.model)
        assert self.tier.contains(KEYS) == [k.text in self.model for k in KEYS]

    @invariant()
    def pool_accounting(self) -> None:
        assert self.tier.pool.free_slots == SLOTS - len(self.model) - self._orphans()

    @invariant()
    def nothing_overwritten(self) -> None:
        for obj, pat in self.model.values():
            assert bytes(obj.raw()) == pat
        for obj, pat in self.readers:
            assert bytes(obj.raw()) == pat, "a buffer held by a reader was reused"

    @invariant()
    def pins_and_counters(self) -> None:
        for k in KEYS:
            assert self.tier.is_pinned(k) == (self.pins[k.text] > 0)
        assert self.tier.pinned_count() == sum(1 for t in self.model if self.pins[t] > 0)
        c = self.tier.metrics.counters
        assert c["evictions"] == len(self.evicted)
        assert c["skipped_stores"] == self.skipped
        assert c["hits"] == self.hits
        assert c["misses"] == self.misses

    def teardown(self) -> None:
        for obj, _ in self.readers:
            obj.release()
        self.tier.close()
        assert self.tier.pool.free_slots == SLOTS


CPUTierMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
TestCPUTierLRU = CPUTierMachine.TestCase


def _fill(tier: CPUTier, n: int) -> list[ChunkKey]:
    keys = KEYS[:n]
    for k in keys:
        obj = tier.allocate(SLOT)
        assert obj is not None
        tier.put(k, obj)
    return keys


def test_everything_pinned_skips_without_raising() -> None:
    evicted: list[str] = []
    tier = CPUTier(MemoryPool(SLOTS * SLOT, SLOT), "lru", on_evict=lambda k, o: evicted.append(k.text))
    keys = _fill(tier, SLOTS)
    tier.pin(keys)
    assert tier.allocate(SLOT) is None
    assert tier.allocate(SLOT, wait_s=0.01) is None
    assert tier.metrics.counters["skipped_stores"] == 2
    assert evicted == []
    assert len(tier) == SLOTS
    tier.unpin(keys[2:3])
    obj = tier.allocate(SLOT)
    assert obj is not None
    assert evicted == [keys[2].text]
    obj.release()


def test_pins_nest_and_may_precede_the_chunk() -> None:
    tier = CPUTier(MemoryPool(SLOTS * SLOT, SLOT), "lru")
    tier.pin([KEYS[0]])
    tier.pin([KEYS[0]])
    _fill(tier, SLOTS)
    tier.unpin([KEYS[0]])
    tier.pin(KEYS[1:SLOTS])
    assert tier.allocate(SLOT) is None  # KEYS[0] still holds one pin
    tier.unpin([KEYS[0]])
    obj = tier.allocate(SLOT)
    assert obj is not None
    assert tier.contains(KEYS[:SLOTS]) == [False, True, True, True]
    obj.release()


def test_allocate_waits_for_a_reader_to_release() -> None:
    tier = CPUTier(MemoryPool(SLOT, SLOT), "lru")
    _fill(tier, 1)
    (held,) = tier.get(KEYS[:1])
    assert held is not None
    assert tier.allocate(SLOT) is None  # the only chunk is being read
    timer = threading.Timer(0.05, held.release)
    timer.start()
    obj = tier.allocate(SLOT, wait_s=5.0)
    timer.join()
    assert obj is not None
    obj.release()


@pytest.mark.parametrize("policy,expected", [("lru", 1), ("fifo", 0)])
def test_hits_refresh_lru_but_not_fifo(policy: str, expected: int) -> None:
    evicted: list[str] = []
    tier = CPUTier(MemoryPool(2 * SLOT, SLOT), policy, on_evict=lambda k, o: evicted.append(k.text))
    _fill(tier, 2)
    (obj,) = tier.get(KEYS[:1])
    assert obj is not None
    obj.release()
    new = tier.allocate(SLOT)
    assert new is not None
    assert evicted == [KEYS[expected].text]
    new.release()


def test_allocate_waits_for_the_write_back_of_its_victim() -> None:
    """An ``on_evict`` that keeps the victim (a queued write-back) frees its slot later."""
    timers: list[threading.Timer] = []

    def write_back(key: ChunkKey, obj: MemoryObj) -> None:
        obj.ref_up()
        timer = threading.Timer(0.05, obj.release)
        timers.append(timer)
        timer.start()

    tier = CPUTier(MemoryPool(SLOT, SLOT), "lru", on_evict=write_back)
    _fill(tier, 1)
    obj = tier.allocate(SLOT)  # wait_s=0, yet the victim's write-back is worth waiting for
    for timer in timers:
        timer.join()
    assert obj is not None
    assert tier.metrics.counters["skipped_stores"] == 0
    assert tier.metrics.counters["evictions"] == 1
    obj.release()
