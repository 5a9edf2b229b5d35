"""``kvmesh bench scale``'s parser (apart from the benchmark, which imports numpy)."""

from __future__ import annotations

import argparse
from typing import Any

from kvmesh.bench.runner import SMOKE_HELP


def _run(args: argparse.Namespace) -> int:
    from kvmesh.bench.scale import bench

    return bench.main(args)


def register(bsub: argparse._SubParsersAction[Any]) -> None:
    p = bsub.add_parser("scale", help="router index and scoring vs replicas (10..1,000) and indexed blocks")
    p.add_argument("--quick", action="store_true", help="100k-300k blocks, 3 ingest rates of 2 s")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", help="write a PNG (log-log) here")
    p.add_argument("--model", help="tokenizer's model directory (default .cache/models/tiny)")
    p.add_argument("--max-blocks", type=int, help="largest index to measure (default 3M; 300k with --quick)")
    p.add_argument("--from-json", help="recompute the summary and plot of an earlier run's JSON")
    p.set_defaults(func=_run)
