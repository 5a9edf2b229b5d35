"""Asynchronous loads and lookups (issue #25), without starting vLLM: the scheduler side's
``(n, True)`` planning, and the worker reading from a real disk tier beside the steps, then
naming the request in ``finished_loading`` (vLLM's ``finished_recving``).

Slow and hung remote tiers are ``faulty://`` tiers with ``latency_s`` (fault injection: a
real Redis that hangs is in tests/e2e/test_remote_stall.py and test_async_stall in
tests/integration)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from kvmesh import CacheEngine, KVLayout
from kvmesh.integrations.vllm.metadata import KVMeshConnectorMetadata, LoadSpec, SaveSpec
from kvmesh.integrations.vllm.scheduler import SchedulerSide
from kvmesh.integrations.vllm.worker import WorkerSide
from kvmesh.tiers.testing import reset_memory_stores
from tests.unit.integrations.test_connector import BS, FakeRank, paged, request, sched_out, settled
from tests.waiting import eventually

LAYOUT = KVLayout(3, 2, 16, torch.float32)
TOKENS = list(range(3000, 3000 + 1025))
SRC = list(range(0, 8))
DST = list(range(12, 20))


class AnswerRank(FakeRank):
    """Answers the detailed lookup from a script: a dict per call."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        super().__init__()
        self.answers = answers

    def call(self, op: str, **args: Any) -> Any:
        self.calls.append((op, args))
        return self.answers.pop(0) if op == "lookup" else True


def busy(s: SchedulerSide) -> SchedulerSide:
    """``s`` with another request in flight (a lookup of a short prompt: no worker asked)."""
    assert s.lookup(request("running", BS), 0) == 0
    return s


def test_lower_tier_hit_is_planned_as_an_async_load() -> None:
    s = busy(SchedulerSide(256, BS, [AnswerRank([{"tokens": 1024, "lower": True}])], async_loads="lower"))
    r = request("a", 1025)
    assert s.lookup(r, 0) == 1024 and s.load_async("a")
    s.after_alloc(r, list(range(100, 109)), 1024)
    (load,) = s.build_meta(sched_out(new=[(r, list(range(100, 109)), 1024, 0)])).loads
    assert load.load_async and load.pd is None and load.block_ids == list(range(100, 108))


def test_a_lower_tier_hit_with_nothing_else_in_flight_loads_in_the_step() -> None:
    """Nobody waits for a load inside the step of an idle engine, and the asynchronous path
    would cost the request a step; once another request is in flight, it goes beside it."""
    answers = [{"tokens": 1024, "lower": True}, {"tokens": 1024, "lower": True}]
    s = SchedulerSide(256, BS, [AnswerRank(answers)], async_loads="lower")
    a = request("a", 1025)
    assert s.lookup(a, 0) == 1024 and not s.load_async("a")
    b = request("b", 1025)
    assert s.lookup(b, 0) == 1024 and s.load_async("b")  # a is still in flight
    s.finished(a)
    s.finished(b)
    assert not s._inflight
    every = SchedulerSide(256, BS, [AnswerRank([{"tokens": 1024, "lower": True}])], async_loads="all")
    assert every.lookup(request("c", 1025), 0) == 1024 and every.load_async("c")  # all: always


def test_cpu_hit_stays_synchronous_and_off_means_the_old_lookup() -> None:
    s = SchedulerSide(256, BS, [AnswerRank([{"tokens": 1024, "lower": False}])], async_loads="lower")
    assert s.lookup(request("a", 1025), 0) == 1024 and not s.load_async("a")
    rank = FakeRank()
    off = SchedulerSide(256, BS, [rank], async_loads="off")
    assert off.lookup(request("b", 1025), 0) == 1024 and not off.load_async("b")
    assert "detail" not in rank.calls[-1][1]  # the worker's synchronous lookup, as before


def test_a_pending_lookup_is_not_known_yet_and_asked_again_with_the_same_seq() -> None:
    rank = AnswerRank([{"pending": True}, {"pending": True}, {"tokens": 512, "lower": True}])
    s = busy(SchedulerSide(256, BS, [rank], async_loads="lower"))
    r = request("a", 1025)
    assert s.lookup(r, 0) is None  # vLLM skips the request this step; the batch goes on
    assert s.lookup(r, 0) is None
    assert s.lookup(r, 0) == 512 and s.load_async("a")
    assert {args["seq"] for _, args in rank.calls} == {1}
    assert s.stats["lookups"] == 1 and s.stats["lookups_pending"] == 2


