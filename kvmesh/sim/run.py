"""One simulation: a workload, a fleet, a policy; and the figures of its records."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import kvmesh.sim.policies as policies
from kvmesh.sim.cost import CostProfile
from kvmesh.sim.fleet import Fleet, FleetConfig, Record
from kvmesh.sim.workload import Workload


def simulate(
    work: Workload,
    policy: str,
    config: FleetConfig,
    cost: CostProfile,
    progress: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Run ``work`` under ``policy``; its :func:`summarize` figures plus wall time.

    ``seed`` draws the service-time jitter (see :class:`~kvmesh.sim.cost.CostProfile`).
    """
    pol = policies.make(policy, tree_blocks=config.gpu_blocks)
    fleet = Fleet(config, cost, work.block_tokens, pol, seed=seed)
    t0 = time.perf_counter()
    if progress:
        from tqdm import tqdm

        with tqdm(
            total=work.num_requests,
            desc=f"{policy} x{config.replicas}",
            unit="req",
            leave=False,
            disable=None,
        ) as bar:
            records = fleet.run(work, on_done=bar.update)
    else:
        records = fleet.run(work)
    wall = time.perf_counter() - t0
    out = {"policy": policy, "replicas": config.replicas, **summarize(records, config.replicas)}
    out.update(getattr(pol, "summary", dict)())  # a policy's own figures (cost: its accuracy)
    out["sim_wall_s"] = round(wall, 2)
    out["sim_requests_per_s"] = round(len(records) / wall) if wall > 0 else 0
    return out


def summarize(records: Sequence[Record], replicas: int) -> dict[str, Any]:
    """Hit ratio, prefill tokens saved, TTFT p50/p90/p99, throughput, load imbalance."""
    if not records:
        return {"requests": 0}
    tokens = sum(r.tokens for r in records)
    hits = np.array([r.hit for r in records], dtype=np.int64).sum(axis=0)
    ttft = np.array([r.ttft_s for r in records])
    start = min(r.arrival_s for r in records)
    end = max(r.done_s for r in records)
    per = np.bincount([r.replica for r in records], minlength=replicas)
    work = np.zeros(replicas)
    for r in records:
        work[r.replica] += r.tokens - sum(r.hit)
    return {
        "requests": len(records),
        "hit_ratio": round(float(hits.sum()) / tokens, 4),
        "hit_by_tier": dict(
            zip(("gpu", "cpu", "disk", "shared"), (round(float(h) / tokens, 4) for h in hits), strict=True)
        ),
        "prefill_tokens_saved": int(hits.sum()),
        "prompt_tokens": int(tokens),
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 4),
        "ttft_p90_s": round(float(np.percentile(ttft, 90)), 4),
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 4),
        "throughput_rps": round(len(records) / (end - start), 3) if end > start else 0.0,
        # max / mean: 1.0 is perfectly even; requests and computed prefill tokens per replica
        "imbalance_requests": round(float(per.max() / per.mean()), 3),
        "imbalance_prefill": round(float(work.max() / work.mean()), 3) if work.mean() > 0 else 1.0,
    }
