"""The processes ``kvmesh bench router`` puts around the vLLM replicas: vllm-router, one
``lmcache server`` per replica, and the kvmesh router in its own process.

Each is started in its own process group through :func:`kvmesh.cluster.spawn` (so it is
stopped on exit like the replicas), listens on loopback only, and is waited for until it
answers its health check. The command builders are pure and unit-tested.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from kvmesh.cluster import spawn, stop_process
from kvmesh.errors import ProcessError
from kvmesh.services import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_ROUTER_VERSION = "0.1.17"
VLLM_ROUTER_ENV = "KVMESH_VLLM_ROUTER"  # path of a vllm-router binary (overrides the venv)
VLLM_ROUTER_POLICIES = ("round_robin", "cache_aware", "kv_aware")
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}

# The kvmesh router in its own process, like vllm-router: sharing the benchmark client's
# interpreter would put the client's work on the router's latency.
_KVMESH_ROUTER = """
import sys
from kvmesh.router.app import RouterService
from kvmesh.router.config import RouterConfig
from kvmesh.router.server import run_forever
run_forever(RouterService(RouterConfig.model_validate_json(sys.argv[1])))
"""


def vllm_router_venv() -> Path:
    return REPO_ROOT / ".cache" / "peers-vllm-router"


def vllm_router_binary() -> str:
    """Path of the ``vllm-router`` executable; raises FileNotFoundError with the fix."""
    override = os.environ.get(VLLM_ROUTER_ENV)
    candidates = [override] if override else [str(vllm_router_venv() / "bin" / "vllm-router")]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    found = shutil.which("vllm-router")
    if found and not override:
        return found
    raise FileNotFoundError(
        f"vllm-router {VLLM_ROUTER_VERSION} is not installed (looked for {candidates[0]}): "
        "run scripts/install_peers.sh, or set KVMESH_VLLM_ROUTER to its binary"
    )


def vllm_router_command(
    binary: str,
    port: int,
    worker_urls: Sequence[str],
    policy: str,
    event_sources: Mapping[str, str] | None = None,
    block_size: int = 128,
    model_name: str = "tiny",
) -> list[str]:
    """The vllm-router command line (PEERS.md recipe); ``event_sources`` maps a worker URL
    to its vLLM KV-event ZMQ endpoint (needed by ``kv_aware`` only)."""
    if policy not in VLLM_ROUTER_POLICIES:
        raise ValueError(f"unknown vllm-router policy {policy!r}; valid: {', '.join(VLLM_ROUTER_POLICIES)}")
    if not worker_urls:
        raise ValueError("vllm-router needs at least one worker URL")
    args = [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", policy, "--log-level", "warning"]  # fmt: skip
    if policy == "kv_aware":
        missing = [u for u in worker_urls if not (event_sources or {}).get(u)]
        if missing:
            raise ValueError(f"kv_aware needs a KV-event endpoint for every worker; missing: {missing}")
        for url in worker_urls:
            args += ["--kv-event-source", f"{url}={(event_sources or {})[url]}"]
        args += ["--kv-event-block-size", str(block_size), "--kv-event-model", model_name]
    return args


def lmcache_server_command(
    python: str, port: int, http_port: int, shm_name: str, l1_size_gb: float = 1.0
) -> list[str]:
    """``lmcache server`` on loopback (PEERS.md recipe; ``auto`` transfer mode is required)."""
    return [python, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(port),
            "--http-host", "127.0.0.1", "--http-port", str(http_port), "--l1-size-gb", f"{l1_size_gb:g}",
            "--chunk-size", "256", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
            "--shm-name", shm_name]  # fmt: skip


def with_pythonpath(path: str | None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``path`` put first on PYTHONPATH."""
    out = dict(os.environ if env is None else env)
    if path:
        out["PYTHONPATH"] = os.pathsep.join(p for p in (path, out.get("PYTHONPATH", "")) if p)
    return out


def log_tail(path: str | None, limit: int = 6) -> str:
    """The last lines of a log that look like an error (else its last lines)."""
    if not path:
        return ""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keys = ("Error", "error:", "Exception", "Traceback", "failed", "panicked")
    hits = [ln.strip() for ln in lines if any(k in ln for k in keys)]
    return " | ".join((hits or lines)[-limit:])[-1200:]


def _get_json(url: str, timeout: float = 2.0) -> tuple[int, Any]:
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


