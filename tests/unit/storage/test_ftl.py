"""The FTL simulator against what is known: greedy GC's closed form under uniform random
writes (within 5%), DLWA = 1 for sequential overwrites, trims, FDP stream separation,
GC stalls in the latency model, and its speed (>= 1M page writes/s)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvmesh.errors import ConfigError
from kvmesh.storage import ftl
from kvmesh.storage.trace import OP_TRIM, OP_WRITE

PAGES = 1 << 16


def _window_dlwa(res: ftl.FTLResult, warm: int) -> float:
    return 1 + res.gc_copies_per_request[warm:].sum() / (len(res.gc_copies_per_request) - warm)


def test_lambert_w() -> None:
    for x in (-1 / math.e, -0.3, -0.1, -1e-6, 0.0):
        w = ftl.lambert_w0(x)
        assert w * math.exp(w) == pytest.approx(x, abs=1e-12)
    with pytest.raises(ValueError):
        ftl.lambert_w0(-1.0)


@pytest.mark.parametrize("op", [0.07, 0.15, 0.28, 0.5])
def test_greedy_matches_closed_form_within_5pct(op: float) -> None:
    cfg = ftl.FTLConfig(logical_pages=PAGES, overprovisioning=op, pages_per_block=128)
    ops, lp, npg = ftl.uniform_random(cfg, passes=4, seed=1)
    res = ftl.simulate(cfg, ops, lp, npg)
    sim, want = _window_dlwa(res, 2 * PAGES), ftl.greedy_wa_closed_form(op)
    assert abs(sim / want - 1) <= 0.05, (sim, want)


def test_sequential_overwrite_has_no_gc_copies() -> None:
    cfg = ftl.FTLConfig(logical_pages=PAGES, overprovisioning=0.07)
    lp = np.tile(np.arange(PAGES), 5)
    res = ftl.simulate(cfg, np.zeros(len(lp), np.int8), lp, np.ones(len(lp), np.int64))
    assert res.gc_copies == 0 and res.dlwa == 1.0
    assert res.erases_per_block.sum() > 0  # blocks were reclaimed, just never copied from


def test_multi_page_requests_equal_single_pages() -> None:
    cfg = ftl.FTLConfig(logical_pages=PAGES, overprovisioning=0.1)
    rng = np.random.default_rng(3)
    starts = rng.integers(0, PAGES // 8, 4 * PAGES // 8) * 8
    a = ftl.simulate(cfg, np.zeros(len(starts), np.int8), starts, np.full(len(starts), 8))
    singles = (starts[:, None] + np.arange(8)).ravel()
    b = ftl.simulate(cfg, np.zeros(len(singles), np.int8), singles, np.ones(len(singles), np.int64))
    assert a.gc_copies == b.gc_copies and a.host_pages == b.host_pages


def test_trims_remove_gc_work() -> None:
    """Writing a region then trimming it before it is rewritten: the drive never copies it."""
    cfg = ftl.FTLConfig(logical_pages=PAGES, overprovisioning=0.07)
    rng = np.random.default_rng(4)
    n = 8 * PAGES // 64
    starts = rng.integers(0, PAGES // 64, n) * 64
    ops = np.tile(np.array([OP_WRITE, OP_TRIM], np.int8), n)
    lps = np.repeat(starts, 2)
    with_trim = ftl.simulate(cfg, ops, lps, np.full(2 * n, 64))
    without = ftl.simulate(cfg, np.zeros(n, np.int8), starts, np.full(n, 64))
    assert with_trim.dlwa == 1.0 and with_trim.dlwa <= without.dlwa


def test_fdp_streams_separate_lifetimes() -> None:
    """Hot random overwrites mixed with a cold sequential stream: one stream mixes them in
    every block (GC copies the cold data again and again); two streams do not."""
    pages = 1 << 15
    hot = pages // 8
    rng = np.random.default_rng(5)
    n = 6 * pages
    is_cold = rng.random(n) < 0.5
    lp = np.where(is_cold, hot + (np.arange(n) % (pages - hot)), rng.integers(0, hot, n))
    st = is_cold.astype(np.int64)
    kw = {"logical_pages": pages, "overprovisioning": 0.1, "pages_per_block": 64}
    one = ftl.simulate(ftl.FTLConfig(**kw), np.zeros(n, np.int8), lp, np.ones(n, np.int64))  # type: ignore[arg-type]
    two = ftl.simulate(ftl.FTLConfig(streams=2, **kw), np.zeros(n, np.int8), lp, np.ones(n, np.int64), st)  # type: ignore[arg-type]
    assert two.dlwa < 0.8 * one.dlwa, (one.dlwa, two.dlwa)


def test_cost_benefit_runs_and_beats_greedy_on_skew() -> None:
    pages = 1 << 15
    rng = np.random.default_rng(6)
    n = 6 * pages
    hot = rng.random(n) < 0.9  # 90% of writes to 10% of the space
    lp = np.where(hot, rng.integers(0, pages // 10, n), rng.integers(pages // 10, pages, n))
    base = {"logical_pages": pages, "overprovisioning": 0.1, "pages_per_block": 64}
    seq = np.concatenate([np.arange(pages), lp])
    ops, npg = np.zeros(len(seq), np.int8), np.ones(len(seq), np.int64)
    g = ftl.simulate(ftl.FTLConfig(gc="greedy", **base), ops, seq, npg)  # type: ignore[arg-type]
    cb = ftl.simulate(ftl.FTLConfig(gc="cost-benefit", **base), ops, seq, npg)  # type: ignore[arg-type]
    assert cb.gc_copies > 0 and cb.dlwa < g.dlwa * 1.05


def test_latency_model_shows_gc_stalls() -> None:
    cfg = ftl.FTLConfig(logical_pages=PAGES, overprovisioning=0.07, pages_per_block=64)
    ops, lp, npg = ftl.uniform_random(cfg, passes=2, seed=7)
    arrival = np.arange(len(lp)) * 1e-3  # one page per ms: an idle device but for GC
    res = ftl.simulate(cfg, ops, lp, npg, arrival_s=arrival)
    lat = res.latency_s[PAGES:]
    t_page = cfg.t_prog_us * 1e-6 / cfg.parallelism
    assert np.median(res.latency_s[: PAGES // 2]) == pytest.approx(t_page)
    assert np.percentile(lat, 99.9) > 10 * t_page  # requests that triggered GC waited for it
    s = res.summary()
    assert s["write_p99_ms"] >= s["write_p50_ms"] > 0


def test_speed_at_least_1m_page_writes_per_second() -> None:
    cfg = ftl.FTLConfig(logical_pages=1 << 18, overprovisioning=0.28, pages_per_block=256)
    ops, lp, npg = ftl.uniform_random(cfg, passes=3, seed=8)
    ftl.simulate(cfg, ops[:1000], lp[:1000], npg[:1000])  # compile (cached on disk after the first run)
    res = ftl.simulate(cfg, ops, lp, npg)
    assert res.host_pages / res.seconds >= 1e6, res.host_pages / res.seconds


def test_bad_geometry_and_addresses() -> None:
    with pytest.raises(ConfigError, match="gc"):
        ftl.FTLConfig(logical_pages=PAGES, gc="random")
    with pytest.raises(ConfigError, match="too few"):
        ftl.FTLConfig(logical_pages=64, pages_per_block=64)
    cfg = ftl.FTLConfig(logical_pages=PAGES)
    with pytest.raises(ConfigError, match="logical pages"):
        ftl.simulate(cfg, np.zeros(1, np.int8), np.array([PAGES]), np.ones(1, np.int64))
    with pytest.raises(ConfigError, match="stream"):
        ftl.simulate(cfg, np.zeros(1, np.int8), np.zeros(1), np.ones(1, np.int64), np.array([1]))


def test_a_drive_too_full_for_its_streams_is_an_error_not_a_hang() -> None:
    cfg = ftl.FTLConfig(logical_pages=64 * 40, overprovisioning=0.05, pages_per_block=64, streams=6)
    lp = np.tile(np.arange(cfg.logical_pages), 3)
    st = (lp // 64) % 6  # every stream gets whole blocks; the open ones hold the spare
    with pytest.raises(ConfigError, match="ran out of reclaimable space"):
        ftl.simulate(cfg, np.zeros(len(lp), np.int8), lp, np.ones(len(lp), np.int64), st)
