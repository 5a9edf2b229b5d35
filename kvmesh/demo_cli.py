"""``kvmesh demo``'s parser (apart from :mod:`kvmesh.demo`, which imports the bench machinery)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: argparse._SubParsersAction[Any]) -> None:
    dm = sub.add_parser(
        "demo",
        help="plain vLLM + round-robin vs kvmesh replicas + round-robin vs kvmesh replicas + kvmesh router",
    )
    dm.add_argument("--model", default=".cache/models/tiny", help="model directory (built if missing)")
    dm.add_argument("--json", help="write the comparison here")
    dm.add_argument("--plot", help="write a PNG plot here (one panel per metric)")
    dm.add_argument(
        "--workload",
        choices=["default", "held-out"],
        default="default",
        help="default: the workload the router's weights were tuned on (bench router's default); "
        "held-out: bench router's held-out one, never tuned on (--tenants/--users/--turns/--prefix-words "
        "then do not apply)",
    )
    dm.add_argument("--tenants", type=int, default=12)
    dm.add_argument("--users", type=int, default=2, help="users per tenant")
    dm.add_argument("--turns", type=int, default=3, help="turns per conversation")
    dm.add_argument("--concurrency", type=int, default=4, help="conversations in flight")
    dm.add_argument(
        "--num-blocks",
        type=int,
        default=40,
        help="each replica's own KV cache in 128-token blocks (default 40: fewer than the tenants' prefixes)",
    )
    dm.add_argument(
        "--prefix-words", type=int, default=250, help="words per tenant system prompt (~4 tokens each)"
    )
    dm.add_argument(
        "--repeats", type=int, default=3, help="runs per setup, interleaved (medians are reported)"
    )
    dm.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvmesh import demo

    if args.workload == "held-out":
        p = demo.held_out_params(args.concurrency, args.repeats, args.num_blocks)
    else:
        p = demo.params(
            tenants=args.tenants,
            users=args.users,
            turns=args.turns,
            concurrency=args.concurrency,
            repeats=args.repeats,
            num_blocks=args.num_blocks,
            prefix_words=args.prefix_words,
        )
    out = demo.run(
        model_dir=args.model, json_path=args.json, plot_path=args.plot, p=p, workload_name=args.workload
    )
    return 1 if demo.failed(out) else 0
