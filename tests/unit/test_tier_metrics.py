"""Tier counters: a skipped store is always counted with its reason."""

from __future__ import annotations

import pytest

from kvmesh.metrics import TierMetrics


def test_a_skipped_store_is_counted_with_its_reason_and_only_so() -> None:
    m = TierMetrics("remote")
    m.skip("full", 2)
    m.skip("tier_down")
    snap = m.snapshot()
    assert snap["skipped_stores"] == 3
    assert snap["skipped_by_reason"] == {"full": 2, "tier_down": 1}
    with pytest.raises(ValueError, match="skip"):
        m.inc("skipped_stores")  # a count without a reason is a bug in the tier
    assert m.snapshot()["skipped_stores"] == 3
