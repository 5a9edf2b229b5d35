"""A slow or black-holed remote never stalls: one deadline (``remote_timeout_s``) for a whole
lookup / retrieve / store, the breaker open on the first timeout, a late load a miss.

Real things: a loopback TCP listener that accepts connections and never answers (a black
hole), and the session's real redis-server frozen with SIGSTOP mid-run and thawed with
SIGCONT. One engine-level test uses the ``faulty://`` tier's injected latency (a fake, for
fault injection) to show the budget covers a whole multi-chunk retrieve.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from kvmesh import CacheEngine
from kvmesh.core.keys import KeyBuilder, KVLayout
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import TierOptions, open_tier
from kvmesh.tiers.redis import RedisTier
from kvmesh.tiers.testing import FaultyTier, reset_memory_stores
from tests.waiting import eventually

pytestmark = pytest.mark.redis

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float16")
CS = 16
KEYS = KeyBuilder("m", LAYOUT, CS)
BUDGET = 0.5  # remote_timeout_s of these tests
SLACK = 0.35  # scheduling noise on a loaded 2-core machine


class BlackHole:
    """A loopback listener that accepts every connection and never replies."""

    def __init__(self, port: int = 0) -> None:
        self.srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port Redis just left
        self.srv.bind(("127.0.0.1", port))
        self.srv.listen(64)
        self.srv.settimeout(0.1)
        self.url = f"redis://127.0.0.1:{self.srv.getsockname()[1]}/0"
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._held.append(conn)  # kept open, never read, never answered

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for c in self._held:
            c.close()
        self.srv.close()


@pytest.fixture
def black_hole() -> Iterator[str]:
    hole = BlackHole()
    try:
        yield hole.url
    finally:
        hole.close()


@contextmanager
def frozen(server: Any) -> Iterator[None]:
    """redis-server SIGSTOPped: connections are accepted by the kernel, nothing answers."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def make_engine(remote_url: str, **cfg: object) -> CacheEngine:
    config = {
        "chunk_size": CS,
        "max_local_cpu_size": 0.001,
        "remote_url": remote_url,
        "remote_timeout_s": BUDGET,
        **cfg,
    }
    return CacheEngine(config, layout=LAYOUT, model_id="m")


