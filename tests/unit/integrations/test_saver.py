"""The worker's background saver: order, back-pressure, failures, drain and close."""

from __future__ import annotations

import threading
import time

import pytest

from kvmesh.errors import ClosedError
from kvmesh.integrations.vllm.saver import BackgroundSaver
from tests.waiting import eventually


def test_jobs_run_in_order_and_drain_waits_for_them() -> None:
    saver = BackgroundSaver()
    done: list[int] = []
    try:
        for i in range(20):
            saver.submit(lambda i=i: (time.sleep(0.001), done.append(i)), 10)
        assert saver.drain(10)
        assert done == list(range(20)) and saver.pending == 0 and saver.done == 20
    finally:
        saver.close()


def test_a_failing_job_is_counted_and_the_next_still_runs() -> None:
    saver = BackgroundSaver()
    done: list[str] = []

    def boom() -> None:
        raise RuntimeError("disk on fire")

    try:
        saver.submit(boom, 1)
        saver.submit(lambda: done.append("next"), 1)
        assert saver.drain(10)
        assert done == ["next"] and saver.failed == 1 and saver.done == 1
    finally:
        saver.close()


def test_submit_waits_while_the_queue_is_over_its_byte_limit() -> None:
    saver = BackgroundSaver(max_pending_bytes=100)
    gate = threading.Event()
    try:
        saver.submit(gate.wait, 60)
        returned = threading.Event()

        def second() -> None:
            saver.submit(lambda: None, 60)  # 120 > 100: must wait for the first job
            returned.set()

        t = threading.Thread(target=second)
        t.start()
        assert not returned.wait(0.2)
        assert saver.waits == 1
        gate.set()
        assert returned.wait(10)
        t.join()
        # A job larger than the limit still goes once the queue is empty.
        saver.submit(lambda: None, 1000)
        assert saver.drain(10)
    finally:
        gate.set()
        saver.close()


def test_drain_times_out_and_close_finishes_queued_jobs() -> None:
    saver = BackgroundSaver()
    gate = threading.Event()
    done: list[int] = []
    saver.submit(gate.wait, 1)
    saver.submit(lambda: done.append(1), 1)
    assert not saver.drain(0.05)
    gate.set()
    saver.close()
    assert done == [1]
    with pytest.raises(ClosedError, match="closed"):
        saver.submit(lambda: None, 1)


def test_concurrent_savers_keep_each_requests_order_and_run_requests_side_by_side() -> None:
    """A request's saves stay in order; another request's save is not held behind a slow one
    (before, one serial saver made every save wait for the slowest)."""
    saver = BackgroundSaver(workers=2)
    gate = threading.Event()
    done: list[str] = []
    keys = ["a", "b"]
    while len({hash_slot(k) for k in keys}) < 2:  # two requests on different threads
        keys[1] += "x"
    try:
        saver.submit(lambda: (gate.wait(5), done.append("a0")), 10, keys[0])
        saver.submit(lambda: done.append("a1"), 10, keys[0])
        saver.submit(lambda: done.append("b0"), 10, keys[1])
        eventually(lambda: "b0" in done, 5)
        assert done == ["b0"]  # ran while request a's first save was stuck
        gate.set()
        assert saver.drain(5)
        assert done == ["b0", "a0", "a1"]
    finally:
        gate.set()
        saver.close()


def test_settle_waits_for_the_jobs_submitted_before_it_only() -> None:
    """What "stored so far" waits for on a busy replica: the saves handed over before the
    call. drain() waits for an empty saver, which a replica under load may never have."""
    saver = BackgroundSaver(workers=2)
    first, later = threading.Event(), threading.Event()
    done: list[str] = []
    keys = ["a", "b"]
    while len({hash_slot(k) for k in keys}) < 2:
        keys[1] += "x"
    try:
        saver.submit(lambda: (first.wait(5), done.append("a")), 10, keys[0])
        assert saver.settle(0.05) is False  # "a" is still running
        first.set()
        saver.submit(lambda: (later.wait(5), done.append("b")), 10, keys[1])
        marked = threading.Event()
        result: list[bool] = []
        # submitted after "b": settle waits for "a" and "b" only
        threading.Thread(target=lambda: (marked.set(), result.append(saver.settle(5)))).start()
        assert marked.wait(5)
        time.sleep(0.1)
        assert result == []  # "b" is still running
        later.set()
        eventually(lambda: result, 5)
        assert result == [True] and sorted(done) == ["a", "b"]
        gate = threading.Event()
        saver.submit(lambda: gate.wait(5), 10, keys[0])  # after the mark of the next call
        assert saver.settle(0) is False  # ... but before this one
        gate.set()
        assert saver.settle(5) is True
    finally:
        first.set()
        later.set()
        saver.close()


def hash_slot(key: str) -> int:
    import zlib

    return zlib.crc32(key.encode()) % 2
