"""The layering the harness exists for: the product never imports the harness, the benchmarks
or the demo; the benchmarks never import the demo (each checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

_CHECK = textwrap.dedent(
    """
    import importlib, sys
    import kvmesh
    mods = sys.argv[1].split(",")
    for m in mods:
        importlib.import_module(m)
    print(",".join(sorted(m for m in sys.modules if m.startswith(tuple(sys.argv[2].split(","))))))
    """
)


def _imported(modules: list[str], watch: list[str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", _CHECK, ",".join(modules), ",".join(watch)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_product_does_not_import_the_harness_the_benchmarks_or_the_demo() -> None:
    product = ["kvmesh.router.app", "kvmesh.router.server", "kvmesh.router.cli", "kvmesh.core.engine",
               "kvmesh.integrations.vllm", "kvmesh.admin.server", "kvmesh.index"]  # fmt: skip
    assert _imported(product, ["kvmesh.harness", "kvmesh.bench", "kvmesh.demo"]) == ""


def test_the_benchmarks_do_not_import_the_demo() -> None:
    bench = [f"kvmesh.bench.{m}" for m in ("common.groups", "router.bench", "ttft.bench", "ttft.spec",
             "ttft.worker", "common.peers", "router.overhead", "tiers.bench", "common.workload", "runner",
             "router.index_lookup", "cli")]  # fmt: skip
    assert _imported(bench, ["kvmesh.demo"]) == ""
