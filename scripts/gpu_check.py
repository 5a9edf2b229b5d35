#!/usr/bin/env python3
"""The kvmesh connector's host-device path on one GPU, without vLLM (issue #14).

Needs torch (CUDA), numpy and xxhash; run from a kvmesh checkout::

    PYTHONPATH=. python scripts/gpu_check.py --json gpu.json --plot gpu.png

Checks that every page-layout adapter round-trips exactly on CUDA, measures store
(gather + D2H) and retrieve (H2D + scatter) GB/s of a llama-8b-shaped 32 MiB chunk against
torch's pinned ``copy_`` of the same bytes (target >= 0.8x), and the compute-stream slowdown
while 2,000 tokens' blocks are saved (target <= 5%). Exit status: 0 all targets met (or no
CUDA: skipped), 1 a target missed. Took 7-11 s on an H200 (4 December 2026; figures in
docs/bench/gpu.md). It also checks the pool's registration against the real CUDA runtime
and four concurrent savers; a part that raises is reported and the others still run.
Same as ``kvmesh bench gpu``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's kvmesh

from kvmesh.bench.gpu.bench import run
from kvmesh.bench.gpu.cli import add_arguments


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    args = parser.parse_args()
    return run(args.quick, args.json, args.plot)


if __name__ == "__main__":
    sys.exit(main())
