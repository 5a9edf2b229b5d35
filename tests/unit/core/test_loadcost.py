"""The engine never offers to load what it computes sooner (kvmesh.core.loadcost).

A slowed tier is the ``faulty://`` test tier with ``latency_s`` (a fault injector: it sleeps
in every call, as a tier behind a slow link would); the fast case is the same tier without
the delay. A real redis behind a latency proxy is exercised by ``bench router``'s slow-tier
case and tests/integration/test_slow_tier.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvmesh import CacheEngine, KVLayout
from kvmesh.core.loadcost import ComputeMeter, LoadCosts, TierMeter
from kvmesh.tiers.testing import FaultyTier, reset_memory_stores

LAYOUT = KVLayout(2, 2, 8, torch.float32)
CS = 16


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    reset_memory_stores()
    yield
    reset_memory_stores()


def _engines(tokens_per_s: float | None, **extra: object) -> tuple[CacheEngine, CacheEngine]:
    """A writer and a reader sharing one faulty:// remote; the reader keeps nothing in cpu
    (promote_on_hit off), so every lookup of the prompt is a remote hit."""
    store = f"faulty://t{uuid.uuid4().hex[:10]}"
    base = {"chunk_size": CS, "max_local_cpu_size": 0.001, "remote_url": store}
    writer = CacheEngine(base, layout=LAYOUT, model_id="m")
    reader = CacheEngine(
        {**base, "promote_on_hit": False, "prefill_tokens_per_s": tokens_per_s, **extra},
        layout=LAYOUT,
        model_id="m",
    )
    return writer, reader


def _store(engine: CacheEngine, tokens: list[int]) -> None:
    engine.store(tokens, torch.zeros(LAYOUT.shape(len(tokens))))
    assert engine.wait_for_writes(5.0)


def _remote(engine: CacheEngine) -> FaultyTier:
    tier = engine.lower["remote"]
    assert isinstance(tier, FaultyTier)
    return tier


def _measure(engine: CacheEngine, tokens: list[int], loads: int = 4) -> None:
    """``loads`` loads of 1, 2, ... chunks of ``tokens`` (sizes vary, as a real mix does)."""
    for i in range(loads):
        n = (i % (len(tokens) // CS) + 1) * CS
        with engine.retrieve_chunks(tokens[:n]) as chunks:
            assert chunks and chunks[-1].end == n


def test_a_slow_tier_is_not_offered_when_computing_is_faster() -> None:
    tokens = list(range(1, 4 * CS + 1))
    writer, reader = _engines(tokens_per_s=1e6)  # 64 tokens computed in 64 us
    with writer, reader:
        _store(writer, tokens)
        _remote(reader).latency_s = 0.01  # every call sleeps 10 ms: a load is one get of all its chunks
        assert reader.lookup(tokens) == len(tokens)  # not measured yet: loading is the default
        _measure(reader, tokens)
        figs = reader.cost_figures()["tiers"]["remote"]
        assert figs["loads"] == 4 and figs["load_seconds"] >= 4 * 0.01
        assert reader.lookup(tokens) == 0  # the slow tier's tokens are recomputed
        figs = reader.cost_figures()
        # cut after asking, or (slower per chunk than computing) not even asked
        assert figs["skipped_load_tokens"] == len(tokens) or figs["lookups_without_slow_tiers"] == 1


def test_a_load_asks_each_lower_tier_once_for_all_its_chunks() -> None:
    """A remote tier is asked once per load, not once per chunk: its client pipelines the
    batch, so a tier 200 ms away costs one round trip for a whole prompt."""
    tokens = list(range(1, 4 * CS + 1))
    writer, reader = _engines(tokens_per_s=None)
    with writer, reader:
        _store(writer, tokens)
        remote = _remote(reader)
        before = remote.calls
        with reader.retrieve_chunks(tokens) as chunks:
            assert [(c.start, c.end, c.tier) for c in chunks] == [
                (i * CS, (i + 1) * CS, "remote") for i in range(4)
            ]
        assert remote.calls - before == 1


def test_a_fetching_lookup_reads_the_remote_once_and_the_load_asks_it_nothing() -> None:
    """A lookup beside the steps (``fetch``) reads the chunks only the remote holds instead of
    asking whether it holds them: one call to the remote where a lookup and then a load took
    two (each a round trip to a far Redis). The chunks land in the cpu pool, pinned until the
    load, which reads them there; they still count as below the cpu tier (loaded beside the
    batch). A lookup that does not fetch asks, and its load reads: two calls."""
    tokens = list(range(1, 4 * CS + 1))
    writer, reader = _engines(tokens_per_s=None, promote_on_hit=True, max_local_cpu_size=0.01)
    with writer, reader:
        _store(writer, tokens)
        remote = _remote(reader)
        before = remote.calls
        assert reader.lookup_held(tokens, pin=True, fetch=True) == (len(tokens), True)
        assert remote.calls - before == 1
        assert reader.stats()["cpu"]["pinned"] == 4
        with reader.retrieve_chunks(tokens) as chunks:
            assert [(c.start, c.end, c.tier) for c in chunks] == [
                (i * CS, (i + 1) * CS, "cpu") for i in range(4)
            ]
        assert remote.calls - before == 1
        reader.unpin(tokens)
        assert reader.stats()["cpu"]["pinned"] == 0
        assert reader.cost_figures()["tiers"]["remote"]["loads"] == 1  # the read is measured

        reader.clear("cpu")
        before = remote.calls
        assert reader.lookup_held(tokens) == (len(tokens), True)  # asks: the data stays there
        with reader.retrieve_chunks(tokens) as chunks:
            assert [c.tier for c in chunks] == ["remote"] * 4
        assert remote.calls - before == 2


def test_a_corrupt_chunk_read_by_a_fetching_lookup_is_never_offered() -> None:
    """The fetching lookup reads through the same checks as a load: the chunk whose stored
    bytes were altered is a miss (counted, deleted), and the offer stops before it."""
    tokens = list(range(1, 4 * CS + 1))
    writer, reader = _engines(tokens_per_s=None, promote_on_hit=True, max_local_cpu_size=0.01)
    with writer, reader:
        _store(writer, tokens[: 2 * CS])
        _remote(writer).corrupt_next = True  # the third chunk's stored bytes are altered
        _store(writer, tokens)
        assert reader.lookup_held(tokens, pin=True, fetch=True) == (2 * CS, True)
        assert reader.stats()["remote"]["corrupt"] == 1
        reader.unpin(tokens[: 2 * CS])
        assert reader.stats()["cpu"]["pinned"] == 0


def test_chunks_a_fetching_lookup_reads_past_a_gap_do_not_make_the_load_lower() -> None:
    """Two chunks in the cpu pool, the third in no tier, the fourth in the remote: the fetch
    reads the third and fourth, the offer stops at the gap, and what is offered is all in
    the cpu pool (a load within the step), not below it."""
    tokens = list(range(1, 4 * CS + 1))
    writer, reader = _engines(tokens_per_s=None, promote_on_hit=True, max_local_cpu_size=0.01)
    with writer, reader:
        _store(writer, tokens)
        with reader.retrieve_chunks(tokens[: 2 * CS]) as chunks:  # promoted into the cpu pool
            assert [c.tier for c in chunks] == ["remote", "remote"]
        _remote(reader).delete([reader.keys.keys(tokens)[2]])
        assert reader.lookup_held(tokens, pin=True, fetch=True) == (2 * CS, False)
        reader.unpin(tokens[: 2 * CS])
        assert reader.stats()["cpu"]["pinned"] == 0


def test_a_fetching_lookup_reads_only_what_the_cost_model_would_load() -> None:
    """A remote measured slower per chunk than computing: a fetching lookup reads none of it
    (the same cut a lookup that asks would make), and the hit is zero."""
    tokens = list(range(1, 4 * CS + 1))
    writer, reader = _engines(tokens_per_s=1e6, promote_on_hit=True, max_local_cpu_size=0.01)
    with writer, reader:
        _store(writer, tokens)
        remote = _remote(reader)
        remote.latency_s = 0.01
        _measure(reader, tokens)
        reader.clear("cpu")
        before, reads = remote.calls, reader.cost_figures()["tiers"]["remote"]["loads"]
        assert reader.lookup_held(tokens, pin=True, fetch=True) == (0, False)
        assert reader.cost_figures()["tiers"]["remote"]["loads"] == reads  # nothing read
        assert remote.calls - before <= 1  # asked at most whether it holds the first chunk
        assert reader.stats()["cpu"]["pinned"] == 0


def test_a_load_beside_a_running_batch_is_weighed_against_the_stall_it_saves() -> None:
    """A load 2x slower than recomputing: cut when it would run inside the step or nothing
    runs; offered when it runs beside a batch of 4, whose every request would wait for the
    recompute (weight 1 + 4)."""
    tokens = list(range(1, 4 * CS + 1))
    writer, reader = _engines(tokens_per_s=4 * CS / 0.02)  # the prompt computes in 20 ms
    with writer, reader:
        _store(writer, tokens)
        _remote(reader).latency_s = 0.04  # a load (one get) takes 40 ms
        _measure(reader, tokens)
        costs = reader.costs
        assert reader.lookup(tokens) == 0  # synchronous loads (the default of a bare engine)
        costs.loads_beside_batch, costs.batch = True, 0
        assert reader.lookup(tokens) == 0  # beside the batch, but nothing else runs
        costs.batch = 4
        assert reader.lookup(tokens) == len(tokens)  # 40 ms for one request < 5 x 20 ms of stall
        costs.loads_beside_batch = False
        assert reader.lookup(tokens) == 0  # inside the step the load stalls the batch as well


def test_a_fast_tier_is_offered() -> None:
    tokens = list(range(1, 4 * CS + 1))
    writer, reader = _engines(tokens_per_s=50.0)  # 64 tokens take 1.3 s to compute
    with writer, reader:
        _store(writer, tokens)
        _measure(reader, tokens)
        assert reader.lookup(tokens) == len(tokens)
        assert reader.cost_figures()["skipped_loads"] == 0


def test_the_cut_keeps_a_fast_tier_prefix_before_a_slow_tier() -> None:
    """cpu chunks first, then remote chunks: the cpu prefix is offered, the remote rest is not."""
    tokens = list(range(1, 4 * CS + 1))
    writer, reader = _engines(tokens_per_s=1e6)
    with writer, reader:
        _store(writer, tokens)
        _remote(reader).latency_s = 0.01
        _measure(reader, tokens)
        reader.store(tokens[: 2 * CS], torch.zeros(LAYOUT.shape(2 * CS)))  # two chunks in cpu
        assert reader.lookup(tokens) == 2 * CS


def test_without_a_prefill_rate_everything_found_is_offered() -> None:
    tokens = list(range(1, 4 * CS + 1))
    writer, reader = _engines(tokens_per_s=None)
    with writer, reader:
        _store(writer, tokens)
        _remote(reader).latency_s = 0.01
        _measure(reader, tokens)
        assert reader.lookup(tokens) == len(tokens)  # no rate learned: no guess


def test_the_rule_can_be_turned_off() -> None:
    tokens = list(range(1, 4 * CS + 1))
    writer, reader = _engines(tokens_per_s=1e6, skip_slow_loads=False)
    with writer, reader:
        _store(writer, tokens)
        _remote(reader).latency_s = 0.01
        _measure(reader, tokens)
        assert reader.lookup(tokens) == len(tokens)


def test_a_skipped_tier_is_probed_again() -> None:
    costs = LoadCosts(bytes_per_token=1000, tokens_per_s=1e6, probe_s=0.05)
    for _ in range(5):
        costs.observe_load("remote", 64_000, 0.05)
    where, bounds = ["remote"] * 4, [(i * 16, (i + 1) * 16) for i in range(4)]
    assert costs.cut(where, bounds) == 0  # just measured: no probe
    time.sleep(0.06)
    assert costs.cut(where, bounds) == 1  # probe_s later: one chunk tried again, to see it recover
    assert costs.cut(where, bounds) == 0


def test_the_prefill_rate_is_learned_from_steps() -> None:
    meter = ComputeMeter()
    rng = np.random.default_rng(0)
    assert meter.seconds_per_token() is None
    for _ in range(200):
        tokens = int(rng.integers(1, 4096))
        reqs = int(rng.integers(1, 32))
        meter.observe(tokens, reqs, (0.004 + tokens / 20_000 + reqs * 1e-4) * rng.lognormal(0, 0.05))
    spt = meter.seconds_per_token()
    # Seconds per token with the step's fixed cost in it: never below the true marginal cost
    # (that would switch loads off), a little above it (loads are favoured).
    assert spt is not None and 0.97 <= spt * 20_000 < 1.2
    assert ComputeMeter(1234.0).seconds_per_token() == pytest.approx(1 / 1234.0)


def test_the_prefill_rate_is_the_median_of_the_window_and_follows_each_step() -> None:
    """The median is kept between steps (every lookup asks for it) and taken afresh once a
    step is observed: the window's median, as numpy computes it."""
    meter = ComputeMeter()
    rng = np.random.default_rng(1)
    seen: list[float] = []
    for i in range(150):
        tokens = int(rng.integers(64, 4096))
        seconds = float(rng.uniform(0.001, 0.5))
        meter.observe(tokens, 1, seconds)
        seen.append(seconds / tokens)
        if i >= 3:
            want = float(np.median(seen[-64:]))
            assert meter.seconds_per_token() == pytest.approx(want, rel=1e-12)
            assert meter.seconds_per_token() == pytest.approx(want, rel=1e-12)  # asked twice


