"""``kvmesh demo``: two vLLM replicas with the kvmesh connector behind the kvmesh router.

It builds the tiny model if missing, starts Redis (or uses a shared directory when
redis-server is not installed) as the shared tier, and starts two vLLM replicas with the
kvmesh connector and KV events. Each replica gets one core (every process of it pinned
there, as in ``kvmesh bench router``) and its own KV cache capped at about three quarters
of the workload's (200 blocks of 128 tokens against ~264), so one replica cannot hold every
tenant but the two together can when each tenant stays on one. It then runs the same
multi-tenant workload per policy (``repeats`` times, alternating the order) through the
router and compares the medians of prefix hit rate, TTFT and throughput. Every run gets its
own tenant texts (same shape), so no run profits from the one before. Every process it
started is stopped on exit or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from kvmesh.bench.report import print_table, write_json, write_plot
from kvmesh.bench.workload import Workload, median_summary, replay
from kvmesh.cluster import Replica, install_signal_handlers, start_replicas
from kvmesh.services import RedisServer

DEFAULT_MODEL = os.path.join(".cache", "models", "tiny")


# The router's medium weights say what a prefix block in each place saves. The defaults
# (GPU 1.0, CPU 0.8, DISK 0.5, REMOTE 0.3) suit GPU servers, where loading a block from a
# shared tier costs a good part of recomputing it. On this CPU machine a load is ~2-4% of a
# recompute (`kvmesh bench ttft`: 2,000 tokens recomputed in ~1.25 s, loaded from Redis in
# ~0.05 s), so a block any replica can load is worth nearly as much as one in its own cache,
# and routing should mostly balance work. A deployment sets these from its own measurements.
ROUTER_TUNING: dict[str, Any] = {
    "medium_weights": {"GPU": 1.0, "CPU": 0.95, "DISK": 0.9, "REMOTE": 0.9},
    "prefill_load_cost": 0.02,
}


def connector_config(remote_url: str, chunk_size: int = 256, cpu_gb: float = 0.5) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a kvmesh replica."""
    return {
        "kv_connector": "KVMeshConnector",
        "kv_connector_module_path": "kvmesh.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "chunk_size": chunk_size,
            "max_local_cpu_size": cpu_gb,
            "remote_url": remote_url,
        },
    }


@contextlib.contextmanager
def shared_tier(workdir: str) -> Iterator[str]:
    """Redis when it is installed, else a shared directory."""
    if RedisServer.available():
        with RedisServer() as server:
            yield server.url
    else:
        path = os.path.join(workdir, "shared")
        os.makedirs(path, exist_ok=True)
        yield "fs://" + os.path.abspath(path)


def ensure_model(model_dir: str) -> str:
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        from kvmesh.model import PRESETS, make_tiny

        print(f"building the tiny model in {model_dir} ...")
        make_tiny(out_dir=model_dir, **PRESETS["tiny"])
    return model_dir


def warm_up(urls: list[str], model: str = "tiny") -> None:
    """One request per replica first: a new vLLM process spends seconds of lazy
    initialisation on its first requests, which would otherwise land on the first policy."""
    import httpx

    for i, url in enumerate(urls):
        for j in range(2):
            body = {"model": model, "prompt": f"warm up {i} {j} " * 50, "max_tokens": 2}
            httpx.post(url + "/v1/completions", json=body, timeout=300.0).raise_for_status()


