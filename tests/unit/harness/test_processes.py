"""Services with a health check, and the log excerpts their errors quote (real processes)."""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvmesh.errors import ProcessError
from kvmesh.harness.ports import free_port
from kvmesh.harness.processes import (
    Service,
    crash,
    get_json,
    group_members,
    log_tail,
    own_tmp,
    spawn,
    stop_process,
)


class _HttpService(Service):
    """``python -m http.server`` on a free port: ready when it answers."""

    name = "http.server"

    def __init__(self, args: list[str] | None = None, log_path: str | None = None) -> None:
        self.port = free_port()
        cmd = args or [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(self.port)]
        super().__init__(cmd, dict(os.environ), log_path)

    def ready(self) -> bool:
        return get_json(f"http://127.0.0.1:{self.port}/", 1.0)[0] == 200


def test_service_waits_for_its_health_check_and_stops(tmp_path: Path) -> None:
    with _HttpService() as svc:
        svc.start(timeout=30)
        assert svc.proc is not None and svc.proc.poll() is None
        status, body = get_json(f"http://127.0.0.1:{svc.port}/", 2.0)
        assert status == 200 and body is None  # a directory listing: not JSON
        proc = svc.proc
    assert proc.poll() is not None and svc.proc is None


def test_a_service_that_exits_is_a_process_error_quoting_its_log(tmp_path: Path) -> None:
    log = str(tmp_path / "svc.log")
    script = "import sys; print('starting'); print('ValueError: port 0 is taken', flush=True); sys.exit(3)"
    svc = _HttpService([sys.executable, "-c", script], log)
    with pytest.raises(ProcessError, match=r"exited with code 3: .*ValueError: port 0 is taken"):
        svc.start(timeout=30)


def test_a_service_that_never_gets_ready_times_out_and_is_stopped(tmp_path: Path) -> None:
    svc = _HttpService([sys.executable, "-c", "import time; time.sleep(60)"], str(tmp_path / "x.log"))
    with pytest.raises(TimeoutError, match="not ready within 1 s"):
        svc.start(timeout=1)
    assert svc.proc is None


def test_log_tail_prefers_error_lines(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("INFO start\nValueError: Connector X does not support HMA\nINFO more\n")
    assert log_tail(str(log)) == "ValueError: Connector X does not support HMA"
    log.write_text("one\ntwo\nthree\n")
    assert log_tail(str(log), limit=2) == "two | three"  # no error line: the last lines
    assert log_tail(str(tmp_path / "missing.log")) == ""
    assert log_tail(None) == ""


def test_a_child_with_a_tmp_of_its_own_leaves_nothing_behind_when_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What vLLM does when it is killed, not shut down (a real child: a unix socket bound in
    ``VLLM_RPC_BASE_PATH`` and a file in its temporary directory, then it hangs): the
    directory goes with the child."""
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    env, tmp = own_tmp(dict(os.environ), prefix="kvmesh-test-")
    shared = env["TORCHINDUCTOR_CACHE_DIR"]  # torch's compile cache, shared: a link to it
    link = os.path.join(tmp, f"torchinductor_{getpass.getuser()}")
    assert env["TMPDIR"] == env["VLLM_RPC_BASE_PATH"] == tmp and os.listdir(tmp) == [os.path.basename(link)]
    assert os.path.islink(link) and os.path.realpath(link) == os.path.realpath(shared)
    ready = tmp_path / "ready"
    script = (
        "import os, socket, tempfile, time\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.bind(os.path.join(os.environ['VLLM_RPC_BASE_PATH'], 'engine'))\n"
        "open(os.path.join(tempfile.gettempdir(), 'vllm_dist_x'), 'w').close()\n"
        f"open({str(ready)!r}, 'w').close(); time.sleep(60)\n"
    )
    proc = spawn([sys.executable, "-c", script], env, tmp=tmp)
    for _ in range(300):
        if ready.exists():
            break
        time.sleep(0.05)
    assert sorted(os.listdir(tmp)) == sorted(["engine", "vllm_dist_x", os.path.basename(link)])
    stop_process(proc, timeout=1)  # SIGTERM: the socket stays behind, as vLLM's do
    assert proc.poll() is not None and not os.path.exists(tmp)
    assert os.path.isdir(shared)  # the link went, not what it points at


def test_torch_in_a_child_with_its_own_tmp_finds_the_shared_compile_cache() -> None:
    """torch keeps its C++ precompiled headers under ``default_cache_dir()``, which follows
    the temporary directory, not ``TORCHINDUCTOR_CACHE_DIR``; a fresh one cost every
    replica's first sampled request ~6 s of g++. A real child importing torch resolves it
    to the shared cache."""
    pytest.importorskip("torch")
    env, tmp = own_tmp(dict(os.environ))
    try:
        code = "import os; from torch._inductor.runtime.cache_dir_utils import default_cache_dir as d; "
        code += "print(os.path.realpath(d()))"
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == os.path.realpath(env["TORCHINDUCTOR_CACHE_DIR"])
    finally:
        shutil.rmtree(tmp)


def test_own_tmp_keeps_a_socket_path_and_a_compile_cache_the_caller_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/run/vllm")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    env, tmp = own_tmp(dict(os.environ))
    try:
        assert env["VLLM_RPC_BASE_PATH"] == "/run/vllm" and env["TMPDIR"] == tmp
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
        link = os.path.join(tmp, f"torchinductor_{getpass.getuser()}")  # where torch's headers go
        assert os.path.realpath(link) == str(tmp_path / "inductor")
    finally:
        shutil.rmtree(tmp)


_LEADER = """\
import multiprocessing as mp, sys, time
from multiprocessing import shared_memory
def child(path):
    shm = shared_memory.SharedMemory(create=True, size=1 << 20)
    open(path, 'w').write(shm.name)
    time.sleep(60)
if __name__ == '__main__':
    mp.get_context('spawn').Process(target=child, args=(sys.argv[1],)).start()
    time.sleep(60)
"""


def _leader_with_shared_memory(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """vLLM's shape, with real processes: a leader spawns (``multiprocessing``, spawn start
    method) a child that creates shared memory, registered with the resource tracker the
    leader started. Returns the leader and the segment's file."""
    name_file, main = tmp_path / "name", tmp_path / "leader.py"
    main.write_text(_LEADER)  # a file: the spawned child imports the leader's main module
    proc = spawn([sys.executable, str(main), str(name_file)], dict(os.environ))
    for _ in range(600):
        if name_file.exists() and name_file.read_text():
            break
        time.sleep(0.05)
    segment = Path("/dev/shm") / name_file.read_text().lstrip("/")
    assert segment.exists()
    return proc, segment


