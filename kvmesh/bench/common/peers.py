"""The peers the benchmarks put beside kvmesh: vllm-router and LMCache's ``lmcache server``.

Each is a :class:`kvmesh.harness.processes.Service`: started in its own process group (and
stopped on exit like the replicas), on loopback only, and waited for until it answers its
health check. The command builders are pure and unit-tested. Where the peers come from:
``scripts/install_peers.sh`` (recipes in /work/shared/PEERS.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvmesh.bench.runner import REPO_ROOT
from kvmesh.errors import ProcessError
from kvmesh.harness.ports import free_port
from kvmesh.harness.processes import Service, get_json

PEERS_DIR_ENV = "KVMESH_PEERS_DIR"  # where install_peers.sh put LMCache (overrides .cache/peers)
VLLM_ROUTER_VERSION = "0.1.17"
VLLM_ROUTER_ENV = "KVMESH_VLLM_ROUTER"  # path of a vllm-router binary (overrides the venv)
VLLM_ROUTER_POLICIES = (
    "random",
    "round_robin",
    "power_of_two",
    "cache_aware",
    "kv_aware",
    "consistent_hash",
    "sticky_least_loaded",
)  # all of 0.1.17's
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}


def with_pythonpath(path: str | None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``path`` put first on PYTHONPATH."""
    out = dict(os.environ if env is None else env)
    if path:
        out["PYTHONPATH"] = os.pathsep.join(p for p in (path, out.get("PYTHONPATH", "")) if p)
    return out


# -- LMCache ------------------------------------------------------------------------------------
def peers_dir() -> Path:
    """Where scripts/install_peers.sh put LMCache (``$KVMESH_PEERS_DIR`` overrides)."""
    env = os.environ.get(PEERS_DIR_ENV)
    return Path(env) if env else REPO_ROOT / ".cache" / "peers"


def lmcache_pythonpath() -> str | None:
    """PYTHONPATH entry that makes ``lmcache`` importable, ``""`` if the venv has it already,
    ``None`` if it is nowhere."""
    peers = peers_dir()
    if (peers / "lmcache" / "__init__.py").exists():
        return str(peers)
    if importlib.util.find_spec("lmcache") is not None:
        return ""
    return None


def require_lmcache() -> str:
    """:func:`lmcache_pythonpath`, or ProcessError saying how to install LMCache."""
    path = lmcache_pythonpath()
    if path is None:
        raise ProcessError(
            f"LMCache is not installed (not in {peers_dir()} nor in this venv): run scripts/install_peers.sh"
        )
    return path


# LMCache's server chunks: kvmesh's shipped chunk size (and vLLM-CPU's KV block), not
# LMCache's own default of 256, so both reload the same whole chunks of a prompt.
PEER_CHUNK_SIZE = 128


def lmcache_server_command(
    python: str,
    port: int,
    http_port: int,
    shm_name: str,
    l1_size_gb: float = 1.0,
    chunk_size: int = PEER_CHUNK_SIZE,
    l2_adapters: Sequence[Mapping[str, Any]] = (),
) -> list[str]:
    """``lmcache server`` on loopback (PEERS.md recipe; ``auto`` transfer mode is required).
    ``l2_adapters``: its ``--l2-adapter`` JSON specs, e.g. ``{"type": "resp", "host": ...,
    "port": ...}`` for a Redis L2 (LMCache 0.5.6's native RESP client)."""
    args = [python, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(port),
            "--http-host", "127.0.0.1", "--http-port", str(http_port), "--l1-size-gb", f"{l1_size_gb:g}",
            "--chunk-size", str(chunk_size), "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
            "--shm-name", shm_name]  # fmt: skip
    for adapter in l2_adapters:
        args += ["--l2-adapter", json.dumps(dict(adapter), separators=(",", ":"))]
    return args


class LMCacheServer(Service):
    """One ``lmcache server`` (multiprocess mode); ``port`` is the ZMQ port for vLLM."""

    name = "lmcache server"

    def __init__(
        self,
        pythonpath: str,
        log_path: str | None = None,
        l1_size_gb: float = 1.0,
        chunk_size: int = PEER_CHUNK_SIZE,
        l2_adapters: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        self.port, self.http_port = free_port(), free_port()
        # a shared-memory name of its own: two servers of one process must not collide
        shm = f"kvbench{os.getpid()}p{self.port}"
        args = lmcache_server_command(
            sys.executable, self.port, self.http_port, shm, l1_size_gb, chunk_size, l2_adapters
        )
        env = with_pythonpath(pythonpath)
        env.update(LMCACHE_ENV)
        super().__init__(args, env, log_path)

    @property
    def http_url(self) -> str:
        """Its HTTP admin API (``/healthcheck``, ``POST /cache/clear``)."""
        return f"http://127.0.0.1:{self.http_port}"

    def ready(self) -> bool:
        return get_json(f"{self.http_url}/healthcheck", 1.0)[0] == 200

    def connector(self) -> dict[str, Any]:
        """A replica's ``--kv-transfer-config`` for this server (PEERS.md)."""
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": self.extra_config(),
        }

    def extra_config(self) -> dict[str, Any]:
        return {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port}


# -- vllm-router --------------------------------------------------------------------------------
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


class VllmRouter(Service):
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

    def ready(self) -> bool:
        return get_json(self.url + "/health", 1.0)[0] == 200
