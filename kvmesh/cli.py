"""The ``kvmesh`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvmesh.bench import gpu_cli


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


def _bench_ttft(args: argparse.Namespace) -> int:
    import json

    from kvmesh.bench import ttft

    out = ttft.run(
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        model_dir=args.model,
        phases=[p.split(",") for p in args.setups.split(";")] if args.setups else None,
        lengths=[int(x) for x in args.lengths.split(",")] if args.lengths else None,
        kvmesh_overrides=json.loads(args.kvmesh_config) if args.kvmesh_config else None,
        trials=args.trials,
        time_budget_s=args.time_budget_s,
    )
    return 0 if all(r.get("logprobs_ok", True) for r in out["results"]) else 1


def _bench_router(args: argparse.Namespace) -> int:
    from kvmesh.bench import router

    out = router.run(
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        model_dir=args.model,
        setups=args.setups.split(",") if args.setups else None,
        arrival=args.arrival,
        prefix_words=args.prefix_words,
        repeats=args.repeats,
        workloads=args.workloads.split(",") if args.workloads else None,
        measure_overhead=not args.no_overhead,
    )
    return 0 if all("error" not in r for r in out["results"]) else 1


def _bench_disk(args: argparse.Namespace) -> int:
    from kvmesh.bench import disk

    out = disk.run(
        quick=args.quick, json_path=args.json, plot_path=args.plot, directory=args.dir, full=args.full
    )
    return 0 if all(r["skipped"] == 0 for r in out["grid"]) else 1


def _model_make_tiny(args: argparse.Namespace) -> int:
    import os

    from kvmesh.harness.model import PRESETS, make_tiny

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


def _demo(args: argparse.Namespace) -> int:
    from kvmesh import demo

    p = demo.params(
        tenants=args.tenants,
        users=args.users,
        turns=args.turns,
        concurrency=args.concurrency,
        repeats=args.repeats,
        num_blocks=args.num_blocks,
        prefix_words=args.prefix_words,
    )
    out = demo.run(model_dir=args.model, json_path=args.json, plot_path=args.plot, p=p)
    return 1 if demo.failed(out) else 0


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

    tt = bsub.add_parser("ttft", help="TTFT of a cached prompt: kvmesh vs recompute and peers")
    tt.add_argument("--quick", action="store_true", help="3 trials per length instead of 10")
    tt.add_argument("--trials", type=int, help="trials per setup and length (overrides --quick)")
    tt.add_argument("--time-budget-s", type=float, help="start no new round after this many seconds")
    tt.add_argument("--json", help="write results here")
    tt.add_argument("--plot", help="write a PNG plot here")
    tt.add_argument("--model", help="model dir (default .cache/models/bench, built if missing)")
    tt.add_argument(
        "--setups",
        help="comma-separated setups: recompute, example_connector, lmcache_mp[@CHUNK], "
        "lmcache_redis[@CHUNK], kvmesh_cpu|kvmesh_disk|kvmesh_redis[@CHUNK][+tail|-tail] "
        "(default: the peers, kvmesh at 128 without tail chunks, kvmesh out of the box); "
        "';' separates phases (groups whose workers are up at once)",
    )
    tt.add_argument("--lengths", help="comma-separated prompt lengths (default 500,1000,2000)")
    tt.add_argument("--kvmesh-config", help="JSON of kvmesh config keys for every kvmesh setup")
    tt.set_defaults(func=_bench_ttft)

    br = bsub.add_parser("router", help="vllm-router / LMCache / kvmesh routing side by side on 2 replicas")
    br.add_argument("--quick", action="store_true", help="2 turns per conversation, 1 repeat")
    br.add_argument("--json", help="write results here")
    br.add_argument("--plot", help="write a PNG plot here")
    br.add_argument("--model", help="model directory (default .cache/models/tiny, built if missing)")
    br.add_argument("--setups", help="comma-separated subset of kvmesh.bench.router_setups.SETUP_NAMES")
    br.add_argument("--workloads", help="comma-separated subset of default,held-out,trace")
    br.add_argument("--repeats", type=int, default=0, help="rounds per workload (default 2; --quick 1)")
    br.add_argument("--no-overhead", action="store_true", help="skip the router overhead and index lookup")
    br.add_argument(
        "--arrival",
        choices=["turns", "sessions"],
        default="sessions",
        help="sessions: 4 conversations active at a time, new ones starting as others end (default); "
        "turns: every conversation starts at once, first turns before second ones",
    )
    br.add_argument(
        "--prefix-words",
        type=int,
        default=0,
        help="words in each tenant's system prompt (default 250, about 1,000 tokens)",
    )
    br.set_defaults(func=_bench_router)
    gpu_cli.register(bsub)

    bd = bsub.add_parser(
        "disk", help="disk tier vs an SSD: DLWA per placement (FTL sim), write/read latency, fio"
    )
    bd.add_argument("--quick", action="store_true", help="fewer requests and cells, one round")
    bd.add_argument("--full", action="store_true", help="every trace x write mode x chunk x utilisation cell")
    bd.add_argument("--json", help="write results here")
    bd.add_argument("--plot", help="write a PNG plot here")
    bd.add_argument("--dir", help="directory on the disk to measure (default ./.cache)")
    bd.set_defaults(func=_bench_disk)
    from kvmesh.bench.scale import add_parser as add_bench_scale

    add_bench_scale(bsub)
    from kvmesh.bench.epp import register as add_bench_epp

    add_bench_epp(bsub)

    from kvmesh.bench.codecs_cli import add_parser as add_bench_codecs

    add_bench_codecs(bsub)
    from kvmesh.bench.pd import register as add_bench_pd

    add_bench_pd(bsub)

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

    from kvmesh.admin.cli import add_cache_parser
    from kvmesh.bench.soak import add_soak_parser
    from kvmesh.integrations.vllm.prewarm import add_prewarm_parser
    from kvmesh.router.cli import add_router_parser

    add_router_parser(sub)
    add_prewarm_parser(sub)
    add_cache_parser(sub)
    add_soak_parser(sub)
    from kvmesh.config_cli import register as add_config_parser

    add_config_parser(sub)
    from kvmesh.storage.cli import register as add_ftl_parser

    add_ftl_parser(sub)
    from kvmesh.sim.cli import register as add_sim_parser

    add_sim_parser(sub)
    from kvmesh.epp.cli import register as add_epp_parser

    add_epp_parser(sub)

    dm = sub.add_parser(
        "demo",
        help="plain vLLM + round-robin vs kvmesh replicas + round-robin vs kvmesh replicas + kvmesh router",
    )
    dm.add_argument("--model", default=".cache/models/tiny", help="model directory (built if missing)")
    dm.add_argument("--json", help="write the comparison here")
    dm.add_argument("--plot", help="write a PNG plot here (one panel per metric)")
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
    dm.set_defaults(func=_demo)
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
