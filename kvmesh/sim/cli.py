"""``kvmesh sim``: compare policies on a trace, validate against ``bench router``, time it.

``kvmesh sim run``       policies x fleet sizes on a trace (or the generator); JSON + PNG
``kvmesh sim validate``  ``bench router``'s workload at 2 replicas vs docs/bench/router.json
``kvmesh sim speed``     requests/s of the simulator itself at 1,000 replicas
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from kvmesh.bench.runner import Provenance, provenance
from kvmesh.paths import traces_dir
from kvmesh.sim import policies
from kvmesh.sim.bound import bound, unique_blocks, violations
from kvmesh.sim.cost import PROFILES
from kvmesh.sim.costpolicy import cost_targets, slow_tier
from kvmesh.sim.fleet import FleetConfig
from kvmesh.sim.run import simulate
from kvmesh.sim.workload import Workload, generate, load_trace, tile, time_scale_for

TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}
TRACE_DIR = traces_dir()
# measured on this machine by `kvmesh bench router`, 2 replicas: the run the vllm-cpu-tiny
# profile was fitted to (docs/history/sim-calibration-router.json, commit c08cf00). Later
# runs are not the reference: their TTFTs moved 10-40% run to run (docs/bench/sim.md).
MEASURED_SETUPS = {
    ("kvmesh", "kvmesh"): ("kvmesh", True),
    ("kvmesh", "round-robin"): ("round-robin", True),
    ("vllm-router", "round_robin"): ("round-robin", False),
}
# kvmesh's own pickers and the infinite-cache reference: never "the best other policy".
NOT_PEERS = ("kvmesh", "prefix", "cost", "infinite-cache")
SHARED_FRACTION = 0.5


def _workload(args: argparse.Namespace) -> Workload:
    if args.trace == "generate":
        return generate(seed=args.seed)
    path = TRACES.get(args.trace)
    return load_trace(os.path.join(TRACE_DIR, path) if path else args.trace, limit=args.limit)


def _fleet(replicas: int, args: argparse.Namespace, tiers: bool, shared_blocks: int) -> FleetConfig:
    return FleetConfig(
        replicas,
        args.gpu_blocks,
        cpu_blocks=args.cpu_blocks if tiers else 0,
        disk_blocks=args.disk_blocks if tiers else 0,
        shared_blocks=shared_blocks if tiers else 0,
        slowdowns=args.slowdowns,
    )


def _slowdowns(text: str) -> tuple[float, ...]:
    """``--slowdowns``: comma-separated prefill time multipliers, each in [1, 100]: the profile
    is the fleet's fastest kind (the computed ceiling, ``bound``, assumes its rate)."""
    try:
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not all(1.0 <= x <= 100.0 for x in out):  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"each slowdown must be between 1 and 100 (the profile is the fastest replica), got {text!r}"
        )
    return out


def shared_per_copy(args: argparse.Namespace, base: Workload) -> int:
    """The shared tier per trace copy: ``--shared-blocks``, else ``--shared-fraction`` of the
    trace's distinct blocks (smaller than the working set, so capacity and placement matter)."""
    if args.shared_blocks is not None:
        return int(args.shared_blocks)
    return max(1, round(float(args.shared_fraction) * unique_blocks(base)))


