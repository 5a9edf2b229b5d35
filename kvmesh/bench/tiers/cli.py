"""``kvmesh bench tiers``' parser (apart from the benchmark, so building the CLI imports no torch)."""

from __future__ import annotations

import argparse
from typing import Any

from kvmesh.bench.runner import SMOKE_HELP


def _run(args: argparse.Namespace) -> int:
    from kvmesh.bench.tiers import bench

    bench.run(
        layout=args.layout,
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        directory=args.dir,
        redis_url=args.redis_url,
        tiers=tuple(args.tiers.split(",")),
        smoke=args.smoke,
        auth=not args.no_auth,
    )
    return 0


def register(bsub: argparse._SubParsersAction[Any]) -> None:
    bt = bsub.add_parser("tiers", help="store/retrieve throughput of each tier vs its physical limit")
    bt.add_argument("--layout", choices=["llama-8b", "tiny"], default="llama-8b")
    bt.add_argument("--quick", action="store_true", help="fewer chunks and repeats")
    bt.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    bt.add_argument("--json", help="write results here")
    bt.add_argument("--plot", help="write a PNG plot here")
    bt.add_argument("--dir", help="directory for the disk tier (default ./.cache)")
    bt.add_argument("--redis-url", help="use this Redis instead of starting one")
    bt.add_argument("--tiers", default="cpu,disk,redis", help="comma-separated subset of cpu,disk,redis")
    bt.add_argument(
        "--no-auth", action="store_true", help="skip the fleet key rows (disk and Redis: keyed MAC, AEAD)"
    )
    bt.set_defaults(func=_run)
