"""The one percentile: q in 0..100, linear interpolation between closest ranks (NumPy's default)."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest

from kvmesh.bench.runner import percentile


def test_percentile_known_values() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]  # unsorted on purpose
    assert percentile(xs, 50) == statistics.median(xs)
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 5.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile(xs, 25) == 2.0
    assert percentile([2.0], 90) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile(iter([3.0, 1.0]), 100) == 3.0  # any iterable


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.uniform(-5, 5) for _ in range(n)]
        for q in (0, 1, 10, 33.3, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-12)


def test_percentile_is_monotone_in_q_and_within_range() -> None:
    rng = random.Random(3)
    xs = [rng.expovariate(1.0) for _ in range(37)]
    qs = [0, 5, 25, 50, 75, 90, 95, 100]
    got = [percentile(xs, q) for q in qs]
    assert got == sorted(got) and min(xs) == got[0] and max(xs) == got[-1]


def test_percentile_rejects_what_has_no_answer() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    for q in (-1, 100.5, 101):
        with pytest.raises(ValueError, match=r"0\.\.100"):
            percentile([1.0], q)
    with pytest.raises(ValueError, match="NaN"):
        percentile([1.0, math.nan], 50)


def test_replay_summary_p90_uses_it() -> None:
    from kvmesh.bench.common.workload import RunResult, Sample

    ttfts = [0.1 * i for i in range(1, 11)]
    result = RunResult([Sample(t, t, 100, 50, True) for t in ttfts], wall_s=2.0)
    summary = result.summary()
    assert summary["ttft_p90_s"] == round(percentile(ttfts, 90), 4) == 0.91
    assert summary["ttft_p50_s"] == 0.55 and summary["hit_rate"] == 0.5 and summary["requests_per_s"] == 5.0