def test_two_step_sizes_do_not_switch_the_cpu_tier_off() -> None:
    """Found by kvmesh bench ttft: every step was a 1,000-token prompt or its 104-token reload
    tail; a fitted slope collapsed to its bound and every cpu hit was cut from then on."""
    costs = LoadCosts(bytes_per_token=8192)
    for i in range(40):
        tokens, seconds = (1000, 0.25) if i % 2 else (104, 0.045)
        costs.observe_step(tokens, 1, seconds)
    for n in (1, 4, 7):
        costs.observe_load("cpu", n * 128 * 8192, 0.0005 + n * 0.0004)
    spt = costs.compute.seconds_per_token()
    assert spt is not None and spt >= 0.25 / 1000 * 0.9
    bounds = [(i * 128, (i + 1) * 128) for i in range(7)]
    assert costs.cut(["cpu"] * 7, bounds) == 7
    assert costs.cut(["cpu"] * 3 + ["disk"] * 4, bounds) == 7  # an unmeasured disk: loaded too


def test_cpu_hits_are_never_cut_even_with_an_absurd_prefill_rate() -> None:
    costs = LoadCosts(bytes_per_token=8192, tokens_per_s=1e9)
    for n in (1, 2, 3):
        costs.observe_load("cpu", n * 1 << 20, 0.01 * n)
    assert costs.cut(["cpu"] * 4, [(i * 128, (i + 1) * 128) for i in range(4)]) == 4


