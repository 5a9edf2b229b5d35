"""The ``kvmesh`` command: a list of registrations. Each subcommand's parser is built by its
own package (a ``register(sub)`` function), which imports its heavy modules only when run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

Register = Callable[["argparse._SubParsersAction[Any]"], object]


def registrations() -> list[Register]:
    """The subcommands, in the order ``kvmesh --help`` lists them."""
    from kvmesh.admin.cli import add_cache_parser
    from kvmesh.bench.cli import register as bench
    from kvmesh.bench.soak.cli import register as soak
    from kvmesh.config_cli import register as config
    from kvmesh.demo_cli import register as demo
    from kvmesh.epp.cli import register as epp
    from kvmesh.harness.model_cli import register as model
    from kvmesh.integrations.vllm.prewarm import add_prewarm_parser
    from kvmesh.router.cli import add_router_parser
    from kvmesh.sim.cli import register as sim
    from kvmesh.storage.cli import register as ftl

    return [bench, model, add_router_parser, add_prewarm_parser, add_cache_parser, soak, config, ftl, sim,
            epp, demo]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh", description="One cluster-wide KV cache for vLLM replicas."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for register in registrations():
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