def test_a_request_finished_while_its_lookup_runs_releases_it() -> None:
    s = SchedulerSide(256, BS, [AnswerRank([{"pending": True}])], async_loads="lower")
    r = request("a", 1025)
    assert s.lookup(r, 0) is None
    s.finished(r)
    assert s.build_meta(sched_out()).releases == [("a", 1)]


def test_a_failed_load_is_never_offered_again_but_a_preempted_request_reloads() -> None:
    """vLLM looks a request up again only after a load of it failed outright (0 computed
    tokens) or after a preemption. The same lookup would find the same chunks the load could
    not read: offered again, the request would fail and come back for ever (a soak saw 5,865
    rounds in 60 s). After a preemption it may load again."""
    answers = [{"tokens": 1024, "lower": True} for _ in range(4)]
    rank = AnswerRank(answers)
    s = SchedulerSide(256, BS, [rank], async_loads="lower")
    r = request("a", 1025)
    blocks = list(range(100, 109))
    assert s.lookup(r, 0) == 1024
    s.after_alloc(r, blocks, 1024)
    assert len(s.build_meta(sched_out()).loads) == 1
    # the load failed; vLLM put the request back with 0 computed tokens and asks again
    assert s.lookup(r, 0) == 0 and s.stats["loads_not_retried"] == 1
    assert [op for op, _ in rank.calls] == ["lookup"]  # nothing asked of the workers
    s.after_alloc(r, blocks, 0)  # vLLM computes it
    assert s.build_meta(sched_out()).loads == []
    # a second request, loaded, then preempted: looked up again, it loads again
    b = request("b", 1025)
    assert s.lookup(b, 0) == 1024
    s.after_alloc(b, blocks, 1024)
    out = sched_out()
    out.preempted_req_ids = {"b"}
    assert len(s.build_meta(out).loads) == 1
    assert s.lookup(b, 0) == 1024
    s.finished(b)
    s.finished(r)
    assert not s._planned


def test_pd_decode_half_is_an_async_load_that_pulls() -> None:
    rank = AnswerRank([{"tokens": 1024, "lower": False}])
    s = SchedulerSide(256, BS, [rank], pd_ranks=[rank], async_loads="lower")
    params = {
        "do_remote_prefill": True,
        "remote_host": "h",
        "remote_port": 1,
        "kvmesh": {"keys": ["k"] * 4, "num_tokens": 1024, "ports": [1], "transfer_id": "t-1"},
    }
    r = request("d", 1025, kv_transfer_params=params)
    assert s.lookup(r, 0) == 1024 and s.load_async("d")
    assert s.lookup(r, 0) == 1024 and s.load_async("d")  # asked again (no room): offered again
    assert rank.calls == []  # nothing pulled inside the scheduler's step
    s.after_alloc(r, list(range(9)), 1024)
    (load,) = s.build_meta(sched_out()).loads
    assert load.load_async and load.pd == params and s.stats["pd_pulls"] == 1
    preempted = sched_out()
    preempted.preempted_req_ids = {"d"}
    s.build_meta(preempted)
    assert s.lookup(r, 0) == 1024  # looked up again (preempted): the pulled chunks, no second pull
    assert not s.load_async("d") and [op for op, _ in rank.calls] == ["lookup"]


# -- worker: reads beside the steps -------------------------------------------------------
@pytest.fixture
def disk_worker(tmp_path: Path) -> Iterator[WorkerSide]:
    reset_memory_stores()
    engine = CacheEngine(
        {"chunk_size": 256, "max_local_cpu_size": 0.01, "local_disk": str(tmp_path / "disk")},
        layout=LAYOUT,
        model_id="async",
    )
    w = WorkerSide(engine, paged(num_blocks=24), BS)
    yield w
    w.close()


def _saved_to_disk(w: WorkerSide) -> None:
    w.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", TOKENS[:1024], SRC, 0)]))
    assert w.wait_for_writes(10)
    w.clear("cpu")  # only the disk holds it now


def _no_pins(w: WorkerSide) -> bool:
    keys = w.engine.keys.keys(TOKENS[:1024])
    disk = w.engine.lower["disk"]
    return w.engine.stats()["cpu"]["pinned"] == 0 and not any(disk.is_pinned(k) for k in keys)  # type: ignore[attr-defined]


