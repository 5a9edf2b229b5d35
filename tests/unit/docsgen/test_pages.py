"""The generated docs equal what the code and the benchmark JSONs give now: the config, CLI,
API and metrics references and the benchmark blocks cannot drift from what they describe."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvmesh.docsgen import bench_pages, bench_spec
from kvmesh.docsgen.__main__ import BENCH_SPEC, PAGES, expected, main

ROOT = Path(__file__).resolve().parents[3]


def test_generated_pages_match_the_code() -> None:
    stale = [
        str(path.relative_to(ROOT))
        for path, text in expected(ROOT).items()
        if not path.exists() or path.read_text() != text
    ]
    assert not stale, f"run `python -m kvmesh.docsgen` and commit: {stale}"


def test_reference_pages_cover_every_command_and_key() -> None:
    """A second look from the other side: names read from the code appear on the pages."""
    import argparse

    from kvmesh.cli import build_parser
    from kvmesh.config import CacheConfig
    from kvmesh.docsgen.cli_ref import commands
    from kvmesh.router.config import RouterConfig

    cli = (ROOT / "docs/reference/cli.md").read_text()
    for path, _, parser in commands(build_parser()):
        assert f"{' '.join(path)} {{ #" in cli or len(path) == 1, path
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert action.option_strings[0] in cli, (path, action.option_strings)
    config = (ROOT / "docs/reference/config.md").read_text()
    assert all(f"`{key}`" in config for key in CacheConfig.model_fields)
    router = (ROOT / "docs/reference/router-config.md").read_text()
    assert all(key in router for key in RouterConfig.model_fields)


def test_check_names_a_stale_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    assert main(["--check", "--root", str(tmp_path)]) == 0
    cli = tmp_path / "docs/reference/cli.md"
    cli.write_text(cli.read_text().replace("kvmesh router", "kvmesh rooter", 1))
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert "docs/reference/cli.md" in capsys.readouterr().err
    assert main(["--root", str(tmp_path)]) == 0  # writes it back
    assert main(["--check", "--root", str(tmp_path)]) == 0


def test_every_page_is_generated_somewhere_listed() -> None:
    assert all((ROOT / rel).exists() for rel in PAGES)


def test_every_served_scheme_is_documented() -> None:
    from kvmesh.tiers.base import served_schemes

    backends = (ROOT / "docs/reference/backends.md").read_text()
    missing = [s for s in served_schemes() if s not in ("mem", "faulty") and f"`{s}://" not in backends]
    assert not missing, f"docs/reference/backends.md has no row for {missing}"


def test_every_benchmark_file_is_on_a_page_and_every_target_resolves() -> None:
    pages = bench_spec.load(ROOT / BENCH_SPEC)
    data = bench_pages.BenchData(ROOT / "docs/bench", pages)
    listed = {f.json_file for s in pages.suites.values() for f in s.figures}
    listed |= {p for s in pages.suites.values() for f in s.figures for p in f.plots}
    on_disk = {p.name for p in (ROOT / "docs/bench").iterdir() if p.suffix in (".json", ".png")}
    assert not on_disk - listed, f"figures no page shows: {sorted(on_disk - listed)}"
    for name, suite in pages.suites.items():
        assert (ROOT / "docs/bench" / suite.page).exists(), suite.page
        for t in suite.targets:
            if data.json(t.json_file) is not None:
                measured, result, _ = bench_pages.target_row(data, t)
                # A JSON in docs/bench/STALE predates the code: a target it has no figure
                # for (one its suite writes only since) waits for the rerun.
                ok = (
                    ("met", "**missed**", "**to fill**")
                    if t.json_file in data.stale
                    else ("met", "**missed**")
                )
                assert result in ok, (name, t.what, measured)
