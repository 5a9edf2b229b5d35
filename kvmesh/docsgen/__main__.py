"""``python -m kvmesh.docsgen [--check] [--root DIR]``: write the generated docs, or check them."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvmesh.docsgen import api_ref, bench_pages, bench_spec, cli_ref, config_ref, metrics_ref
from kvmesh.docsgen.markdown import block_names, fill_blocks

ROOT = Path(__file__).resolve().parents[2]
# Whole pages, regenerated from the code.
PAGES: dict[str, Callable[[], str]] = {
    "docs/reference/config.md": config_ref.cache_page,
    "docs/reference/router-config.md": config_ref.router_page,
    "docs/reference/cli.md": cli_ref.cli_page,
    "docs/reference/admin-api.md": api_ref.admin_page,
    "docs/reference/controller-api.md": api_ref.controller_page,
    "docs/reference/metrics.md": metrics_ref.metrics_page,
}
BENCH_SPEC = "docs/bench/pages.yaml"


@contextmanager
def _plain_environment() -> Iterator[None]:
    """No ``KVMESH_*`` variables while the pages are built: some CLI defaults read them, and
    the pages must say what a fresh shell gets."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("KVMESH_")}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def _block_bodies(root: Path) -> dict[str, str]:
    data = bench_pages.BenchData(root / "docs/bench", bench_spec.load(root / BENCH_SPEC))
    bodies = {"bench/overview": bench_pages.overview_block(data)}
    bodies["readme/headline"] = bench_pages.headline_block(data, "docs/bench/")
    for name in data.pages.suites:
        bodies[f"bench/{name}"] = bench_pages.suite_block(data, name)
    return bodies


def _hand_written(root: Path) -> list[Path]:
    """Pages with generated blocks: the README and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def expected(root: Path = ROOT) -> dict[Path, str]:
    """Every generated page and every page with generated blocks, as the code makes them now."""
    out: dict[Path, str] = {}
    with _plain_environment():
        for rel, make in PAGES.items():
            text = make()
            out[root / rel] = text if text.endswith("\n") else text + "\n"
    bodies = _block_bodies(root)
    for path in _hand_written(root):
        if path in out or not path.exists():
            continue
        text = path.read_text()
        if block_names(text):
            out[path] = fill_blocks(text, bodies)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmesh.docsgen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs; write nothing")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this checkout)")
    args = parser.parse_args(argv)
    stale = []
    for path, text in expected(args.root).items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        rel = path.relative_to(args.root)
        print(f"{'differs' if args.check else 'wrote'}: {rel}", file=sys.stderr if args.check else sys.stdout)
    if args.check and stale:
        print("run `python -m kvmesh.docsgen` (or `make docs`) and commit the pages", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