def _poll(w: WorkerSide, timeout: float = 10.0, finished: set[str] | None = None) -> set[str]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = w.finished_loading(finished or set())
        if got:
            return got
        time.sleep(0.01)
    return set()


def test_disk_hit_loads_beside_the_step_and_is_named_once(disk_worker: WorkerSide) -> None:
    w = disk_worker
    _saved_to_disk(w)
    got = settled(w, "b", 1, TOKENS[:1024])
    assert got == {"tokens": 1024, "lower": True}
    w.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, TOKENS[:1024], DST, 128, load_async=True)]))
    assert _poll(w) == {"b"}
    assert w.finished_loading(set()) == set()  # named exactly once
    assert w.take_load_errors() == set()
    for layer in w.layers:
        assert torch.equal(layer[DST[1:]], layer[SRC[1:]])  # block 0 was vLLM's own: untouched
        assert not torch.equal(layer[DST[0]], layer[SRC[0]])
    assert _no_pins(w)
    assert w.stats()["connector"]["load_tokens"] == 1024 - 128


def test_the_reader_copies_into_the_pages_not_the_forward_thread(disk_worker: WorkerSide) -> None:
    """vLLM-CPU: the copy into the parked request's pages runs on the reader thread, so
    the step that names the request costs the batch nothing extra."""
    import threading

    w = disk_worker
    _saved_to_disk(w)
    threads: list[str] = []
    scatter = w.page.scatter

    def recording(*args: Any) -> None:
        threads.append(threading.current_thread().name)
        scatter(*args)

    w.page.scatter = recording  # type: ignore[method-assign]
    settled(w, "b", 1, TOKENS[:1024])
    w.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, TOKENS[:1024], DST, 0, load_async=True)]))
    assert _poll(w) == {"b"}
    assert threads and all(t.startswith("kvmesh-load") for t in threads)
    for layer in w.layers:
        assert torch.equal(layer[DST], layer[SRC])


def test_a_give_up_waits_for_the_chunk_being_copied_and_none_follows(disk_worker: WorkerSide) -> None:
    """``give_up`` (the job is then reported: vLLM may recompute into its blocks) waits for
    the chunk the reader is copying; after it, no chunk lands. Either the give-up wins (the
    job copied a prefix and stopped) or the read ended first (every chunk, named normally);
    both are checked against the pages."""
    import threading

    w = disk_worker
    _saved_to_disk(w)
    before = [t[DST].clone() for t in w.layers]
    scatter = w.page.scatter
    copies: list[int] = []
    verdict: list[bool] = []
    blocked: list[bool] = []
    seen: list[int] = []  # chunks copied when give_up returned

    def slow(*args: Any) -> None:
        scatter(*args)
        copies.append(len(copies))
        if len(copies) == 1:  # give up from the forward thread while this chunk is copied
            (job,) = w.loads.snapshot()

            def give_up() -> None:
                verdict.append(w.loads.give_up(job))
                seen.append(len(copies))

            g = threading.Thread(target=give_up)
            g.start()
            g.join(0.2)
            blocked.append(g.is_alive())

    w.page.scatter = slow  # type: ignore[method-assign]
    settled(w, "b", 1, TOKENS[:1024])
    w.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, TOKENS[:1024], DST, 0, load_async=True)]))
    (job,) = w.loads.snapshot()
    assert job.done.wait(10)
    end = time.monotonic() + 5
    while not verdict and time.monotonic() < end:
        time.sleep(0.01)
    assert blocked == [True]  # it waited for the chunk in progress
    landed = 2 * len(copies)  # 256-token chunks: 2 blocks of 128 each
    if verdict == [True]:
        assert len(copies) == seen[0]  # none followed the give-up
        # Usually it stopped the copy; under load the reader can take the lock back for every
        # chunk and the give-up land after the last one, before the read ended: all copied,
        # reported as given up (vLLM recomputes blocks that hold the right KV already).
        assert job.copied is None or (job.copied == 1024 and len(copies) == 4)
    else:
        assert verdict == [False] and job.copied == 1024 and len(copies) == 4
    for layer, b in zip(w.layers, before, strict=True):
        assert torch.equal(layer[DST[:landed]], layer[SRC[:landed]])
        assert torch.equal(layer[DST[landed:]], b[landed:])