def test_a_tier_meter_separates_latency_from_bandwidth() -> None:
    meter = TierMeter()
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 64)) * 65_536
        meter.observe(n, (0.003 + n / 2e9) * rng.lognormal(0, 0.03), 0.0)
    fig = meter.figures()
    assert fig["load_latency_s"] == pytest.approx(0.003, rel=0.15)
    assert fig["load_bytes_per_s"] == pytest.approx(2e9, rel=0.15)


def test_loads_of_one_size_take_their_time_as_round_trip_not_transfer() -> None:
    """A far tier seen only through small loads (0.74 MB in 0.2 s, nearly all round trip):
    a 12 MB load is predicted near one round trip, not 16x the small one's transfer (the
    half-and-half first split predicted 1.7 s, and the tier was skipped)."""
    meter = TierMeter()
    for _ in range(4):
        meter.observe(737_280, 0.2, 0.0)
    assert meter.predict(737_280) == pytest.approx(0.2, rel=0.05)
    assert meter.predict(12_000_000) < 0.3
    for _ in range(20):  # then loads of another size show the real bandwidth
        meter.observe(12_000_000, 0.2 + 12_000_000 / 50e6, 0.0)
        meter.observe(737_280, 0.2 + 737_280 / 50e6, 0.0)
    assert meter.predict(24_000_000) == pytest.approx(0.2 + 24_000_000 / 50e6, rel=0.1)