def test_a_killed_leader_s_children_still_get_their_shared_memory_unlinked(tmp_path: Path) -> None:
    """A test SIGKILLs the leader (a dead replica); stopping it later must let the tracker,
    which ignores SIGTERM, outlive the child and unlink the segment — the group SIGKILLed at
    once left /dev/shm/psm_* behind."""
    proc, segment = _leader_with_shared_memory(tmp_path)
    proc.kill()  # the leader only
    proc.wait(5)
    stop_process(proc, timeout=5)
    assert not segment.exists(), f"{segment} left behind"


def test_crash_kills_all_but_the_resource_tracker_which_then_unlinks_what_they_left(tmp_path: Path) -> None:
    """Crashed as a test crashes a replica: every process gone at once but the tracker,
    which unlinks the child's segment."""
    proc, segment = _leader_with_shared_memory(tmp_path)
    members = set(group_members(proc.pid))
    assert len(members) == 3 and proc.pid in members  # leader, tracker, child
    crash(proc)
    assert proc.wait(5) == -signal.SIGKILL
    for _ in range(200):  # the tracker: EOF from its clients, the unlink, then its exit
        if not group_members(proc.pid):
            break
        time.sleep(0.05)
    assert not group_members(proc.pid) and not segment.exists()
    stop_process(proc, timeout=1)


def test_own_tmp_under_a_long_temporary_directory_stays_short_enough_for_a_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's socket paths (the directory and a uuid4) must fit a unix socket's 107 bytes;
    under a deep temporary directory (pytest's own) the directory goes under /tmp."""
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    env, tmp = own_tmp({}, prefix="kvmesh-vllm-")
    try:
        assert os.path.dirname(tmp) == "/tmp"
        assert len(os.path.join(env["VLLM_RPC_BASE_PATH"], "fb4e5907-d57c-4d10-a2ba-7ab8563e1511")) <= 107
    finally:
        shutil.rmtree(tmp)
    short = tempfile.mkdtemp(prefix="kt-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", short)  # short enough: it stays there
    try:
        _, tmp = own_tmp({}, prefix="kvmesh-vllm-")
        assert os.path.dirname(tmp) == short
    finally:
        shutil.rmtree(short)
