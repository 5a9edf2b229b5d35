"""``kvmesh bench codecs`` arguments (kept apart so building the CLI parser imports no torch)."""

from __future__ import annotations

import argparse
from typing import Any

from kvmesh.bench.runner import SMOKE_HELP


def _run(args: argparse.Namespace) -> int:
    from kvmesh.bench.codecs.bench import run

    run(
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        model_dir=args.model,
        prompts=args.prompts,
        smoke=args.smoke,
    )
    return 0


def register(bsub: argparse._SubParsersAction[Any]) -> None:
    bc = bsub.add_parser("codecs", help="raw / zstd / safetensors / cachegen: size, GB/s, output drift")
    bc.add_argument("--quick", action="store_true", help="3 repeats, 10 prompts")
    bc.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    bc.add_argument("--json", help="write results here")
    bc.add_argument("--plot", help="write a PNG plot here")
    bc.add_argument("--model", help="model dir (default .cache/models/bench, built if missing)")
    bc.add_argument("--prompts", type=int, help="prompts for the drift measurement (default 100)")
    bc.set_defaults(func=_run)
