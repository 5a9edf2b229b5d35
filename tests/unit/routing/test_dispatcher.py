"""The dispatcher: one request's lifecycle (decide -> ticket hooks), the cost policy's tickets
on its hooks, and two routers over the same replicas deciding alike.

Real index, pool and pickers; the replicas' health and gauges are set as the health loop
sets them (no servers: what is under test is the bookkeeping, not HTTP).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvmesh.events.codec import BlockStored, EventBatch
from kvmesh.index import BlockIndex
from kvmesh.routing.config import ReplicaConfig, RoutingConfig
from kvmesh.routing.dispatcher import Dispatcher, InlineTimers, Refusal
from kvmesh.routing.picker import build_picker
from kvmesh.routing.pool import Pool
from kvmesh.routing.scorers import RoutingRequest
from kvmesh.routing.sessions import SessionTable

BS = 16
NAMES = ("a", "b", "c")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(
    policy: str = "kvmesh", clock: Clock | None = None, **cfg: object
) -> tuple[Dispatcher, Pool, BlockIndex]:
    config = RoutingConfig(
        replicas=tuple(ReplicaConfig(url=f"http://{n}:1", name=n) for n in NAMES),
        policy=policy,  # type: ignore[arg-type]
        block_size=BS,
        **cfg,  # type: ignore[arg-type]
    )
    index = BlockIndex(default_block_size=BS, clock=clock or Clock())
    sessions = SessionTable()
    pool = Pool(config.replicas)
    for r in pool.replicas.values():
        pool.set_health(r, True)
        index.add_replica(r.name)
    picker = build_picker(policy, index, sessions, config)
    d = Dispatcher(config, pool, picker, index=index, sessions=sessions, timers=InlineTimers())
    return d, pool, index


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30_000, n, dtype=np.uint32)


def stored(toks: np.ndarray, medium: str | None = None, salt: str | None = None) -> EventBatch:
    n = len(toks) // BS
    extra = None if salt is None else ((salt,), *([None] * (n - 1)))
    ev = BlockStored(tuple(range(1, n + 1)), None, tuple(int(t) for t in toks[: n * BS]), BS, None, medium)
    if extra is not None:
        ev = BlockStored(ev.block_hashes, None, ev.token_ids, BS, None, medium, extra_keys=extra)
    return EventBatch(0.0, (ev,))


def state(pool: Pool, name: str) -> tuple[int, int, float]:
    s = pool.replicas[name].state
    return s.in_flight, s.pending, s.prefill_tokens


def test_a_ticket_counts_its_request_until_each_hook_settles_it() -> None:
    d, pool, index = make(speculative_ttl_s=0)
    toks = tokens(160)
    index.apply("b", stored(toks[:96]))  # 6 of its 10 blocks on b's GPU
    t = d.route(d.request(toks, session="s1"), pool.candidates())
    assert t.ranked[0] == "b"
    t.sent()
    assert state(pool, "b") == (1, 1, 64.0)  # the GPU blocks are free; 64 tokens to compute
    t.served("b", 200)
    assert d.sessions.get("s1") == "b"
    t.first_byte()
    t.first_byte()  # once
    assert state(pool, "b") == (1, 0, 0.0)
    t.finished()
    t.finished()  # idempotent
    assert state(pool, "b") == (0, 0, 0.0)


def test_a_failed_send_is_uncounted_and_the_next_replica_counts_it() -> None:
    d, pool, _ = make(speculative_ttl_s=0)
    t = d.route(d.request(tokens(64)), pool.candidates())
    first, second = t.ranked[:2]
    t.sent(first)
    t.failed()
    t.sent(second)
    assert state(pool, first) == (0, 0, 0.0) and state(pool, second) == (1, 1, 64.0)
    t.finished()  # without a first byte: the prefill work goes too
    assert state(pool, second) == (0, 0, 0.0)


def test_served_elsewhere_moves_the_count_and_an_error_records_no_session() -> None:
    d, pool, _ = make(speculative_ttl_s=0)
    t = d.route(d.request(tokens(64), session="s"), pool.candidates())
    primary = t.ranked[0]
    other = next(n for n in NAMES if n != primary)
    t.sent()
    t.served(other, 503)
    assert state(pool, primary)[0] == 0 and state(pool, other)[0] == 1
    assert d.sessions.get("s") is None  # an error answer is no affinity
    t.finished()
    assert all(state(pool, n) == (0, 0, 0.0) for n in NAMES)


def test_salted_requests_match_only_blocks_of_their_salt() -> None:
    d, _pool, index = make(speculative_ttl_s=0)
    toks = tokens(128)
    index.apply("c", stored(toks, salt="tenant"))
    for salt, holder in (("tenant", True), ("other", False), (None, False)):
        req = d.request(toks, salt=salt)
        d.match(req)
        assert ("c" in req.matches) is holder, salt  # type: ignore[operator]


def test_speculative_entries_get_an_expiry_timer() -> None:
    """Every speculative entry is followed by a timer that removes it when its ttl is up."""
    later: list[float] = []

    class Timers(InlineTimers):
        def later(self, delay_s: float, fn: object) -> None:
            later.append(delay_s)

    d, pool, index = make(speculative_ttl_s=0.5)
    d.timers = Timers()
    t = d.route(d.request(tokens(64)), pool.candidates())
    t.sent()
    assert index.stats()["speculative_blocks"] == 4
    assert later and 0.5 <= later[0] < 0.6


def test_prepare_refuses_unknown_models_and_bad_model_fields() -> None:
    d, _, _ = make(served_model_names=("tiny",))
    bad = asyncio.run(d.prepare({"model": 3}, b"", chat=False))
    unknown = asyncio.run(d.prepare({"model": "huge"}, b"", chat=False))
    assert isinstance(bad, Refusal) and (bad.status, bad.param) == (400, "model")
    assert isinstance(unknown, Refusal) and unknown.status == 404
    ok = asyncio.run(d.prepare({"model": "tiny", "cache_salt": "s"}, b"{}", chat=False))
    assert isinstance(ok, RoutingRequest) and not len(ok.tokens)  # no tokenizer: load and session


def test_the_cost_policys_own_tickets_ride_on_the_dispatchers_hooks() -> None:
    """policy cost keeps its own ledger: the dispatcher hands it each request where it is
    counted, the first byte of a stream (it learns the TTFT from it) and every request's end."""
    clock = Clock()
    d, pool, index = make("cost", clock=clock, speculative_ttl_s=0)
    model = d.picker.model  # type: ignore[attr-defined]
    model.clock = clock
    toks = tokens(128)
    index.apply("b", stored(toks[:64], "CPU"))
    streamed = d.route(d.request(toks), pool.candidates(), stream=True)
    streamed.sent()
    whole = d.route(d.request(tokens(96, seed=2)), pool.candidates())
    whole.sent()
    ledgers = {n: f["ledger"] for n, f in model.describe().items()}
    assert sum(led["pending"] for led in ledgers.values()) == 2
    clock.now += 0.25
    streamed.first_byte()
    whole.first_byte()  # the whole answer: its time is no TTFT, nothing is learned from it
    assert sum(f["observations"] for f in model.describe().values()) == 1
    streamed.finished()
    whole.finished()
    ledgers = {n: f["ledger"] for n, f in model.describe().items()}
    assert all(led["pending"] == 0 and led["in_flight"] == 0 for led in ledgers.values())
    assert all(state(pool, n) == (0, 0, 0.0) for n in NAMES)


