"""MemoryPool under random allocate / ref_up / release sequences, checked against a model."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmesh.core.memory import MemoryObj, MemoryPool
from kvmesh.errors import ClosedError

SLOT = 48
SLOTS = 5


def _pattern(serial: int, nbytes: int) -> bytes:
    # Distinct per object at every offset: two live objects sharing a byte would clash.
    return ((np.arange(nbytes, dtype=np.int64) * 3 + serial * 101 + 1) % 251).astype(np.uint8).tobytes()


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = MemoryPool(SLOTS * SLOT + SLOT // 2, SLOT)  # a partial slot is not a slot
        self.live: dict[int, tuple[MemoryObj, int, bytes]] = {}  # serial -> (obj, refs, pattern)
        self.dead: list[MemoryObj] = []
        self.serial = 0

    def _pick(self, i: int) -> int:
        return sorted(self.live)[i % len(self.live)]

    @rule(nbytes=st.integers(1, SLOT))
    def allocate(self, nbytes: int) -> None:
        obj = self.pool.allocate(nbytes)
        if len(self.live) == SLOTS:
            assert obj is None
            return
        assert obj is not None
        assert obj.refs == 1
        assert obj.nbytes == nbytes
        self.serial += 1
        pat = _pattern(self.serial, nbytes)
        obj.raw()[:] = pat
        self.live[self.serial] = (obj, 1, pat)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def ref_up(self, i: int) -> None:
        s = self._pick(i)
        obj, refs, pat = self.live[s]
        assert obj.ref_up() is obj
        self.live[s] = (obj, refs + 1, pat)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        s = self._pick(i)
        obj, refs, pat = self.live[s]
        obj.release()
        if refs == 1:
            del self.live[s]
            self.dead.append(obj)
        else:
            self.live[s] = (obj, refs - 1, pat)

    @precondition(lambda self: self.dead)
    @rule(i=st.integers(0, 100))
    def release_too_often(self, i: int) -> None:
        obj = self.dead[i % len(self.dead)]
        free = self.pool.free_slots
        with pytest.raises(ClosedError):
            obj.release()
        with pytest.raises(ClosedError):
            obj.ref_up()
        assert self.pool.free_slots == free  # a bad release must not free a slot twice

    @rule(nbytes=st.sampled_from([0, -1, SLOT + 1, 10 * SLOT]))
    def allocate_bad_size(self, nbytes: int) -> None:
        with pytest.raises(ValueError):
            self.pool.allocate(nbytes)

    @invariant()
    def free_count_matches_live_objects(self) -> None:
        assert self.pool.num_slots == SLOTS
        assert self.pool.free_slots == SLOTS - len(self.live)
        assert self.pool.used_bytes == len(self.live) * SLOT

    @invariant()
    def live_objects_never_overlap(self) -> None:
        slots = [obj.slot for obj, _, _ in self.live.values()]
        assert len(set(slots)) == len(slots)
        assert all(0 <= s < SLOTS for s in slots)
        spans = sorted(
            (obj.byte_view().data_ptr(), obj.byte_view().data_ptr() + obj.nbytes)
            for obj, _, _ in self.live.values()
        )
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start

    @invariant()
    def nobody_overwrote_a_live_object(self) -> None:
        for obj, refs, pat in self.live.values():
            assert obj.refs == refs
            assert bytes(obj.raw()) == pat
            assert obj.byte_view().numpy().tobytes() == pat


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestMemoryPool = PoolMachine.TestCase


def test_pool_smaller_than_one_slot_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold one chunk"):
        MemoryPool(100, 101)
    with pytest.raises(ValueError):
        MemoryPool(100, 0)


def test_wait_for_free_wakes_on_release() -> None:
    import threading

    pool = MemoryPool(SLOT, SLOT)
    obj = pool.allocate(SLOT)
    assert obj is not None
    assert pool.allocate(1) is None
    assert pool.wait_for_free(0.01) is False
    timer = threading.Timer(0.05, obj.release)
    timer.start()
    assert pool.wait_for_free(5.0) is True
    timer.join()
    assert pool.allocate(SLOT) is not None
