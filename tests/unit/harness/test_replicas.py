"""kvmesh.harness.replicas and .processes: pinning a process tree to cores (real processes),
the replicas' vLLM command lines."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvmesh.harness.processes import spawn, stop_process
from kvmesh.harness.replicas import Replica, start_replicas_on

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


_FORKED: dict[str, str] = {}


def _mark_forked_child() -> None:
    if path := _FORKED.get("path"):
        with open(path, "w") as f:
            f.write("python ran in the forked child")


os.register_at_fork(after_in_child=_mark_forked_child)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell pinned from not")
def test_spawn_from_a_thread_runs_no_python_in_the_fork_and_keeps_the_threads_cores(tmp_path: Path) -> None:
    """No Python runs between fork and exec (``preexec_fn`` would, which Python documents as
    unsafe with threads), and the thread that spawned keeps its own cores."""
    core = max(os.sched_getaffinity(0))
    got: dict[str, Any] = {}

    def start() -> None:
        before = os.sched_getaffinity(0)
        got["proc"] = spawn([sys.executable, "-c", CHILD], dict(os.environ), cpus={core})
        got["kept"] = os.sched_getaffinity(0) == before

    _FORKED["path"] = str(tmp_path / "forked")
    try:
        t = threading.Thread(target=start)
        t.start()
        t.join(30)
    finally:
        _FORKED.clear()
    try:
        assert _allowed(got["proc"].pid) == {core} and got["kept"]
        assert not (tmp_path / "forked").exists()
    finally:
        stop_process(got["proc"])


def test_replica_pins_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[set[int] | None] = []

    def fake_spawn(
        args: list[str],
        env: dict[str, str],
        log_path: str | None = None,
        cpus: set[int] | None = None,
        tmp: str | None = None,
    ) -> None:
        seen.append(cpus)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
        # vLLM's sockets go to a directory of the replica's own, removed at stop_process
        assert tmp is not None and env["TMPDIR"] == env["VLLM_RPC_BASE_PATH"] == tmp
        shutil.rmtree(tmp)

    monkeypatch.setattr("kvmesh.harness.replicas.spawn", fake_spawn)
    Replica("model", cpu=1).start()
    Replica("model", cpu=1, pin_process=True).start()
    assert seen == [None, {1}]


def test_replica_command_gets_the_extra_arguments() -> None:
    r = Replica("/m", port=1234, extra_args=["--enable-scale-out"])
    cmd = r.command()
    assert cmd[-1] == "--enable-scale-out"
    assert "--enable-prefix-caching" in cmd  # the fairness settings stay
    # kvmesh implements SupportsHMA: vLLM's hybrid KV cache manager stays on (#26)
    assert "--disable-hybrid-kv-cache-manager" not in cmd
    assert cmd[cmd.index("--port") + 1] == "1234" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "--kv-events-config" not in cmd and "--kv-transfer-config" not in cmd


def test_replica_events_are_read_from_the_forwarder() -> None:
    r = Replica("/m", port=1234, events_port=5000, events_out=6000)
    assert r.events_endpoint == "tcp://127.0.0.1:6000"
    cmd = r.command()
    cfg = cmd[cmd.index("--kv-events-config") + 1]
    assert '"endpoint": "tcp://127.0.0.1:5000"' in cfg  # vLLM connects to the forwarder
    assert Replica("/m", port=1, events_port=5000).events_endpoint == "tcp://127.0.0.1:5000"
    assert Replica("/m", port=1, events_ipc="ipc:///tmp/e").events_endpoint == "ipc:///tmp/e"


def test_start_replicas_on_stops_every_replica_when_one_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fakes for the vLLM processes (fault injection: the second replica never becomes ready)."""
    events: list[str] = []
    reps = [Replica("m", name=f"r{i}") for i in range(2)]
    monkeypatch.setattr(Replica, "start", lambda self: events.append(f"start {self.name}") or self)
    monkeypatch.setattr(Replica, "stop", lambda self: events.append(f"stop {self.name}"))

    def ready(self: Replica, timeout: float) -> None:
        if self.name == "r1":
            raise TimeoutError("r1 not ready")

    monkeypatch.setattr(Replica, "wait_ready", ready)
    with pytest.raises(TimeoutError), contextlib.ExitStack() as stack:
        start_replicas_on(stack, reps)
    assert events == ["start r0", "start r1", "stop r1", "stop r0"]
    events.clear()
    monkeypatch.setattr(Replica, "wait_ready", lambda self, timeout: None)
    with contextlib.ExitStack() as stack:
        assert start_replicas_on(stack, reps) >= 0.0
        assert events == ["start r0", "start r1"]
    assert events[2:] == ["stop r1", "stop r0"]


def test_the_suites_replicas_dump_their_stacks_on_a_stall_and_a_benchmarks_do_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvmesh.harness import replicas

    monkeypatch.delenv("KVMESH_STALL_DUMP_S", raising=False)
    assert replicas.vllm_env()["KVMESH_STALL_DUMP_S"] == "3"  # tests/conftest.py
    monkeypatch.setattr(replicas, "STALL_DUMP_S", None)  # as a benchmark runs it
    assert "KVMESH_STALL_DUMP_S" not in replicas.vllm_env()
