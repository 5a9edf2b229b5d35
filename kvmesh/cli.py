"""The ``kvmesh`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _bench_tiers(args: argparse.Namespace) -> int:
    from kvmesh.bench import tiers

    tiers.run(
        layout=args.layout,
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        directory=args.dir,
        redis_url=args.redis_url,
        tiers=tuple(args.tiers.split(",")),
    )
    return 0


def _model_make_tiny(args: argparse.Namespace) -> int:
    import os

    from kvmesh.model import PRESETS, make_tiny

    if args.if_missing and os.path.exists(os.path.join(args.out, "config.json")):
        print(f"model already at {args.out}")
        return 0
    params = dict(PRESETS[args.preset])
    for name in ("layers", "hidden", "kv_heads", "vocab", "seed"):
        value = getattr(args, name)
        if value is not None:
            params[name] = value
    path = make_tiny(out_dir=args.out, **params)
    print(f"wrote model to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh", description="One cluster-wide KV cache for vLLM replicas."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks (JSON + PNG)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bt = bsub.add_parser("tiers", help="store/retrieve throughput of each tier vs its physical limit")
    bt.add_argument("--layout", choices=["llama-8b", "tiny"], default="llama-8b")
    bt.add_argument("--quick", action="store_true", help="fewer chunks and repeats")
    bt.add_argument("--json", help="write results here")
    bt.add_argument("--plot", help="write a PNG plot here")
    bt.add_argument("--dir", help="directory for the disk tier (default ./.cache)")
    bt.add_argument("--redis-url", help="use this Redis instead of starting one")
    bt.add_argument("--tiers", default="cpu,disk,redis", help="comma-separated subset of cpu,disk,redis")
    bt.set_defaults(func=_bench_tiers)

    model = sub.add_parser("model", help="build local test models")
    msub = model.add_subparsers(dest="model", required=True)
    mt = msub.add_parser("make-tiny", help="write a random-weight Llama + locally trained BPE tokenizer")
    mt.add_argument("--out", required=True)
    mt.add_argument("--preset", default="tiny")
    mt.add_argument("--layers", type=int)
    mt.add_argument("--hidden", type=int)
    mt.add_argument("--kv-heads", dest="kv_heads", type=int)
    mt.add_argument("--vocab", type=int)
    mt.add_argument("--seed", type=int)
    mt.add_argument("--if-missing", action="store_true", help="do nothing if OUT already holds a model")
    mt.set_defaults(func=_model_make_tiny)
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
