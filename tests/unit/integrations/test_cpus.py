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


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable cores"
)
def test_an_explicit_vllm_binding_keeps_the_threads_on_the_workers_cores() -> None:
    """Two replicas bound to a core each (VLLM_CPU_OMP_THREADS_BIND=0 and =1): the core this
    worker is not bound to is the other replica's, so nothing moves there."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_OMP_THREADS_BIND": "0"}
    env.pop("KVMESH_BACKGROUND_CPUS", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] [0] [0] [0]"


def test_the_override_and_vllms_binding_decide_the_background_cores() -> None:
    from kvmesh.integrations.vllm.cpus import _decide

    assert _decide({"KVMESH_BACKGROUND_CPUS": "off"}) == frozenset()
    assert _decide({"KVMESH_BACKGROUND_CPUS": "2,4-5"}) == {2, 4, 5}
    assert _decide({"KVMESH_BACKGROUND_CPUS": "3", "VLLM_CPU_OMP_THREADS_BIND": "0"}) == {3}
    assert _decide({"VLLM_CPU_OMP_THREADS_BIND": "0-3"}) == frozenset()
    assert _decide({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == frozenset()
    # auto (vLLM's own binding, or none): the parent's cores minus this thread's
    auto = frozenset(os.sched_getaffinity(os.getppid()) - os.sched_getaffinity(0))
    assert _decide({}) == auto == _decide({"VLLM_CPU_OMP_THREADS_BIND": "auto"})
    assert _decide({"KVMESH_BACKGROUND_CPUS": "cores please"}) == auto  # warned, then auto


@pytest.mark.parametrize("bad", ["", "a", "3-1", "-1", "1,,2"])
def test_a_core_list_that_is_not_one_is_refused(bad: str) -> None:
    from kvmesh.integrations.vllm.cpus import parse_cpus

    with pytest.raises(ValueError):
        parse_cpus(bad)