def test_a_tier_slower_per_chunk_than_computing_is_not_even_asked() -> None:
    """Its contains() is a round trip on every request's path: skipped until the next probe.
    The loads are fed to the meter as measured (10 ms per chunk: slow per byte, not only per
    call; a tier slow only per call is worth loading for a long enough prefix, below)."""
    tokens = list(range(1, 4 * CS + 1))
    writer, reader = _engines(tokens_per_s=1e6)
    with writer, reader:
        _store(writer, tokens)
        remote = _remote(reader)
        remote.latency_s = 0.01
        chunk_bytes = CS * reader.layout.bytes_per_token
        for n in (1, 2, 3, 4):
            reader.costs.observe_load("remote", n * chunk_bytes, 0.01 * n)
        assert reader.costs.hopeless(["remote"], CS) == frozenset({"remote"})
        remote.down = True  # were it asked, the call would raise (and count an error)
        assert reader.lookup(tokens) == 0
        assert reader.metrics["remote"].counters["errors"] == 0
        remote.down = False
        reader.costs._probed["remote"] = 0.0  # the probe is due
        reader.costs.tiers["remote"].last_at = 0.0
        assert reader.lookup(tokens) == CS  # asked again, and one chunk of it loaded
        assert reader.costs.hopeless(["remote"], CS) == frozenset({"remote"})


