"""A replica's measured costs leave it: vLLM's connector-stats path (prom.py), the step clock
(stepclock.py), and the engine's Prometheus collector."""

from __future__ import annotations

import functools
import time

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvmesh import CacheEngine, KVLayout
from kvmesh.core.loadcost import LoadCosts
from kvmesh.integrations.vllm.prom import KVMeshPromMetrics, KVMeshStats, StatsGate
from kvmesh.integrations.vllm.stepclock import StepClock

LAYOUT = KVLayout(2, 2, 8, torch.float32)


def _engine() -> CacheEngine:
    return CacheEngine({"chunk_size": 16, "max_local_cpu_size": 0.001}, layout=LAYOUT, model_id="m")


def test_stats_gate_hands_figures_at_most_once_per_interval() -> None:
    with _engine() as engine:
        gate = StatsGate(engine.cost_figures, interval_s=60.0)
        first = gate.take()
        assert first is not None and first.data["figures"]["bytes_per_token"] == LAYOUT.bytes_per_token
        assert gate.take() is None


def test_stats_aggregate_keeps_the_newest() -> None:
    old = KVMeshStats(data={"at": 1.0, "figures": {"bytes_per_token": 1}})
    new = KVMeshStats(data={"at": 2.0, "figures": {"bytes_per_token": 2}})
    assert old.aggregate(new).data["figures"]["bytes_per_token"] == 2
    assert new.aggregate(KVMeshStats(data={"at": 0.5, "figures": {}})).data["at"] == 2.0
    assert KVMeshStats(data={}).is_empty()


def test_prom_metrics_render_kvmesh_gauges_beside_vllms_labels() -> None:
    reg = CollectorRegistry()
    types = {Gauge: functools.partial(Gauge, registry=reg), Counter: Counter, Histogram: Histogram}

    class Cfg:
        kv_transfer_config = None

    prom = KVMeshPromMetrics(Cfg(), types, ["model_name", "engine"], {0: ["tiny", "0"]})
    figures = {
        "bytes_per_token": 4096,
        "prefill_tokens_per_s": 7500.0,
        "skipped_load_tokens": 256,
        "tiers": {"remote": {"load_bytes_per_s": 2.5e8, "load_latency_s": 0.004}},
        "use": {"cpu": {"bytes_used": 1024.0, "capacity_bytes": 4096.0}, "remote": {"bytes_used": 0.0}},
    }
    prom.observe({"at": 1.0, "figures": figures}, 0)
    text = generate_latest(reg).decode()
    assert 'kvmesh:tier_load_bytes_per_second{engine="0",model_name="tiny",tier="remote"} 2.5e+08' in text
    assert 'kvmesh:tier_capacity_bytes{engine="0",model_name="tiny",tier="cpu"} 4096.0' in text
    assert 'kvmesh:prefill_tokens_per_second{engine="0",model_name="tiny"} 7500.0' in text
    assert 'kvmesh:kv_bytes_per_token{engine="0",model_name="tiny"} 4096.0' in text
    prom.observe({"figures": "garbage"}, 0)  # ignored, not raised
    prom.observe({"at": 2.0, "figures": figures}, 7)  # an engine vLLM never labelled: ignored


def test_step_clock_teaches_the_engine_its_prefill_rate_on_cpu() -> None:
    costs = LoadCosts(bytes_per_token=4096)
    clock = StepClock(costs, torch.device("cpu"))
    for tokens in (256, 512, 1024, 2048, 128, 64, 4096, 300, 900, 1500):
        clock.begin(tokens, 2)
        time.sleep(tokens / 200_000)  # a "forward" at 200k tokens/s
        clock.end()
    clock.begin(0, 0)  # a step with nothing scheduled is not timed
    clock.end()
    assert costs.compute.steps == 10
    spt = costs.compute.seconds_per_token()
    assert spt is not None and 1 / 400_000 < spt < 1 / 100_000


def test_engine_collector_exports_measured_costs() -> None:
    with _engine() as engine:
        engine.costs.observe_load("remote", 1 << 20, 0.01)
        reg = CollectorRegistry()
        reg.register(engine.prometheus_collector())
        text = generate_latest(reg).decode()
    assert 'kvmesh_tier_load_bytes_per_second{tier="remote"}' in text
    assert f"kvmesh_kv_bytes_per_token {float(LAYOUT.bytes_per_token)}" in text
    assert 'kvmesh_tier_capacity_bytes{tier="cpu"}' in text
