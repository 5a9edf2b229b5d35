"""``kvmesh bench router``'s parser (apart from the benchmark, which starts vLLM replicas)."""

from __future__ import annotations

import argparse
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from kvmesh.bench.router import bench

    out = bench.run(
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        model_dir=args.model,
        setups=args.setups.split(",") if args.setups else None,
        arrival=args.arrival,
        prefix_words=args.prefix_words,
        repeats=args.repeats,
        workloads=args.workloads.split(",") if args.workloads else None,
        measure_overhead=not args.no_overhead,
        loads=args.loads.split(","),
    )
    return 0 if all("error" not in r for r in out["results"]) else 1


def register(bsub: argparse._SubParsersAction[Any]) -> None:
    br = bsub.add_parser("router", help="vllm-router / LMCache / kvmesh routing side by side on 2 replicas")
    br.add_argument("--quick", action="store_true", help="2 turns per conversation, 1 repeat")
    br.add_argument("--json", help="write results here")
    br.add_argument("--plot", help="write a PNG plot here")
    br.add_argument("--model", help="model directory (default .cache/models/tiny, built if missing)")
    br.add_argument("--setups", help="comma-separated subset of kvmesh.bench.router.setups.SETUP_NAMES")
    br.add_argument("--workloads", help="comma-separated subset of default,held-out,trace")
    br.add_argument("--repeats", type=int, default=0, help="rounds per workload (default 2; --quick 1)")
    br.add_argument(
        "--loads",
        default="light,heavy",
        help="offered loads, comma-separated: light (one conversation at a time; the trace at 30%% of "
        "its measured capacity), heavy (85%% of capacity)",
    )
    br.add_argument("--no-overhead", action="store_true", help="skip the router overhead and index lookup")
    br.add_argument(
        "--arrival",
        choices=["turns", "sessions"],
        default="sessions",
        help="sessions: 4 conversations active at a time, new ones starting as others end (default); "
        "turns: every conversation starts at once, first turns before second ones",
    )
    br.add_argument(
        "--prefix-words",
        type=int,
        default=0,
        help="words in each tenant's system prompt (default 250, about 1,000 tokens)",
    )
    br.set_defaults(func=_run)
