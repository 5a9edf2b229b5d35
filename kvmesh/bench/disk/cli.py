"""``kvmesh bench disk``'s parser (apart from the benchmark, which imports numba and numpy)."""

from __future__ import annotations

import argparse
from typing import Any

from kvmesh.bench.runner import SMOKE_HELP


def _run(args: argparse.Namespace) -> int:
    from kvmesh.bench.disk import bench

    out = bench.run(
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        directory=args.dir,
        full=args.full,
        smoke=args.smoke,
    )
    return 0 if all(r["skipped"] == 0 for r in out["grid"]) else 1


def register(bsub: argparse._SubParsersAction[Any]) -> None:
    bd = bsub.add_parser(
        "disk", help="disk tier vs an SSD: DLWA per placement (FTL sim), write/read latency, fio"
    )
    bd.add_argument("--quick", action="store_true", help="fewer requests and cells, one round")
    bd.add_argument("--full", action="store_true", help="every trace x write mode x chunk x utilisation cell")
    bd.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    bd.add_argument("--json", help="write results here")
    bd.add_argument("--plot", help="write a PNG plot here")
    bd.add_argument("--dir", help="directory on the disk to measure (default ./.cache)")
    bd.set_defaults(func=_run)