def summarize(policy: str, summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of the comparison: the medians over the repeats, plus each repeat's figures."""
    return {
        "policy": policy,
        **median_summary(summaries),
        "requests": sum(int(s["requests"]) for s in summaries),
        "errors": sum(int(s["errors"]) for s in summaries),
        "repeats": summaries,
    }


def verdict(runs: list[dict[str, Any]]) -> str:
    """One line comparing the kvmesh policy with round-robin (empty if either is missing)."""
    by = {r["policy"]: r for r in runs}
    base, ours = by.get("round-robin"), by.get("kvmesh")
    if not base or not ours or not base.get("ttft_p50_s") or not ours.get("ttft_p50_s"):
        return ""
    return (
        f"kvmesh vs round-robin: hit rate {ours['hit_rate']:.3f} vs {base['hit_rate']:.3f}; "
        f"TTFT p50 x{ours['ttft_p50_s'] / base['ttft_p50_s']:.2f}, "
        f"p90 x{ours['ttft_p90_s'] / base['ttft_p90_s']:.2f}; "
        f"requests/s x{ours['requests_per_s'] / base['requests_per_s']:.2f}"
    )


def run(
    model_dir: str = DEFAULT_MODEL,
    json_path: str | None = None,
    plot_path: str | None = None,
    policies: tuple[str, ...] = ("round-robin", "kvmesh"),
    tenants: int = 8,
    users: int = 4,
    turns: int = 3,
    concurrency: int = 4,
    num_blocks: int = 200,
    repeats: int = 3,
    workdir: str | None = None,
) -> dict[str, Any]:
    from tqdm import tqdm

    from kvmesh.router import ReplicaConfig, RouterConfig
    from kvmesh.router.server import Router

    install_signal_handlers()
    model_dir = ensure_model(model_dir)
    workdir = workdir or tempfile.mkdtemp(prefix="kvmesh-demo-")
    per_policy: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    with shared_tier(workdir) as remote_url:
        print(f"shared tier: {remote_url}")
        replicas = [
            Replica(
                model_dir,
                cpu=i,
                num_blocks=num_blocks,
                kv_transfer=connector_config(remote_url),
                events_ipc=f"ipc://{os.path.abspath(workdir)}/events{i}.sock",
                log_path=os.path.join(workdir, f"replica{i}.log"),
                pin_process=True,
            )
            for i in range(2)
        ]
        print(f"starting 2 vLLM replicas (logs in {workdir}) ...")
        try:
            start_replicas(replicas)
            warm_up([r.url for r in replicas])
            for repeat in range(repeats):
                # Alternate the order so drift on a shared machine favours no policy.
                order = policies if repeat % 2 == 0 else tuple(reversed(policies))
                for policy in order:
                    seed = 1 + policies.index(policy) + len(policies) * repeat
                    workload = Workload.multi_tenant(tenants, users, turns, seed=seed)
                    config = RouterConfig(
                        model=model_dir,
                        replicas=tuple(
                            ReplicaConfig(url=r.url, events=r.events_endpoint, name=f"replica{i}")
                            for i, r in enumerate(replicas)
                        ),
                        policy=policy,
                        port=0,
                        **ROUTER_TUNING,
                    )
                    desc = f"{policy} [{repeat + 1}/{repeats}]"
                    with (
                        Router(config) as router,
                        tqdm(total=workload.num_requests, desc=desc, unit="req") as bar,
                    ):
                        result = replay(workload, router.url, "tiny", concurrency, on_done=bar.update)
                    per_policy[policy].append(result.summary())
        finally:
            for r in replicas:
                r.stop()
    runs = [summarize(policy, summaries) for policy, summaries in per_policy.items()]
    out = {
        "runs": runs,
        "workload": {
            "tenants": tenants,
            "users": users,
            "turns": turns,
            "concurrency": concurrency,
            "replica_kv_blocks": num_blocks,
            "repeats": repeats,
        },
    }
    print_table(runs, ["policy", "hit_rate", "ttft_p50_s", "ttft_p90_s", "requests_per_s", "errors"])
    print(verdict(runs))
    if json_path:
        write_json(json_path, out)
    if plot_path:
        write_plot(
            plot_path,
            labels=["prefix hit rate", "TTFT p50 (s)", "TTFT p90 (s)", "requests/s"],
            series={
                r["policy"]: [r["hit_rate"], r["ttft_p50_s"] or 0, r["ttft_p90_s"] or 0, r["requests_per_s"]]
                for r in runs
            },
            ylabel="value",
            title="kvmesh demo: 2 vLLM replicas, multi-tenant chat",
        )
    return out
