"""Child processes of the harness: started in their own process group, tracked, and stopped
(the whole group) on exit, on Ctrl-C and on SIGTERM; a :class:`Service` is a child that is
ready when its health check says so."""

from __future__ import annotations

import atexit
import contextlib
import getpass
import http.client
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from kvmesh.errors import ProcessError

_LIVE: list[subprocess.Popen[bytes]] = []
# pid -> the temporary directory of a child started with one of its own (:func:`own_tmp`),
# removed when stop_process ends the child
_TMP: dict[int, str] = {}
# A unix socket's path: at most 107 bytes (sun_path); vLLM names its sockets by a uuid4 (36),
# and mkdtemp adds a separator, 8 random characters and another separator
_SUN_PATH = 107
_SOCKET_NAME = 1 + 8 + 1 + 36
# How long stop_process waits for a group's resource tracker to clean up after its clients
DRAIN_S = 3.0


def _stop_all() -> None:
    for proc in list(_LIVE):
        stop_process(proc)


atexit.register(_stop_all)


def _wait_group_gone(pgid: int, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for every process of group ``pgid`` to exit (a zombie
    has: it waits for init to reap it, which here took ~1.5 s)."""
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.01)


def stop_process(proc: subprocess.Popen[Any], timeout: float = 15.0) -> None:
    """SIGTERM the process group ``proc`` leads (started in a new session), then SIGKILL
    what is left of it — also the children of a leader that has already exited.

    Python's ``multiprocessing`` resource tracker, the one member spared
    (:func:`crash`), then gets up to :data:`DRAIN_S` (milliseconds once its clients are
    gone) to unlink the shared memory and semaphores they left behind
    (vLLM's message-queue buffers, /dev/shm/psm_*, up to 250 MB each) and exit. It ignores
    SIGTERM for that; SIGKILLed with the group, it left them in /dev/shm."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)  # a dead leader's children too
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    crash(proc)
    proc.wait(5)
    _wait_group_gone(proc.pid, DRAIN_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc in _LIVE:
        _LIVE.remove(proc)
    tmp = _TMP.pop(proc.pid, None)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)


def group_members(pgid: int) -> list[int]:
    """The live processes of group ``pgid``, zombies left out (Linux: /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


def crash(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL every process of the group ``proc`` leads but Python's ``multiprocessing``
    resource tracker: a crash as the node sees it (a replica's processes gone mid-step, no
    handler run). The tracker outlives them, as it would any crash it did not share, and
    unlinks the shared memory they left (vLLM's /dev/shm/psm_* buffers); SIGKILLed with the
    group, it left them in /dev/shm, where they outlive the test. Reap with
    :func:`stop_process`."""
    for pid in group_members(proc.pid):
        try:
            if b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone meanwhile
            continue


def own_tmp(env: dict[str, str], prefix: str = "kvmesh-proc-") -> tuple[dict[str, str], str]:
    """``env`` with a new temporary directory of the child's own (``TMPDIR``), and
    that directory: pass both to :func:`spawn`, or :func:`track_tmp` for a child started
    otherwise, and :func:`stop_process` removes it with the child.

    For vLLM: its ZMQ sockets (``VLLM_RPC_BASE_PATH``, default the temporary directory) and
    its workers' rendezvous file (``vllm_dist_*``) are left behind whenever it is killed,
    not shut down — a few dozen a replica, thousands in /tmp after a day of tests. A
    ``VLLM_RPC_BASE_PATH`` the caller set stays. Under a temporary directory too long for
    a socket's path, it goes under /tmp. torch's compile cache stays shared."""
    base = tempfile.gettempdir()
    if len(base) + len(prefix) + _SOCKET_NAME > _SUN_PATH:  # vLLM's sockets would not bind there
        base = "/tmp"
    tmp = tempfile.mkdtemp(prefix=prefix, dir=base)
    out = dict(env)
    with contextlib.suppress(KeyError, OSError):  # no user name: torch's own default then
        # torch's compile cache, and the C++ precompiled headers it keeps under the temporary
        # directory whatever TORCHINDUCTOR_CACHE_DIR says (a new set costs a replica's first
        # sampled request ~6 s of g++), stay shared: a link
        default = torch_cache_dir()
        cache = out.setdefault("TORCHINDUCTOR_CACHE_DIR", default)
        os.makedirs(cache, exist_ok=True)
        os.symlink(cache, os.path.join(tmp, os.path.basename(default)))
    out["TMPDIR"] = tmp
    out.setdefault("VLLM_RPC_BASE_PATH", tmp)
    return out, tmp


def torch_cache_dir() -> str:
    """torch's default compile cache, ``default_cache_dir()`` (not imported here: the
    harness does not load torch): ``torchinductor_<user>`` in the temporary directory.
    KeyError or OSError where there is no user name."""
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")


@contextlib.contextmanager
def own_tmp_env(env: dict[str, str], prefix: str = "kvmesh-proc-") -> Iterator[dict[str, str]]:
    """:func:`own_tmp` for a child that ends inside the block (``subprocess.run``): its
    directory is removed when the block ends."""
    out, tmp = own_tmp(env, prefix)
    try:
        yield out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def track_tmp(proc: subprocess.Popen[Any], tmp: str) -> None:
    """Remove ``tmp`` (from :func:`own_tmp`) when :func:`stop_process` stops ``proc``."""
    _TMP[proc.pid] = tmp


def spawn(
    args: list[str],
    env: dict[str, str],
    log_path: str | None = None,
    cpus: set[int] | None = None,
    tmp: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``args`` in a new process group, tracked for cleanup; ``cpus``: the cores it and
    every process it starts may run on (default: any); ``tmp``: its own temporary directory
    (:func:`own_tmp`), removed when it is stopped.

    The pin is the forking thread's own, lent for the fork: a child inherits its creator's
    affinity, so it starts pinned, with no window before exec. Not ``preexec_fn``, which
    Python documents as unsafe with threads: it runs Python (every ``os.register_at_fork``
    child hook) in the forked child, and the harness forks from worker threads (the soak's
    fault injector restarts replicas beside its load and RSS sampler)."""
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    own = os.sched_getaffinity(0) if cpus is not None else None
    try:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)  # 0: this thread only (Linux), until the fork is done
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        if own is not None:
            os.sched_setaffinity(0, own)
    _LIVE.append(proc)
    if tmp is not None:
        track_tmp(proc, tmp)
    return proc


def install_signal_handlers() -> None:
    """Turn SIGTERM into a clean exit so ``atexit`` stops every child."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


_ERROR_MARKS = ("Error", "error:", "Exception", "Traceback", "raise ", "failed", "panicked")


def log_tail(path: str | None, limit: int = 6, chars: int = 1500) -> str:
    """The last ``limit`` lines of a log that look like an error (else its last lines), for
    a message that says why a child failed; ``""`` when there is no log."""
    if not path:
        return ""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    hits = [ln.strip() for ln in lines if any(k in ln for k in _ERROR_MARKS)]
    return " | ".join((hits or lines)[-limit:])[-chars:]


def get_json(url: str, timeout: float = 2.0) -> tuple[int, Any]:
    """``GET url``: the status and the JSON body (``None`` if it is not JSON). Connection
    errors raise (OSError): a health check treats them as "not up yet"."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read()
            status = int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code, None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


class Service:
    """A spawned process that is ready when :meth:`ready` says so (subclasses ask its
    health endpoint); :meth:`start` waits for that, :meth:`stop` ends its process group."""

    name = "service"

    def __init__(self, args: list[str], env: dict[str, str], log_path: str | None) -> None:
        self.args, self.env, self.log_path = args, env, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = 120.0) -> Self:
        self.proc = spawn(self.args, self.env, self.log_path)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise ProcessError(f"{self.name} exited with code {code}: {log_tail(self.log_path)}")
            try:
                if self.ready():
                    return self
            except (OSError, http.client.HTTPException):  # not listening yet, or not HTTP there yet
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"{self.name} was not ready within {timeout:.0f} s: {log_tail(self.log_path)}"
                )
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
