"""An asynchronous load the cost model predicts to end just after the step's forward is
waited for, briefly and boundedly, when vLLM asks what finished (asyncsteps.py): its request
then computes at the next step, not the one after. Each load is waited for once at most; one
with no figure yet (a tier's first loads) is waited for once as well. A load predicted to end
later, or a step that was not timed, is not waited for.

The reader is held on a gate (fault injection) so that "ends while ``finished_loading``
waits" is a fact of the test, not of the machine's speed; the disk tier is real."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import kvmesh.integrations.vllm.asyncsteps as asyncsteps
from kvmesh.integrations.vllm.asyncload import LoadJob
from kvmesh.integrations.vllm.metadata import KVMeshConnectorMetadata, LoadSpec
from kvmesh.integrations.vllm.worker import WorkerSide
from tests.unit.integrations.test_async_loads import DST, TOKENS, _saved_to_disk, disk_worker
from tests.unit.integrations.test_connector import settled

__all__ = ["disk_worker"]  # the fixture, used by name


@pytest.fixture
def gated(
    disk_worker: WorkerSide, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[WorkerSide, threading.Event]]:
    """A worker whose disk holds ``TOKENS[:1024]``, the disk measured by the cost model,
    the last forward timed at 1 s, a 2 s cap on the wait, and a reader that copies only once
    the returned event is set."""
    w = disk_worker
    _saved_to_disk(w)
    for i in range(6):  # the disk's figure: a few loads of different sizes
        with w.engine.retrieve_chunks(TOKENS[: 256 * (1 + i % 4)]):
            pass
        w.clear("cpu")
    assert w.engine.costs.tiers["disk"].measured
    monkeypatch.setattr(asyncsteps, "FINISH_WAIT_S", 2.0)
    w.clock.last_s = 1.0
    go = threading.Event()
    copy = w.loads.copy_in
    assert copy is not None

    def held(job: LoadJob) -> Any:
        assert go.wait(10)
        return copy(job)

    w.loads.copy_in = held
    yield w, go
    go.set()


def _start(w: WorkerSide) -> None:
    assert settled(w, "b", 1, TOKENS[:1024]) == {
        "tokens": 1024,
        "lower": True,
    }  # no expect_s for the scheduler
    w.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, TOKENS[:1024], DST, 0, load_async=True)]))


def test_a_load_predicted_to_end_within_the_wait_is_named_in_this_step(
    gated: tuple[WorkerSide, threading.Event],
) -> None:
    w, go = gated
    _start(w)
    (job,) = w.loads.snapshot()
    assert job.expect_s is not None and 0 < job.expect_s < 1.0  # the disk's figure, a few ms
    threading.Timer(0.2, go.set).start()
    t0 = time.monotonic()
    assert w.finished_loading(set()) == {"b"}  # the first ask: it was waited for
    assert 0.15 < time.monotonic() - t0 < 1.9
    assert w.take_load_errors() == set()
    counters = w.stats()["connector"]
    assert counters["load_finish_waits"] == 1 and counters.get("load_finish_waits_missed", 0) == 0


def test_the_wait_is_bounded_and_a_miss_is_named_later(
    gated: tuple[WorkerSide, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    w, go = gated
    monkeypatch.setattr(asyncsteps, "FINISH_WAIT_S", 0.1)
    _start(w)
    t0 = time.monotonic()
    assert w.finished_loading(set()) == set()
    assert 0.08 < time.monotonic() - t0 < 1.0  # the cap, not the load
    assert w.stats()["connector"]["load_finish_waits_missed"] == 1
    go.set()
    end = time.monotonic() + 10
    while not (got := w.finished_loading(set())) and time.monotonic() < end:
        time.sleep(0.01)
    assert got == {"b"}


@pytest.mark.parametrize("why", ["predicted later", "step not timed"])
def test_no_wait_when_the_load_is_not_predicted_to_end_in_time(
    gated: tuple[WorkerSide, threading.Event], why: str
) -> None:
    w, go = gated
    _start(w)
    (job,) = w.loads.snapshot()
    if why == "predicted later":
        job.expect_s = 60.0
    else:
        w.clock.last_s = None
    t0 = time.monotonic()
    assert w.finished_loading(set()) == set()
    assert time.monotonic() - t0 < 0.1  # named at a later step; the batch never waited
    assert "load_finish_waits" not in w.stats()["connector"]
    go.set()


@pytest.mark.parametrize("figure", [True, False])
def test_a_load_is_waited_for_once_with_a_figure_or_none_yet(
    gated: tuple[WorkerSide, threading.Event], monkeypatch: pytest.MonkeyPatch, figure: bool
) -> None:
    """The first ask after the load started waits (bounded) for one predicted to end in
    time, and for one the cost model has no figure for yet (a fresh engine's first loads
    from a tier); a load still running at the next ask is not waited for again."""
    w, go = gated
    monkeypatch.setattr(asyncsteps, "FINISH_WAIT_S", 0.1)
    _start(w)
    (job,) = w.loads.snapshot()
    if not figure:
        job.expect_s = None
    t0 = time.monotonic()
    assert w.finished_loading(set()) == set()
    assert 0.08 < time.monotonic() - t0 < 1.0  # waited, to the cap
    t1 = time.monotonic()
    assert w.finished_loading(set()) == set()
    assert time.monotonic() - t1 < 0.05  # not again
    counters = w.stats()["connector"]
    assert counters["load_finish_waits"] == 1 and counters["load_finish_waits_missed"] == 1
    go.set()
    end = time.monotonic() + 10
    while not (got := w.finished_loading(set())) and time.monotonic() < end:
        time.sleep(0.01)
    assert got == {"b"}


def test_the_prediction_stays_in_the_worker_and_goes_with_the_pins(disk_worker: WorkerSide) -> None:
    w = disk_worker
    _saved_to_disk(w)
    w._expect.clear()
    w.engine.costs.observe_load("disk", 1_000_000, 0.01)
    for n in (2_000_000, 3_000_000, 4_000_000):
        w.engine.costs.observe_load("disk", n, 0.01 * n / 1e6)
    assert settled(w, "b", 1, TOKENS[:1024]) == {"tokens": 1024, "lower": True}
    assert w._expect["b"][0] == 1
    assert w.release("b", 1)
    assert "b" not in w._expect
