"""``kvmesh bench pd``'s parser."""

from __future__ import annotations

import argparse
from typing import Any

from kvmesh.bench.pd.bench import SETUPS
from kvmesh.bench.runner import SMOKE_HELP


def _run(args: argparse.Namespace) -> int:
    from kvmesh.bench.pd import bench

    return bench.main(args)


def register(bsub: argparse._SubParsersAction[Any]) -> None:
    bp = bsub.add_parser("pd", help="prefill/decode disaggregation vs colocated (kvmesh, vllm-router, plain)")
    bp.add_argument("--quick", action="store_true", help="1 trial of 4 requests, a 64 MiB transfer")
    bp.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    bp.add_argument("--json", default="docs/bench/pd.json", help="write results here")
    bp.add_argument("--plot", default="docs/bench/pd.png", help="write the PNG here")
    bp.add_argument("--model", help="model directory (default .cache/models/tiny, built if missing)")
    bp.add_argument("--setups", help=f"comma-separated subset of {','.join(SETUPS)}")
    bp.set_defaults(func=_run)
