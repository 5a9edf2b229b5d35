"""Run each atheris target (tests/property/atheris_targets.py) for a few thousand
coverage-guided inputs in a child process: any exception but the decoder's own is a crash."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")
TARGETS = Path(__file__).with_name("atheris_targets.py")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["events", "serde", "held", "prompt", "wire"])
def test_atheris_finds_no_crash(target: str, tmp_path: Path) -> None:
    cmd = [sys.executable, str(TARGETS), target, "-runs=3000", "-max_total_time=10", "-rss_limit_mb=2048"]
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(Path(__file__).parents[2]))}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert "Done" in tail or "done" in tail.lower(), tail