class EventForwarder:
    """Receives a vLLM replica's KV events on ``tcp://127.0.0.1:in_port`` (bound here; vLLM's
    publisher connects to a non-wildcard endpoint) and republishes them, loopback only, on
    ``tcp://127.0.0.1:out_port`` for any number of subscribers that connect.

    A ZMQ XSUB/XPUB proxy on a daemon thread: subscriptions flow upstream, events downstream,
    without the GIL (``zmq.proxy_steerable`` runs in libzmq).
    """

    def __init__(self) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._xsub = self._ctx.socket(zmq.XSUB)
        self._xpub = self._ctx.socket(zmq.XPUB)
        self._ctl = self._ctx.socket(zmq.PAIR)
        self._ctl_addr = f"inproc://kvmesh-events-ctl-{id(self)}"
        self._ctl.bind(self._ctl_addr)
        self.in_port = self._xsub.bind_to_random_port("tcp://127.0.0.1")
        self.out_port = self._xpub.bind_to_random_port("tcp://127.0.0.1")
        self._thread = threading.Thread(target=self._run, name="kv-event-forwarder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        ctl = self._ctx.socket(zmq.PAIR)
        ctl.connect(self._ctl_addr)
        try:
            zmq.proxy_steerable(self._xsub, self._xpub, None, ctl)
        except zmq.ZMQError:
            pass  # the context went away: stopping
        finally:
            ctl.close(linger=0)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._ctl.send(b"TERMINATE")
            self._thread.join(5)
        for sock in (self._ctl, self._xsub, self._xpub):
            sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> EventForwarder:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class _Service:
    """A spawned process that is ready when ``_ready()`` says so."""

    name = "service"

    def __init__(self, args: list[str], env: dict[str, str], log_path: str | None) -> None:
        self.args, self.env, self.log_path = args, env, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def _ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = 120.0) -> _Service:
        self.proc = spawn(self.args, self.env, self.log_path)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise ProcessError(f"{self.name} exited with code {code}: {log_tail(self.log_path)}")
            try:
                if self._ready():
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

    def __enter__(self) -> _Service:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class VllmRouter(_Service):
    """vllm-router over ``worker_urls`` (it waits for the workers before it listens)."""

    name = "vllm-router"

    def __init__(
        self,
        policy: str,
        worker_urls: Sequence[str],
        event_sources: Mapping[str, str] | None = None,
        model_name: str = "tiny",
        log_path: str | None = None,
    ) -> None:
        self.port = free_port()
        args = vllm_router_command(
            vllm_router_binary(), self.port, worker_urls, policy, event_sources, model_name=model_name
        )
        super().__init__(args, dict(os.environ), log_path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _ready(self) -> bool:
        return _get_json(self.url + "/health", 1.0)[0] == 200


class KvmeshRouterProcess(_Service):
    """The kvmesh router (``RouterService`` + ``run_forever``) in a child process."""

    name = "kvmesh router"

    def __init__(self, config: Any, log_path: str | None = None) -> None:
        """``config``: a :class:`kvmesh.router.RouterConfig`; its port 0 is replaced by a free one."""
        self.port = int(config.port) or free_port()
        self.replicas = len(config.replicas)
        cfg_json = config.merged(port=self.port).model_dump_json()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        super().__init__([sys.executable, "-c", _KVMESH_ROUTER, cfg_json], env, log_path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _ready(self) -> bool:
        status, body = _get_json(self.url + "/health", 1.0)
        return status == 200 and isinstance(body, dict) and body.get("healthy_replicas") == self.replicas


class LMCacheServer(_Service):
    """One ``lmcache server`` (multiprocess mode); ``port`` is the ZMQ port for vLLM."""

    name = "lmcache server"

    def __init__(self, pythonpath: str, log_path: str | None = None, l1_size_gb: float = 1.0) -> None:
        self.port, self.http_port = free_port(), free_port()
        # a shared-memory name of its own: two servers of one process must not collide
        shm = f"kvrouter{os.getpid()}p{self.port}"
        args = lmcache_server_command(sys.executable, self.port, self.http_port, shm, l1_size_gb)
        env = with_pythonpath(pythonpath)
        env.update(LMCACHE_ENV)
        super().__init__(args, env, log_path)

    def _ready(self) -> bool:
        return _get_json(f"http://127.0.0.1:{self.http_port}/healthcheck", 1.0)[0] == 200

    def connector(self) -> dict[str, Any]:
        """The replica's ``--kv-transfer-config`` (PEERS.md)."""
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port},
        }
