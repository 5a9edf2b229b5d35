"""The docs site: it builds with ``mkdocs build --strict`` (mkdocs-material, a dev extra), the
strict build really fails on a broken link or anchor, and the README stays a front page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(config),
            "--site-dir",
            str(site),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_site_builds_strict(tmp_path: Path) -> None:
    out = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stdout + out.stderr
    for page in (
        "index.html",
        "reference/cli/index.html",
        "reference/config/index.html",
        "bench/router/index.html",
    ):
        assert (tmp_path / "site" / page).is_file(), page
    # The figures travel with their pages.
    assert (tmp_path / "site" / "bench" / "tiers.png").is_file()
    assert (tmp_path / "site" / "bench" / "tiers.json").is_file()


def test_strict_build_fails_on_a_broken_link_or_anchor(tmp_path: Path) -> None:
    """The validation settings of mkdocs.yml are what catch these: a site that inherits them
    and has one broken anchor and one link to a missing page must not build."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[there](other.md#no-such-heading) and [gone](missing.md)\n")
    (docs / "other.md").write_text("# Other\n\n## A heading\n")
    config = tmp_path / "mkdocs.yml"
    nav = "nav:\n  - index.md\n  - other.md\n"
    config.write_text(f"INHERIT: {ROOT / 'mkdocs.yml'}\ndocs_dir: {docs}\n{nav}")
    out = _build(config, tmp_path / "site")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "no-such-heading" in text and "missing.md" in text, text


def test_readme_is_a_front_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert "make demo" in text and "make test" in text
    # GitHub renders the README, mkdocs does not see it: its relative links are checked here.
    for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
    assert not (ROOT / "docs" / "readme-parts").exists()
