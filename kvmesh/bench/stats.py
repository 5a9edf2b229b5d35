"""The statistics every benchmark reports with, so their figures mean the same thing."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile, ``q`` in 0..100, interpolated linearly between the two
    closest ranks of the sorted values (NumPy's default ``method="linear"``; ``q=50`` is the
    median). ``values`` need not be sorted. Raises ValueError for no values, a ``q``
    outside 0..100 or a NaN among the values (a NaN has no rank)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if any(math.isnan(x) for x in xs):
        raise ValueError("percentile of values that include NaN")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