def prompt(n_chunks: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    toks = np.random.default_rng(seed).integers(0, 50_000, n_chunks * CS, dtype=np.uint32)
    return toks, torch.randn(LAYOUT.shape(len(toks))).to(torch.float16)


def only_remote(engine: CacheEngine, toks: np.ndarray, kv: torch.Tensor) -> None:
    """Store, let the remote write land, and drop the cpu copy: the next read is remote."""
    assert engine.store(toks, kv) == len(toks)
    assert engine.wait_for_writes(10)
    engine.clear("cpu", force=True)


def test_tier_black_holed_from_start_answers_at_once(black_hole: str) -> None:
    tier, took = timed(
        lambda: open_tier(
            black_hole, TierOptions(name="remote", timeout_s=BUDGET, metrics=TierMetrics("remote"))
        )
    )
    assert isinstance(tier, RedisTier)
    try:
        assert took < BUDGET + SLACK  # the start-up ping is bounded too
        assert tier.health() == "down"
        keys = KEYS.keys(np.arange(2 * CS, dtype=np.uint32))
        answers, took = timed(lambda: (tier.contains(keys), tier.get(keys)))
        assert answers == ([False, False], [None, None]) and took < 0.05
    finally:
        tier.close()


def test_engine_over_a_black_hole_never_waits_past_the_budget(black_hole: str) -> None:
    engine, took = timed(lambda: make_engine(black_hole))
    assert isinstance(engine, CacheEngine)
    try:
        assert took < BUDGET + SLACK
        toks, kv = prompt(2, 1)
        stored, took = timed(lambda: engine.store(toks, kv))
        assert stored == 2 * CS and took < SLACK  # the remote write is queued, not awaited
        assert engine.wait_for_writes(BUDGET + SLACK)  # and dropped at once: the tier is down
        assert engine.lookup(toks) == 2 * CS  # cpu still answers
        engine.clear("cpu", force=True)
        (n, _), took = timed(lambda: engine.retrieve(toks))  # type: ignore[misc]
        assert n == 0 and took < SLACK
    finally:
        engine.close()


def test_redis_replaced_by_a_black_hole_mid_run(redis_server_factory: Any) -> None:
    """Redis dies and a black hole takes its port: the engine's next lookup reconnects into
    it and must still answer within one budget (retries included), then recover when Redis
    is back."""
    server = redis_server_factory()
    server.start()
    engine = make_engine(server.url)
    remote = engine.lower["remote"]
    assert isinstance(remote, RedisTier)
    remote.guard.probe_interval_s = 0.1
    hole: BlackHole | None = None
    try:
        toks, kv = prompt(2, 5)
        only_remote(engine, toks, kv)
        assert engine.lookup(toks) == 2 * CS
        server.kill()
        hole = BlackHole(server.port)
        n, took = timed(lambda: engine.lookup(toks))
        assert n == 0 and took < BUDGET + SLACK, f"lookup took {took:.2f}s"
        (n, _), took = timed(lambda: engine.retrieve(toks))  # type: ignore[misc]
        assert n == 0 and took < SLACK  # the breaker is open: no network at all
        hole.close()
        hole = None
        server.start()  # same port, empty
        assert eventually(lambda: remote.health() == "up"), "breaker did not close after Redis came back"
        only_remote(engine, toks, kv)
        n, got = engine.retrieve(toks)
        assert n == 2 * CS and torch.equal(got, kv)
    finally:
        if hole is not None:
            hole.close()
        engine.close()


def test_tier_sigstopped_opens_breaker_on_first_timeout_and_recovers(redis_restartable: Any) -> None:
    tier = open_tier(
        redis_restartable.url,
        TierOptions(
            name="remote", timeout_s=BUDGET, retries=3, probe_interval_s=0.1, metrics=TierMetrics("r")
        ),
    )
    assert isinstance(tier, RedisTier)
    try:
        keys = KEYS.keys(np.arange(3 * CS, dtype=np.uint32))
        assert tier.contains(keys) == [False] * 3
        with frozen(redis_restartable):
            got, took = timed(lambda: tier.contains(keys))
            assert got == [False] * 3
            assert took < BUDGET + SLACK, (
                f"one budget for the whole call, retries included (took {took:.2f}s)"
            )
            assert tier.health() == "down"
            snap = tier.metrics.snapshot()
            assert snap["timeouts"] == 1 and snap["up"] == 0  # no retry after the timeout
            got, took = timed(lambda: tier.get(keys))
            assert got == [None] * 3 and took < 0.05  # breaker open: no network at all
        assert eventually(lambda: tier.health() == "up"), "breaker did not close after SIGCONT"
        assert tier.contains(keys) == [False] * 3
    finally:
        tier.close()


def test_engine_with_sigstopped_redis_misses_within_the_deadline(redis_restartable: Any) -> None:
    engine = make_engine(redis_restartable.url)
    remote = engine.lower["remote"]
    assert isinstance(remote, RedisTier)
    remote.guard.probe_interval_s = 0.1  # recover quickly after SIGCONT
    try:
        toks, kv = prompt(3, 2)
        only_remote(engine, toks, kv)
        assert engine.lookup(toks) == 3 * CS

        with frozen(redis_restartable):  # the scheduler's lookup while Redis hangs
            n, took = timed(lambda: engine.lookup(toks))
            assert n == 0 and took < BUDGET + SLACK, f"lookup took {took:.2f}s"
            other, okv = prompt(1, 3)
            stored, took = timed(lambda: engine.store(other, okv))
            assert stored == CS and took < SLACK
            assert engine.wait_for_writes(BUDGET + SLACK)  # the queued write gives up, not hangs
        assert eventually(lambda: remote.health() == "up")
        assert engine.lookup(toks) == 3 * CS
        n, got = engine.retrieve(toks)
        assert n == 3 * CS and torch.equal(got, kv)

        engine.clear("cpu", force=True)
        assert engine.lookup(toks) == 3 * CS  # promised to the scheduler ...
        with frozen(redis_restartable):  # ... then Redis hangs before the worker loads it
            (n, got), took = timed(lambda: engine.retrieve(toks))  # type: ignore[misc]
            assert took < BUDGET + SLACK, f"retrieve took {took:.2f}s"
            assert n == 0 and got.shape[2] == 0  # a miss, never wrong bytes: vLLM recomputes
        assert eventually(lambda: remote.health() == "up"), "breaker did not close after SIGCONT"
        n, got = engine.retrieve(toks)
        assert n == 3 * CS and torch.equal(got, kv)
    finally:
        engine.close()


def test_one_round_trip_for_a_whole_multi_chunk_retrieve() -> None:
    """faulty:// with injected latency (a fake): each call to the remote costs 0.2 s, like a
    round trip to a store far away. A retrieve of six chunks asks it once (the Redis client
    pipelines the batch), so it takes one round trip, not six (1.2 s, past the 0.5 s budget:
    before, only the chunks read in time were kept). A remote slower than the budget as a
    whole is cut by its own guard: the real-Redis tests above."""
    reset_memory_stores()
    engine = make_engine("faulty://budget")
    remote = engine.lower["remote"]
    assert isinstance(remote, FaultyTier)
    try:
        toks, kv = prompt(6, 4)
        only_remote(engine, toks, kv)
        remote.latency_s = 0.2
        calls = remote.calls
        (n, got), took = timed(lambda: engine.retrieve(toks))  # type: ignore[misc]
        assert took < 0.2 + SLACK, f"retrieve took {took:.2f}s"
        assert n == 6 * CS and torch.equal(got, kv) and remote.calls == calls + 1
    finally:
        engine.close()
        reset_memory_stores()
