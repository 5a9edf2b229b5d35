"""``kvmesh bench epp``'s parser."""

from __future__ import annotations

import argparse
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from kvmesh.bench.epp import bench

    return bench.main(args)


def register(bsub: argparse._SubParsersAction[Any]) -> None:
    p = bsub.add_parser("epp", help="kvmesh epp decision latency at 2k/32k tokens; Envoy+EPP added latency")
    p.add_argument("--quick", action="store_true", help="few trials (a smoke run)")
    p.add_argument("--model", help="tokenizer/model directory (default .cache/models/tiny, built if missing)")
    p.add_argument(
        "--ttft",
        action="store_true",
        help="also TTFT p90 through Envoy+EPP vs kvmesh router (2 vLLM replicas)",
    )
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.set_defaults(func=_run)