def test_an_answering_request_keeps_no_per_candidate_arrays() -> None:
    """A ticket lives as long as its answer streams; once the first byte is in, its decision's
    per-candidate arrays and the request's candidates-by-media table are let go (a few hundred
    KB a request at 1,000 replicas), while the bookkeeping after it still works."""
    d, pool, index = make("cost", speculative_ttl_s=0)
    toks = tokens(128)
    index.apply("b", stored(toks[:64], "CPU"))
    t = d.route(d.request(toks, session="s"), pool.candidates(), stream=True)
    assert t.decision is not None and t.request.aligned is not None
    t.sent()
    t.served(t.ranked[0], 200)
    t.first_byte()
    assert t.decision is None and t.request.aligned is None
    assert t.request.matches  # the match stays: pd reads it after the prefill's first byte
    assert t.scores == {}
    t.finished()
    assert all(state(pool, n) == (0, 0, 0.0) for n in NAMES)
    assert d.sessions.get("s") == t.ranked[0]


def test_two_routers_fed_the_same_events_and_gauges_decide_alike() -> None:
    """Active-active: each router consumes every replica's events and reads shared load from
    the replicas' gauges; for the same state they pick the same replica."""
    routers = [make(speculative_ttl_s=0) for _ in range(2)]
    rng = np.random.default_rng(7)
    prompts = [tokens(int(rng.integers(32, 400)), seed=i) for i in range(40)]
    for i, p in enumerate(prompts[:20]):
        batch = stored(p, ("GPU", "CPU", None)[i % 3])
        for _, _, index in routers:
            index.apply(NAMES[i % 3], batch)
    for i, p in enumerate(prompts):
        waiting, running = float(i % 4), float(i % 3)
        for _, pool, _ in routers:
            r = pool.replicas[NAMES[i % 3]]
            pool.scraped(r, waiting, running, 0.25 * (i % 4))
        picks = [d.route(d.request(p, session=f"s{i}"), pool.candidates()).ranked for d, pool, _ in routers]
        assert picks[0] == picks[1], i


def test_work_queued_through_another_router_shows_in_the_gauges_and_steers_this_one() -> None:
    """Router B sent nothing to replica a; a's waiting gauge shows the four long prompts
    router A queued there, at B's mean prefill cost per request, so B does not send a
    follow-up that a holds half of into that queue (it would without the gauge)."""
    (a, pool_a, index_a), (b, pool_b, index_b) = make(speculative_ttl_s=0), make(speculative_ttl_s=0)
    req = tokens(300, seed=1)
    for index in (index_a, index_b):
        index.apply("a", stored(req[:160]))
    for i in range(3):  # both routers have seen requests of ~300 tokens
        for d, pool in ((a, pool_a), (b, pool_b)):
            t = d.route(d.request(tokens(300, seed=100 + i)), pool.candidates())
            t.sent("c")
            t.first_byte()
            t.finished()
    assert b.route(b.request(req), pool_b.candidates()).ranked[0] == "a"  # the holder, when idle
    for i in range(4):  # A sends four long prompts to a, not yet at their first byte
        a.route(a.request(tokens(300, seed=10 + i)), pool_a.candidates()).sent("a")
    for pool in (pool_a, pool_b):
        pool.scraped(pool.replicas["a"], 4.0, 0.0, None)
    assert pool_a.replicas["a"].state.external_prefill == 0.0  # A's own: counted once
    assert pool_b.replicas["a"].state.external_prefill == pytest.approx(1200.0)
    assert b.route(b.request(req), pool_b.candidates()).ranked[0] != "a"
    assert a.route(a.request(req), pool_a.candidates()).ranked[0] != "a"  # both alike
