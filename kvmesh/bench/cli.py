"""``kvmesh bench``: one subcommand per suite, each parser built by its own package."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from kvmesh.errors import ConfigError


def register(sub: argparse._SubParsersAction[Any]) -> None:
    from kvmesh.bench.codecs.cli import register as codecs
    from kvmesh.bench.disk.cli import register as disk
    from kvmesh.bench.epp.cli import register as epp
    from kvmesh.bench.gpu.cli import register as gpu
    from kvmesh.bench.pd.cli import register as pd
    from kvmesh.bench.router.cli import register as router
    from kvmesh.bench.scale.cli import register as scale
    from kvmesh.bench.stall.cli import register as stall
    from kvmesh.bench.tiers.cli import register as tiers
    from kvmesh.bench.ttft.cli import register as ttft

    bench = sub.add_parser("bench", help="benchmarks (JSON + PNG)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for suite in (tiers, ttft, stall, router, gpu, disk, scale, epp, codecs, pd):
        suite(bsub)
    for name, parser in bsub.choices.items():
        parser.set_defaults(func=_said_plainly(f"kvmesh bench {name}", parser.get_default("func")))


Command = Callable[[argparse.Namespace], int]


def _said_plainly(prog: str, func: Command) -> Command:
    """``func``, with a bad setting (a :class:`~kvmesh.errors.ConfigError`: a ``--model`` that
    holds no model, say) said in one line and exit status 2 instead of a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except ConfigError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2

    return run
