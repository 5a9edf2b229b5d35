"""``kvmesh soak``'s parser."""

from __future__ import annotations

import argparse
from typing import Any

from kvmesh.bench.soak.bench import FAULTS


def _run(args: argparse.Namespace) -> int:
    from kvmesh.bench.soak import bench

    return bench.main(args)


def register(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "soak",
        help="2 vLLM replicas + Redis + disk + router under load while faults are injected",
        description="Streaming chats through the router while replicas, Redis, the disk and the router "
        "fail; exits 1 unless every check of the verdict holds: no answer wrong, hung or failed without "
        "a retryable status and a fault to explain it, every fault injected, recovery after each, enough "
        "correct answers in every window, memory within its bound.",
    )
    p.add_argument("--model", default=".cache/models/tiny", help="model directory (built if missing)")
    p.add_argument("--minutes", type=float, default=10.0, help="length of the load (default 10)")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent streaming chats (default 16)")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}")
    p.add_argument("--hold", type=float, default=10.0, help="seconds each fault lasts (default 10)")
    p.add_argument("--deadline", type=float, default=60.0, help="a request running longer is a hang")
    p.add_argument(
        "--recovery-within",
        type=float,
        default=30.0,
        help="seconds after each fault's end within which a clean window at the old hit rate must begin "
        "(default 30; the next fault waits for it)",
    )
    p.add_argument("--json", help="write the report here")
    p.add_argument("--plot", help="write the timeline PNG here")
    p.set_defaults(func=_run)