def test_a_job_given_up_before_its_copy_copies_nothing(disk_worker: WorkerSide) -> None:
    from kvmesh.integrations.vllm.asyncload import LoadJob

    w = disk_worker
    _saved_to_disk(w)
    before = [t[DST].clone() for t in w.layers]
    job = LoadJob(LoadSpec("b", 1, TOKENS[:1024], DST, 0, load_async=True), time.monotonic())
    with w.engine.retrieve_chunks(TOKENS[:1024]) as chunks:
        job.chunks = chunks
        assert len(chunks) == 4
        job.given_up = True
        assert w.copy_in_reader(job) is None
        job.given_up, job.aborted = False, True
        assert w.copy_in_reader(job) is None
    assert all(torch.equal(t[DST], b) for t, b in zip(w.layers, before, strict=True))


def test_cpu_hit_answers_lower_false(disk_worker: WorkerSide) -> None:
    w = disk_worker
    w.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", TOKENS[:1024], SRC, 0)]))
    assert w.wait_for_writes(10)
    assert settled(w, "b", 1, TOKENS[:1024]) == {"tokens": 1024, "lower": False}
    assert settled(w, "b", 1, TOKENS[:1024]) == {"tokens": 1024, "lower": False}  # asked again
    assert w.engine.stats()["cpu"]["pinned"] == 4  # pinned once, not twice
    assert w.release("b", 1) and w.engine.stats()["cpu"]["pinned"] == 0


def test_request_aborted_while_loading_is_named_and_nothing_is_copied(disk_worker: WorkerSide) -> None:
    w = disk_worker
    _saved_to_disk(w)
    before = [t[DST].clone() for t in w.layers]
    settled(w, "b", 1, TOKENS[:1024])
    w.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, TOKENS[:1024], DST, 0, load_async=True)]))
    assert _poll(w, finished={"b"}) == {"b"}  # vLLM holds its blocks until it is named
    assert "b" not in w.loads.jobs  # named, no longer tracked: its read, if still running, ends alone
    assert eventually(lambda: _no_pins(w), 5)  # and unpins when it does
    assert all(torch.equal(t[DST], b) for t, b in zip(w.layers, before, strict=True))


def test_a_request_aborted_mid_read_is_named_at_once_and_its_read_copies_nothing(
    disk_worker: WorkerSide,
) -> None:
    """vLLM holds an aborted request's blocks until the worker names it: named at the step
    that brings the abort, not when its read ends (a pull from a hung producer: its whole
    budget); the read, left to end alone, copies nothing into blocks vLLM has handed on.
    The read is held (fault injection) so that the abort lands while it runs."""
    w = disk_worker
    _saved_to_disk(w)
    before = [t[DST].clone() for t in w.layers]
    settled(w, "b", 1, TOKENS[:1024])
    entered, gate = threading.Event(), threading.Event()
    real = w.engine.retrieve_chunks

    def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        gate.wait(10)
        return real(*args, **kwargs)

    w.engine.retrieve_chunks = held  # type: ignore[method-assign]
    w.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, TOKENS[:1024], DST, 0, load_async=True)]))
    (job,) = w.loads.snapshot()
    assert entered.wait(5)
    assert w.finished_loading(set()) == set()  # reading: not named
    assert w.finished_loading({"b"}) == {"b"}  # aborted: named with its read still running
    assert not job.done.is_set()
    gate.set()
    assert job.done.wait(10)
    assert w.finished_loading(set()) == set()  # named once
    assert job.copied is None
    assert all(torch.equal(t[DST], b) for t, b in zip(w.layers, before, strict=True))
    assert eventually(lambda: _no_pins(w), 5)
    assert w.stats()["connector"].get("load_tokens", 0) == 0


@pytest.fixture
def slow_remote_worker() -> Iterator[WorkerSide]:
    reset_memory_stores()
    engine = CacheEngine(
        {
            "chunk_size": 256,
            "max_local_cpu_size": 0.01,
            "remote_url": "faulty://slow",
            "remote_timeout_s": 0.3,
        },
        layout=LAYOUT,
        model_id="async",
    )
    w = WorkerSide(engine, paged(num_blocks=24), BS)
    yield w
    w.close()


