"""``kvmesh model make-tiny``: the random-weight test models (:mod:`kvmesh.harness.model`)."""

from __future__ import annotations

import argparse
import os
from typing import Any


def register(sub: argparse._SubParsersAction[Any]) -> None:
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
    mt.set_defaults(func=_make_tiny)
    ml = msub.add_parser(
        "make-tiny-lora", help="write a random LoRA adapter (peft format, q_proj/v_proj) for a tiny model"
    )
    ml.add_argument("--base", required=True, help="the tiny model's directory")
    ml.add_argument("--out", required=True)
    ml.add_argument("--seed", type=int, default=0, help="another seed, another adapter")
    ml.add_argument("--rank", type=int, default=8, help="LoRA rank (vLLM: --max-lora-rank >= this)")
    ml.add_argument("--alpha", type=int, default=16)
    ml.set_defaults(func=_make_tiny_lora)


def _make_tiny(args: argparse.Namespace) -> int:
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


def _make_tiny_lora(args: argparse.Namespace) -> int:
    from kvmesh.harness.model import make_tiny_lora

    path = make_tiny_lora(args.base, args.out, seed=args.seed, rank=args.rank, alpha=args.alpha)
    print(f"wrote LoRA adapter to {path}")
    return 0
