"""``git_commit``: every benchmark's JSON names the commit it measured, read from git."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from kvmesh.bench import report


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_commit_names_this_checkout() -> None:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=report.REPO_ROOT, capture_output=True, text=True
    )
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    got = report.git_commit()
    assert got is not None and re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?", got), got
    assert got.split("+")[0] == head.stdout.strip()


def test_git_commit_is_none_outside_a_checkout(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setattr(report, "REPO_ROOT", tmp_path)
    assert report.git_commit() is None
