"""``kvmesh bench stall``'s parser (apart from the benchmark, so building the CLI imports no vLLM)."""

from __future__ import annotations

import argparse
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from kvmesh.bench.stall import bench

    out = bench.run(
        quick=args.quick or args.smoke,
        json_path=args.json,
        plot_path=args.plot,
        model_dir=args.model,
        trials=1 if args.smoke else args.trials,
        tokens=256 if args.smoke else args.tokens,
        sources=args.sources.split(",") if args.sources else None,
        decode_tokens=24 if args.smoke else None,
        modes=args.modes.split(",") if args.modes else None,
    )
    return 0 if out["results"] else 1


def register(bsub: argparse._SubParsersAction[Any]) -> None:
    p = bsub.add_parser(
        "stall",
        help="inter-token latency of running decodes while another request loads (cold disk, a far "
        "Redis, a hung Redis), asynchronous vs synchronous loads",
    )
    p.add_argument("--quick", action="store_true", help="3 trials, shorter decodes")
    p.add_argument(
        "--smoke", action="store_true", help="the smallest run: 1 trial, 256 tokens (figures mean nothing)"
    )
    p.add_argument("--trials", type=int, help="trials per source and mode (default 8, 3 with --quick)")
    p.add_argument(
        "--tokens", type=int, default=2000, help="prompt tokens of the loading request (default 2000)"
    )
    p.add_argument(
        "--sources",
        help="comma-separated: disk, redis_far, redis_hung, vllm (the floor: nothing to load); "
        "default these four; also cpu",
    )
    p.add_argument(
        "--modes",
        help="comma-separated: async (the default config), sync (async_loads: off), all "
        "(async_loads: all: cpu hits through the async path too), tail (the defaults plus "
        "save_unfull_chunk: the partial last chunk cached), proc (the defaults plus disk_read_process: "
        "the disk tier's reads in a child process), or several joined by + (tail+proc); default async,sync",
    )
    p.add_argument("--model", help="model dir (default .cache/models/bench, built if missing)")
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.set_defaults(func=_run)
