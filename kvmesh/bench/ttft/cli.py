"""``kvmesh bench ttft``'s parser (apart from the benchmark, so building the CLI imports no vLLM)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from kvmesh.bench.ttft import bench

    out = bench.run(
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        model_dir=args.model,
        phases=[p.split(",") for p in args.setups.split(";")] if args.setups else None,
        lengths=[int(x) for x in args.lengths.split(",")] if args.lengths else None,
        kvmesh_overrides=json.loads(args.kvmesh_config) if args.kvmesh_config else None,
        trials=args.trials,
        time_budget_s=args.time_budget_s,
    )
    return 0 if all(r.get("logprobs_ok", True) for r in out["results"]) else 1


def register(bsub: argparse._SubParsersAction[Any]) -> None:
    tt = bsub.add_parser("ttft", help="TTFT of a cached prompt: kvmesh vs recompute and peers")
    tt.add_argument("--quick", action="store_true", help="3 trials per length instead of 10")
    tt.add_argument("--trials", type=int, help="trials per setup and length (overrides --quick)")
    tt.add_argument("--time-budget-s", type=float, help="start no new round after this many seconds")
    tt.add_argument("--json", help="write results here")
    tt.add_argument("--plot", help="write a PNG plot here")
    tt.add_argument("--model", help="model dir (default .cache/models/bench, built if missing)")
    tt.add_argument(
        "--setups",
        help="comma-separated setups: recompute, example_connector, lmcache_mp[@CHUNK], "
        "lmcache_redis[@CHUNK], kvmesh_cpu|kvmesh_disk|kvmesh_redis[@CHUNK][+tail|-tail] "
        "(default: the peers, kvmesh at 128 without tail chunks, kvmesh out of the box); "
        "';' separates phases (groups whose workers are up at once)",
    )
    tt.add_argument("--lengths", help="comma-separated prompt lengths (default 500,1000,2000)")
    tt.add_argument("--kvmesh-config", help="JSON of kvmesh config keys for every kvmesh setup")
    tt.set_defaults(func=_run)
