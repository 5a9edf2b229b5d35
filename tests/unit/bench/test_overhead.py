"""The router overhead benchmark: streaming, a live index, realistic text (real router and
fake-vLLM processes; a small run)."""

from __future__ import annotations

import pytest

from kvmesh.bench.router.overhead import measure


@pytest.mark.slow
def test_measures_streamed_first_chunk_with_a_live_index() -> None:
    out = measure(None, tokens=300, n=8, warmup=2, index_blocks=2000, event_rate=20)
    assert set(out["shapes"]) == {"completion-unique", "chat-shared-system"}
    for s in out["shapes"].values():
        assert s["routed_ttft_ms_p50"] > 0 and s["direct_ttft_ms_p50"] > 0
        assert 150 <= s["prompt_tokens"] <= 600
    assert out["index_after"]["blocks"] >= 2000  # the router's index took the events