def test_a_slow_remote_lookup_answers_pending_then_the_hit(slow_remote_worker: WorkerSide) -> None:
    w = slow_remote_worker
    w.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", TOKENS[:1024], SRC, 0)]))
    assert w.wait_for_writes(10)
    w.clear("cpu")
    w.engine.lower["remote"].latency_s = 0.1  # type: ignore[attr-defined]
    t0 = time.monotonic()
    assert w.lookup("b", 1, TOKENS[:1024], detail=True) == {"pending": True}
    assert time.monotonic() - t0 < 0.09  # the scheduler's step did not wait for the remote
    end = time.monotonic() + 5
    while (got := w.lookup("b", 1, TOKENS[:1024], detail=True)) == {"pending": True}:
        assert time.monotonic() < end
        time.sleep(0.02)
    assert got == {"tokens": 1024, "lower": True}


def test_a_lookup_that_hangs_is_a_miss_after_its_budget_and_unpins_when_it_ends(
    slow_remote_worker: WorkerSide,
) -> None:
    """A tier that hangs past its own deadline (a hung NFS server under the fs tier): the
    lookup answered "pending" for ever, so its request was never scheduled, and once the
    pool's four threads hung every new request with it. Past ``remote_timeout_s + 1 s`` it is
    a miss (the request is computed), counted and said once; what it pinned before it hung
    is unpinned when it ends."""
    w = slow_remote_worker
    w.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", TOKENS[:1024], SRC, 0)]))
    assert w.wait_for_writes(10)
    w.clear("cpu")
    w.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("c", TOKENS[:512], SRC, 0)]))
    assert w.wait_for_writes(10)  # the cpu tier holds the first two chunks, the remote all four
    remote = w.engine.lower["remote"]
    remote.hold = threading.Event()  # type: ignore[attr-defined]
    try:
        t0 = time.monotonic()
        asked = [w.lookup(f"r{i}", 1, TOKENS[:1024], detail=True) for i in range(6)]  # > the pool's 4
        assert asked == [{"pending": True}] * 6
        answers: dict[str, Any] = {}
        while len(answers) < 6:
            assert time.monotonic() - t0 < 5, answers
            for i in range(6):
                got = w.lookup(f"r{i}", 1, TOKENS[:1024], detail=True)
                if got != {"pending": True}:
                    answers.setdefault(f"r{i}", (got, time.monotonic() - t0))
            time.sleep(0.02)
        budget = w.engine.config.remote_timeout_s + 1.0
        for got, took in answers.values():
            assert got == {"tokens": 0, "lower": False} and budget <= took < budget + 1.0, (got, took)
        assert w.stats()["connector"]["lookup_timeouts"] == 6
        assert w.lookup("r0", 1, TOKENS[:1024], detail=True) == {"tokens": 0, "lower": False}  # asked again
        assert w.stats()["connector"]["lookup_timeouts"] == 6
    finally:
        remote.hold.set()  # type: ignore[attr-defined]
    for i in range(6):
        w.release(f"r{i}", 1)
    assert eventually(lambda: w.engine.stats()["cpu"]["pinned"] == 0, 5)


def test_polls_of_a_lookup_still_running_do_not_wait(slow_remote_worker: WorkerSide) -> None:
    """The scheduler asks again at every step while a lookup runs on; each ask is inside
    that step, so only the first may wait (a few ms), the others answer at once."""
    w = slow_remote_worker
    w.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", TOKENS[:1024], SRC, 0)]))
    assert w.wait_for_writes(10)
    w.clear("cpu")
    w.engine.lower["remote"].latency_s = 0.25  # type: ignore[attr-defined]
    assert w.lookup("b", 1, TOKENS[:1024], detail=True) == {"pending": True}
    waits = []
    for _ in range(5):
        t0 = time.perf_counter()
        assert w.lookup("b", 1, TOKENS[:1024], detail=True) == {"pending": True}
        waits.append(time.perf_counter() - t0)
    assert sorted(waits)[2] < 0.01  # the median poll: no LOOKUP_WAIT_S (20 ms) in it


