"""kvmesh's threads leave the cores vLLM-CPU binds its worker to (cpus.py), checked in a
real child process bound the way vLLM-CPU binds its worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import os, threading
os.sched_setaffinity(0, {0})  # as vLLM-CPU binds its worker to its OpenMP cores
from kvmesh.integrations.vllm.cpus import background_cpus, background_thread, spawning_background_threads
got = {}
def probe():
    background_thread()
    got["thread"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=probe); t.start(); t.join()
with spawning_background_threads():
    inner = threading.Thread(target=lambda: got.setdefault("spawned", sorted(os.sched_getaffinity(0))))
    inner.start(); inner.join()
print(sorted(background_cpus()), got["thread"], got["spawned"], sorted(os.sched_getaffinity(0)))
"""


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable cores"
)
def test_background_threads_run_on_the_cores_the_worker_is_not_bound_to() -> None:
    others = sorted(os.sched_getaffinity(0) - {0})
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("] ")[0] + "]" == str(others)
    # a background thread, a thread spawned inside the block, the caller's own binding after
    assert done.stdout.strip() == f"{others} {others} {others} [0]"