def cmd_run(args: argparse.Namespace) -> int:
    prov = provenance("sim run")  # the code this run measures: read now, the tree may move on
    base = _workload(args)
    cost = PROFILES[args.profile]
    names = args.policies.split(",")
    results: list[dict[str, Any]] = []
    bounds: dict[str, dict[str, Any]] = {}
    per_copy = int(args.replicas.split(",")[0])
    shared = shared_per_copy(args, base)
    for n in (int(x) for x in args.replicas.split(",")):
        # Same offered load per replica at every fleet size: more users (copies) and the
        # arrivals stretched so that recomputing everything would keep `load` of the fleet busy.
        copies = max(1, n // per_copy)
        # a mixed fleet's capacity in replicas of the profile's rate
        capacity = FleetConfig(per_copy, 0, slowdowns=args.slowdowns).capacity()
        scale = time_scale_for(base, capacity, args.load, 1.0 / cost.prefill_tps)
        work = tile(base, copies, scale)
        # The shared tier grows with the users (copies) it serves, like a Redis cluster would.
        bounds[str(n)] = {**bound(work, cost), "shared_blocks": shared * copies}
        for fleet_kind in args.fleets.split(","):
            # slow-tier: a kvmesh fleet whose shared tier is 50 ms away (kvmesh.sim.costpolicy)
            profile = slow_tier(cost) if fleet_kind == "slow-tier" else cost
            for name in names:
                fleet = _fleet(n, args, fleet_kind in ("kvmesh", "slow-tier"), shared * copies)
                out = simulate(work, name, fleet, profile, progress=not args.no_progress)
                out.update(fleet=fleet_kind, workload=work.name, requests_offered=work.num_requests)
                results.append(out)
                print(json.dumps({k: v for k, v in out.items() if k != "hit_by_tier"}), flush=True)
    broken = {
        n: v for n in bounds if (v := violations([r for r in results if str(r["replicas"]) == n], bounds[n]))
    }
    config = {k: getattr(args, k) for k in ("gpu_blocks", "cpu_blocks", "disk_blocks", "replicas")}
    config.update(
        shared_blocks=shared,  # per trace copy, beside the trace's own working set
        shared_fraction=None if args.shared_blocks is not None else args.shared_fraction,
        unique_blocks=unique_blocks(base),
    )
    if args.slowdowns:
        config["slowdowns"] = list(args.slowdowns)  # a mixed fleet
    report = {
        "workload": base.name,
        "profile": cost.name,
        "load": args.load,
        "config": config,
        "results": results,
        "bounds": bounds,
        "bound_violations": broken,
        "targets": targets(results, bounds),
        "cost_targets": cost_targets(results),
    }
    print(json.dumps(report["targets"], indent=1))
    print(json.dumps(report["cost_targets"], indent=1))
    if broken:
        print(f"kvmesh sim: results beat the bound (a bug): {json.dumps(broken)}", file=sys.stderr)
    _write(args.json, report, prov)
    if args.plot:
        from kvmesh.sim.plots import plot_policies

        plot_policies(args.plot, results)
    return 1 if broken else 0


def targets(results: list[dict[str, Any]], bounds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per fleet size, each fleet kind against itself (like for like): kvmesh's hit ratio /
    the bound's ceiling (>= 0.95), and kvmesh's TTFT p99 / the best other policy's on the
    same fleet (<= 0.7). The infinite-cache reference and kvmesh's own pickers are no peers."""
    out: dict[str, Any] = {}
    for n in sorted({r["replicas"] for r in results}):
        b = bounds.get(str(n))
        t: dict[str, Any] = {}
        for fleet in sorted({r["fleet"] for r in results if r["replicas"] == n}):
            rows = [r for r in results if r["replicas"] == n and r["fleet"] == fleet]
            km = next((r for r in rows if r["policy"] == "kvmesh"), None)
            if km is None:
                continue
            if b is not None:
                ratio = round(km["hit_ratio"] / b["hit_ratio_max"], 3) if b["hit_ratio_max"] else None
                t[f"hit_vs_bound_on_{fleet}"] = {
                    "kvmesh": km["hit_ratio"],
                    "bound": b["hit_ratio_max"],
                    "ratio": ratio,
                    "ge_0_95": ratio is not None and ratio >= 0.95,
                }
            peers = [r for r in rows if r["policy"] not in NOT_PEERS]
            if peers:
                best = min(peers, key=lambda r: r["ttft_p99_s"])
                ratio = round(km["ttft_p99_s"] / best["ttft_p99_s"], 3)
                t[f"ttft_p99_vs_best_other_on_{fleet}"] = {
                    "kvmesh_ttft_p99_s": km["ttft_p99_s"],
                    "best": best["policy"],
                    "best_ttft_p99_s": best["ttft_p99_s"],
                    "ratio": ratio,
                    "le_0_7": ratio <= 0.7,
                }
        out[str(n)] = t
    return out


def cmd_validate(args: argparse.Namespace) -> int:
    from kvmesh.sim.workload import bench_router

    prov = provenance("sim validate")  # read now, the tree may move on

    with open(args.measured) as f:
        measured = {(r["router"], r["policy"]): r for r in json.load(f)["results"]}
    work = bench_router(args.model)
    cost = PROFILES["vllm-cpu-tiny"]
    rows = []
    for key, (policy, kv_tiers) in MEASURED_SETUPS.items():
        m = measured.get(key)
        if m is None:
            continue
        fleet = FleetConfig(2, 40, shared_blocks=1_000_000 if kv_tiers else 0)
        # Medians over seeds of the service-time jitter, as bench router reports medians of 7.
        runs = [simulate(work, policy, fleet, cost, seed=k) for k in range(args.repeats)]
        keys = ("hit_ratio", "ttft_p50_s", "ttft_p90_s", "throughput_rps")
        s = {key: round(statistics.median(r[key] for r in runs), 4) for key in keys}
        row = {
            "setup": f"{key[0]}:{key[1]}",
            "measured_hit": m["hit_rate"],
            "sim_hit": s["hit_ratio"],
            "hit_diff": round(s["hit_ratio"] - m["hit_rate"], 4),
            "hit_within_0_05": abs(s["hit_ratio"] - m["hit_rate"]) <= 0.05,
            "measured_ttft_p90_s": m["ttft_p90_s"],
            "sim_ttft_p90_s": s["ttft_p90_s"],
            "ttft_p90_ratio": round(s["ttft_p90_s"] / m["ttft_p90_s"], 3),
            "ttft_p90_within_25pct": abs(s["ttft_p90_s"] / m["ttft_p90_s"] - 1) <= 0.25,
            "measured_ttft_p50_s": m["ttft_p50_s"],
            "sim_ttft_p50_s": s["ttft_p50_s"],
            "measured_rps": m["requests_per_s"],
            "sim_rps": s["throughput_rps"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    _write(
        args.json,
        {
            "profile": cost.name,
            "workload": "bench-router (2 replicas, 40 blocks of 128 tokens)",
            "rows": rows,
        },
        prov,
    )
    return 0 if rows and all(r["hit_within_0_05"] and r["ttft_p90_within_25pct"] for r in rows) else 1


def cmd_speed(args: argparse.Namespace) -> int:
    prov = provenance("sim speed")  # read now, the tree may move on
    base = load_trace(os.path.join(TRACE_DIR, TRACES["conversation"]))
    cost = PROFILES["h100-llama8b"]
    copies = max(1, -(-args.requests // base.num_requests))
    scale = time_scale_for(base, args.replicas // copies or 1, 0.6, 1.0 / cost.prefill_tps)
    work = tile(base, copies, scale)
    work = Workload(work.name, work.block_tokens, requests=work.requests[: args.requests])
    rows = []
    for name in args.policies.split(","):
        t0, c0 = time.perf_counter(), time.process_time()
        out = simulate(work, name, FleetConfig(args.replicas, 880), cost, progress=not args.no_progress)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        row = {
            "policy": name,
            "replicas": args.replicas,
            "requests": out["requests"],
            "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1),  # the machine is shared: wall includes waiting for a core
            "requests_per_s": round(out["requests"] / wall),
            "hit_ratio": out["hit_ratio"],
            # the same policy code at 1,000 replicas: its latency beside its speed
            "ttft_p50_s": out.get("ttft_p50_s"),
            "ttft_p99_s": out.get("ttft_p99_s"),
            # measured when the run had 1M requests, else extrapolated from its rate
            "minutes_for_1M": round(1e6 / (out["requests"] / wall) / 60, 1),
            "extrapolated": out["requests"] < 1_000_000,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    minutes = {r["policy"]: r["minutes_for_1M"] for r in rows}
    _write(args.json, {"target_minutes_for_1M": 10, "minutes_for_1M": minutes, "rows": rows}, prov)
    return 0


def _write(path: str | None, data: dict[str, Any], prov: Provenance) -> None:
    """``data`` as JSON with the provenance read when the command started."""
    if path:
        from kvmesh.bench.runner import write_json

        write_json(path, data, prov)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``kvmesh sim`` to the ``kvmesh`` command."""
    p = sub.add_parser(
        "sim", help="fleet simulator: policies x replicas on a trace, with the router's own scorers"
    )
    ssub = p.add_subparsers(dest="sim", required=True)
    r = ssub.add_parser("run", help="compare policies on a trace at several fleet sizes")
    r.add_argument(
        "--trace", default="conversation", help="conversation | synthetic | generate | a JSONL path"
    )
    r.add_argument("--limit", type=int, help="first N requests of the trace")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--replicas", default="16,128", help="fleet sizes; the first one plays the trace once")
    r.add_argument(
        "--policies",
        default=",".join(p for p in policies.POLICIES if p != "prefix"),
        help=f"comma-separated subset of {','.join(policies.POLICIES)}",
    )
    r.add_argument(
        "--fleets",
        default="plain,kvmesh",
        help="plain (GPU cache only), kvmesh (with tiers), slow-tier (kvmesh, shared tier 50 ms away)",
    )
    r.add_argument("--profile", default="h100-llama8b", choices=sorted(PROFILES))
    r.add_argument(
        "--load", type=float, default=0.6, help="offered prefill load per replica before cache hits"
    )
    r.add_argument(
        "--gpu-blocks", type=int, default=880, help="GPU prefix cache per replica, in trace blocks"
    )
    r.add_argument("--cpu-blocks", type=int, default=3200, help="kvmesh CPU tier per replica (kvmesh fleet)")
    r.add_argument("--disk-blocks", type=int, default=0, help="kvmesh disk tier per replica (kvmesh fleet)")
    r.add_argument(
        "--shared-blocks",
        type=int,
        help="kvmesh shared tier per trace copy (kvmesh fleet; default: --shared-fraction of the trace's "
        "distinct blocks)",
    )
    r.add_argument(
        "--shared-fraction",
        type=float,
        default=SHARED_FRACTION,
        help=f"the shared tier as a fraction of the trace's distinct blocks (default {SHARED_FRACTION}: "
        "smaller than the working set, so capacity and placement matter)",
    )
    r.add_argument(
        "--slowdowns",
        type=_slowdowns,
        default=(),
        help="a mixed fleet: prefill time multipliers (each 1-100) cycled over the replicas (1,2: "
        "every other replica prefills at half the rate; the offered load counts that capacity)",
    )
    r.add_argument("--json")
    r.add_argument("--plot")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(func=cmd_run)
    v = ssub.add_parser("validate", help="bench router's workload at 2 replicas vs the measured run")
    v.add_argument("--model", default=os.path.join(".cache", "models", "tiny"))
    v.add_argument(
        "--measured",
        default=os.path.join("docs", "history", "sim-calibration-router.json"),
        help="a bench router JSON (default: the run the vllm-cpu-tiny profile was fitted to)",
    )
    v.add_argument("--repeats", type=int, default=7, help="seeds of the service-time jitter (medians)")
    v.add_argument("--json")
    v.set_defaults(func=cmd_validate)
    s = ssub.add_parser("speed", help="the simulator's own speed at 1,000 replicas")
    s.add_argument("--replicas", type=int, default=1000)
    s.add_argument("--requests", type=int, default=50_000)
    s.add_argument("--policies", default="round-robin,kvmesh")
    s.add_argument("--json")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=cmd_speed)
