"""``kvmesh bench gpu``'s parser, apart from kvmesh.bench.gpu.bench so building the CLI does not
import torch."""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", help="write a PNG plot here")


def _run(args: argparse.Namespace) -> int:
    from kvmesh.bench.gpu import bench as gpu

    return gpu.run(args.quick, args.json, args.plot)


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """``kvmesh bench gpu`` under the ``bench`` subparsers."""
    p = sub.add_parser("gpu", help="the vLLM connector's host-device path on a GPU (skips without CUDA)")
    add_arguments(p)
    p.set_defaults(func=_run)