def test_a_tier_worth_it_for_long_prefixes_is_still_asked() -> None:
    costs = LoadCosts(bytes_per_token=1000, tokens_per_s=1000.0)  # 16 ms per 16-token chunk
    for n in (1, 2, 4, 8):  # 50 ms latency, then 1 ms per chunk
        costs.observe_load("remote", n * 16_000, 0.05 + 0.001 * n)
    assert costs.hopeless(["remote"], 16) == frozenset()
    where, bounds = ["remote"] * 8, [(i * 16, (i + 1) * 16) for i in range(8)]
    assert costs.cut(where[:2], bounds[:2]) == 0  # 2 chunks: 52 ms to load, 32 ms to compute
    assert costs.cut(where, bounds) == 8  # 8 chunks: 58 ms to load, 128 ms to compute


def test_predict_s_sums_the_reads_and_copies_a_cut_weighs() -> None:
    costs = LoadCosts(bytes_per_token=1000)
    bounds = [(0, 1000), (1000, 2000)]
    assert costs.predict_s(["cpu", "cpu"], bounds) == 0.0  # nothing measured: no copy figure
    assert costs.predict_s(["disk", "disk"], bounds) is None  # a tier with no figure: unknown
    for _ in range(6):  # 10 ms of latency, 1 MB per 10 ms
        costs.observe_load("disk", 1_000_000, 0.02)
        costs.observe_load("disk", 2_000_000, 0.03)
    got = costs.predict_s(["disk", "disk"], bounds)
    # the tier's latency once, then its bytes: one 2 MB load as the meter fits it (~30 ms)
    assert got == pytest.approx(costs.tiers["disk"].predict(2_000_000)) and 0.02 < got < 0.04
    costs.observe_load("cpu", 2_000_000, 0.001)  # a copy figure: added per chunk
    for _ in range(3):
        costs.observe_load("cpu", 2_000_000, 0.001)
    with_copy = costs.predict_s(["disk", "disk"], bounds)
    assert with_copy == pytest.approx(got + costs.tiers["cpu"].predict(2_000_000))
    assert costs.predict_s(["disk", "remote"], bounds) is None


def test_a_lookup_reports_its_loads_predicted_seconds() -> None:
    tokens = list(range(1, 4 * CS + 1))
    writer, reader = _engines(tokens_per_s=50.0)
    with writer, reader:
        _store(writer, tokens)
        assert reader.lookup_detail(tokens).expect_s is None  # the remote has no figure yet
        _measure(reader, tokens)
        held = reader.lookup_detail(tokens)
        assert held.tokens == len(tokens) and held.below
        want = reader.costs.predict_s(["remote"] * 4, [(i * CS, (i + 1) * CS) for i in range(4)])
        assert want is not None and held.expect_s == pytest.approx(want)
