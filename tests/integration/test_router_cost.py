"""``policy: cost`` end to end over real loopback HTTP: the router in front of two fake vLLM
servers that "prefill" one prompt at a time at different rates (FakeVLLM's
``prefill_s_per_word``: a queue with a rate, which is all the model assumes), and a real
CacheEngine's admin API as a replica's source of measured figures. Fakes stand in for vLLM
here because the test needs replicas whose true rates are known; the real-vLLM path is
``kvmesh bench router``'s cost rows."""

from __future__ import annotations

import concurrent.futures
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from kvmesh import CacheEngine, KVLayout
from kvmesh.admin.server import AdminServer
from kvmesh.router.server import Router
from kvmesh.router.testing import _WORDS, FakeVLLM
from kvmesh.routing.config import ReplicaConfig
from kvmesh.tiers.testing import reset_memory_stores
from tests.integration.test_router_http import fakes, make_router
from tests.waiting import wait_for

MakeRouter = Callable[..., Router]
__all__ = ["fakes", "make_router"]  # the router tests' fixtures, used here too


def words(rng: np.random.Generator, n: int) -> str:
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), n))


def stream(client: httpx.Client, url: str, prompt: str) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "stream": True}
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        replica = resp.headers["x-kvmesh-replica"]
        for _ in resp.iter_bytes():
            pass
    return replica


def test_the_cost_policy_learns_each_replicas_rate_and_shows_it(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM]
) -> None:
    fakes["a"].prefill_s_per_word = 0.0002  # 'a' prefills 5x faster than 'b'
    fakes["b"].prefill_s_per_word = 0.001
    router = make_router(policy="cost")
    rng = np.random.default_rng(0)
    prompts = [words(rng, int(rng.integers(30, 400))) for _ in range(120)]
    with httpx.Client(timeout=30) as client, concurrent.futures.ThreadPoolExecutor(3) as pool:
        went = list(pool.map(lambda p: stream(client, router.url, p), prompts))
        state = client.get(router.url + "/kvmesh/state").json()
        records = client.get(router.url + "/kvmesh/cost/records").json()["records"]
        metrics = client.get(router.url + "/metrics").text
    assert state["policy"] == "cost"
    fitted = state["cost"]["replicas"]
    assert fitted["a"]["observations"] + fitted["b"]["observations"] == len(prompts)
    assert fitted["a"]["prefill_tokens_per_s"] > 2 * fitted["b"]["prefill_tokens_per_s"]
    assert went.count("a") > went.count("b")  # the faster replica takes more, not all
    assert fitted["a"]["ledger"]["pending"] == 0 and fitted["b"]["ledger"]["in_flight"] == 0
    assert len(records) == len(prompts)
    errors = [abs(r["predicted_s"] - r["observed_s"]) / r["observed_s"] for r in records[50:]]
    assert float(np.median(errors)) <= 0.25
    assert "kvmesh_router_ttft_prediction_error_ratio_bucket" in metrics
    assert 'kvmesh_router_predicted_ttft_seconds{replica="a"}' in metrics
    assert "kvmesh_router_fleet_predicted_ttft_seconds " in metrics


KVMESH_GAUGES = """\
kvmesh:kv_bytes_per_token{engine="0",model_name="tiny"} 4096.0
kvmesh:prefill_tokens_per_second{engine="0",model_name="tiny"} 12345.0
kvmesh:tier_load_bytes_per_second{engine="0",model_name="tiny",tier="remote"} 2.0e8
kvmesh:tier_load_latency_seconds{engine="0",model_name="tiny",tier="remote"} 0.004
kvmesh:tier_bytes_used{engine="0",model_name="tiny",tier="cpu"} 256.0
kvmesh:tier_capacity_bytes{engine="0",model_name="tiny",tier="cpu"} 1024.0
"""


def test_kvmesh_gauges_on_vllm_metrics_are_read_and_bounded(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM]
) -> None:
    fakes["a"].extra_metrics = KVMESH_GAUGES
    fakes[
        "b"
    ].extra_metrics = 'kvmesh:tier_load_bytes_per_second{tier="remote"} -5\nkvmesh:kv_bytes_per_token 1e30\n'
    router = make_router(policy="cost")
    url = router.url + "/kvmesh/state"

    def cost() -> dict[str, Any]:
        return dict(httpx.get(url, timeout=5).json()["cost"])

    wait_for(lambda: (cost()["replicas"].get("a") or {}).get("report") is not None)
    a = cost()["replicas"]["a"]
    assert a["report"]["source"] == "metrics" and a["report"]["prefill_tokens_per_s"] == 12345.0
    assert a["prefill_tokens_per_s"] == pytest.approx(12345.0, rel=0.05)  # the prior, before any request
    remote = a["media"]["REMOTE"]
    assert remote["load_bytes_per_s"] == pytest.approx(2.0e8, rel=0.2)
    assert cost()["kv_usage"]["a"]["cpu"] == 0.25
    wait_for(lambda: bool(cost()["replicas"]["b"]["rejected_inputs"]))
    b = cost()["replicas"]["b"]
    assert set(b["rejected_inputs"]) == {
        "remote.load_bytes_per_s: out of range",
        "bytes_per_token: out of range",
    }
    assert b["media"]["REMOTE"]["load_tokens_per_s"] < 5_000  # never free: costed like recomputing


def test_the_router_polls_a_replicas_admin_api_for_its_measured_costs(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM]
) -> None:
    reset_memory_stores()
    layout = KVLayout(2, 2, 8, torch.float32)
    cfg = {"chunk_size": 16, "max_local_cpu_size": 0.001, "remote_url": f"faulty://{uuid.uuid4().hex[:8]}"}
    with CacheEngine(cfg, layout=layout, model_id="m") as engine, AdminServer(engine, token="t0k") as admin:
        tokens = list(range(1, 65))
        engine.store(tokens, torch.zeros(layout.shape(64)))
        assert engine.wait_for_writes(5)
        engine.clear("cpu")
        for _ in range(4):
            with engine.retrieve_chunks(tokens):
                engine.clear("cpu")
        replicas = [
            ReplicaConfig(url=fakes["a"].url, name="a", admin=admin.url),
            ReplicaConfig(url=fakes["b"].url, name="b"),
        ]
        router = make_router(
            policy="cost", replicas=replicas, controller={"token": "t0k"}, cost={"report_interval_s": 0.1}
        )
        url = router.url + "/kvmesh/state"
        wait_for(lambda: (httpx.get(url).json()["cost"]["replicas"].get("a") or {}).get("report") is not None)
        a = httpx.get(url).json()["cost"]["replicas"]["a"]
    reset_memory_stores()
    assert a["report"]["source"] == "admin"
    assert a["report"]["bytes_per_token"] == layout.bytes_per_token
    assert a["report"]["media"]["REMOTE"]["loads"] >= 4