def test_a_cpu_only_lookup_runs_in_the_callers_thread_and_a_lower_tier_one_on_the_pool(
    slow_remote_worker: WorkerSide, tmp_path: Path
) -> None:
    """Nothing the lookup of a cpu-only engine asks can block, so it runs in the RPC thread
    that asked: no hand-off to the pool and back on the scheduler's path. An engine with a
    lower tier keeps the pool: a slow remote answers "pending" instead of holding the step,
    and a disk's lookup (which starts its reads) stays where it was measured faster."""
    threads: list[str] = []
    local = WorkerSide(
        CacheEngine({"chunk_size": 256, "max_local_cpu_size": 0.01}, layout=LAYOUT, model_id="cpu"),
        paged(num_blocks=24),
        BS,
    )
    disk_config = {"chunk_size": 256, "max_local_cpu_size": 0.01, "local_disk": str(tmp_path)}
    disk = WorkerSide(CacheEngine(disk_config, layout=LAYOUT, model_id="disk"), paged(num_blocks=24), BS)
    try:
        for w in (local, disk, slow_remote_worker):
            look = w._lookups._lookup
            w._lookups._lookup = lambda arr, adapter, look=look: (
                threads.append(threading.current_thread().name),
                look(arr, adapter),
            )[1]
        local.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", TOKENS[:1024], SRC, 0)]))
        assert local.wait_for_writes(10)
        assert local.lookup("b", 1, TOKENS[:1024], detail=True) == {"tokens": 1024, "lower": False}
        assert threads == [threading.current_thread().name]
        assert local.release("b", 1) and local.engine.stats()["cpu"]["pinned"] == 0
        settled(disk, "c", 1, TOKENS[:1024])
        settled(slow_remote_worker, "c", 1, TOKENS[:1024])
        assert [t.startswith("kvmesh-lookup") for t in threads[1:]] == [True, True]
    finally:
        local.close()
        disk.close()


def test_a_load_past_its_budget_is_recomputed_and_never_written_late(slow_remote_worker: WorkerSide) -> None:
    w = slow_remote_worker
    w.end_step(KVMeshConnectorMetadata(saves=[SaveSpec("a", TOKENS[:1024], SRC, 0)]))
    assert w.wait_for_writes(10)
    w.clear("cpu")
    # The lookup inside the step (it asks the remote; an asynchronous one would read the
    # chunks into the cpu pool, and the load below would not touch the remote).
    assert w.lookup("b", 1, TOKENS[:1024]) == 1024
    before = [t[DST].clone() for t in w.layers]
    w.engine.lower["remote"].latency_s = 2.0  # type: ignore[attr-defined]  # a hung Redis, roughly
    t0 = time.monotonic()
    w.start_step(KVMeshConnectorMetadata(loads=[LoadSpec("b", 1, TOKENS[:1024], DST, 0, load_async=True)]))
    assert _poll(w, timeout=5) == {"b"}
    waited = time.monotonic() - t0
    assert waited < w.loads.budget_s + 0.5  # its budget (remote_timeout_s + 1 s), not the tier's hang
    assert w.take_load_errors() == set(DST)  # every block: vLLM recomputes the prompt
    assert w.stats()["connector"]["load_timeouts"] == 1
    time.sleep(2.5)  # the read ends late...
    assert w.finished_loading(set()) == set()
    assert all(torch.equal(t[DST], b) for t, b in zip(w.layers, before, strict=True))  # ...and writes nothing
    eventually(
        lambda: not w.engine.stats()["cpu"]["pinned"], 5
    )  # its pins go when that read's thread is done with it
    assert w.engine.stats()["cpu"]["pinned"] == 0


def test_pd_params_that_do_not_verify_are_not_offered_beside_the_batch() -> None:
    """Signed parameters are checked before the scheduler offers their tokens: unsigned ones
    under a fleet key go to the worker's pull, which refuses them (and counts why)."""
    from kvmesh.core.fleetkey import FleetKey

    rank = AnswerRank([{"tokens": 0, "lower": False}])
    key = FleetKey([b"k" * 32])
    s = SchedulerSide(256, BS, [rank], pd_ranks=[rank], async_loads="lower", pd_key=key)
    params = {
        "do_remote_prefill": True,
        "remote_host": "h",
        "remote_port": 1,
        "kvmesh": {"keys": ["k"] * 4, "num_tokens": 1024, "ports": [1], "transfer_id": "t-1"},
    }
    r = request("d", 1025, kv_transfer_params=params)
    assert s.lookup(r, 0) == 0 and not s.load_async("d")
    assert [op for op, _ in rank.calls] == ["pd_pull", "lookup"]


def test_readers_lower_the_gil_switch_interval_only_while_they_run() -> None:
    import sys

    from kvmesh.integrations.vllm.asyncload import GilShare

    before = sys.getswitchinterval()
    share = GilShare(0.0002)
    with share:
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        with share:  # a second reader
            pass
        assert sys.getswitchinterval() == pytest.approx(0.0002)  # the first still runs
    assert sys.getswitchinterval() == before
