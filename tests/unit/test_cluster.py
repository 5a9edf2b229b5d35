"""Process helpers of kvmesh.cluster: pinning a process tree to cores (real processes)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from kvmesh.cluster import Replica, spawn, stop_process

# Sleep rather than read stdin: the test runner's stdin may be /dev/null (CI, nohup), and a
# parent that exits at once leaves its child to init before the test can find it.
CHILD = "import time; time.sleep(120)"


def _allowed(pid: int) -> set[int]:
    return set(os.sched_getaffinity(pid))


def _first_child(parent: int, timeout_s: float = 10.0) -> int:
    """The pid of a process whose parent is ``parent`` (read from /proc; no pgrep needed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2 :].split()[1]) == parent:
                return int(entry)
        time.sleep(0.05)
    raise TimeoutError(f"process {parent} started no child")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell pinned from not")
def test_spawn_pins_the_process_and_what_it_starts() -> None:
    core = max(os.sched_getaffinity(0))
    # the parent starts a grandchild, as vLLM's API server starts its engine core and worker
    script = (
        "import subprocess, sys; "
        f"c = subprocess.Popen([sys.executable, '-c', {CHILD!r}]); "
        "import time; time.sleep(120)"
    )
    proc = spawn([sys.executable, "-c", script], dict(os.environ), cpus={core})
    try:
        assert _allowed(proc.pid) == {core}
        child = _first_child(proc.pid)
        assert _allowed(child) == {core}
    finally:
        stop_process(proc)  # the whole process group: the grandchild too
    free = spawn([sys.executable, "-c", CHILD], dict(os.environ))
    try:
        assert _allowed(free.pid) == set(os.sched_getaffinity(0))  # not pinned unless asked
    finally:
        stop_process(free)


def test_replica_pins_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[set[int] | None] = []

    def fake_spawn(
        args: list[str], env: dict[str, str], log_path: str | None = None, cpus: set[int] | None = None
    ) -> None:
        seen.append(cpus)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"

    monkeypatch.setattr("kvmesh.cluster.spawn", fake_spawn)
    Replica("model", cpu=1).start()
    Replica("model", cpu=1, pin_process=True).start()
    assert seen == [None, {1}]


def test_free_ports_are_not_handed_out_twice() -> None:
    from kvmesh.services import free_port

    ports = [free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
