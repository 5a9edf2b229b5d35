"""The front ends' process set-up (:mod:`kvmesh.routing.loop`): the start-up heap frozen out of
the cyclic collector's reach, and what ``/kvmesh/state`` reports of it. The ``kvmesh router``
and ``kvmesh epp`` processes are checked to freeze theirs in
``tests/integration/test_router_restart.py`` and ``tests/e2e/test_epp_envoy.py``."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from kvmesh.routing.loop import freeze_heap, gc_state


@pytest.fixture
def thawed() -> Iterator[None]:
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()  # this test process's heap stays collectable


def test_freeze_moves_the_heap_out_of_full_collections(thawed: None) -> None:
    assert gc_state()["frozen"] == 0
    tracked = len(gc.get_objects())  # what every full collection walks
    frozen = freeze_heap()
    # Reference counting still frees frozen objects: a thread an earlier test left running can
    # drop a few between the freeze and the reads (a clean-clone run read 2 fewer). The count
    # only shrinks after a freeze, never grows.
    reported, counted = gc_state()["frozen"], gc.get_freeze_count()
    assert isinstance(reported, int) and frozen - 1_000 < counted <= reported <= frozen
    assert frozen > 10_000 and frozen > tracked / 2  # pytest, numpy, kvmesh: alive now
    # A full collection now walks only what was allocated since the freeze.
    assert len(gc.get_objects()) < 1_000


def test_what_is_allocated_after_the_freeze_is_still_collected(thawed: None) -> None:
    freeze_heap()

    class Node:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the cyclic collector frees it

    ref = weakref.ref(Node())
    assert ref() is not None
    gc.collect()
    assert ref() is None


def test_state_counts_collections_per_generation() -> None:
    state = gc_state()
    assert len(state["collections"]) == 3  # type: ignore[arg-type]
    before = state["collections"][2]  # type: ignore[index]
    gc.collect()
    # At least this one: another thread's allocations can start one of their own meanwhile.
    assert gc_state()["collections"][2] >= before + 1  # type: ignore[index]
