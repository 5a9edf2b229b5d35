"""``kvmesh soak``: real replicas under load while their dependencies fail, checked for wrong KV.

Two vLLM replicas with the kvmesh connector share a Redis tier; each has a disk tier on a
small tmpfs (a real full filesystem, not a flag), behind a ``kvmesh router`` process. N
users send streaming chats (temperature 0) from a fixed prompt pool whose fault-free
answers were recorded first. The pool overflows each replica's own caches (vLLM's prefix
cache, capped with ``--num-gpu-blocks-override``, and a small kvmesh CPU tier), so the disk
and Redis tiers carry load and their faults touch kvmesh. A schedule injects, one after the
other, each after the previous one's recovery window: SIGSTOP Redis for a while, SIGKILL
Redis and restart it, fill the disk tier's filesystem, restart the router (SIGTERM, as a
rolling restart does), SIGKILL a replica and restart it. The verdict
(:mod:`kvmesh.bench.soak.verdict`) checks every claim: no answer differs from its reference,
none hangs, every failure is retryable *and* explained by a fault in progress, every fault
was injected, each recovered in time, enough answers in every window, memory bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.bench.runner import provenance
from kvmesh.bench.soak.load import Client, FaultEvent, Prompt, Record, chat_load, prompt_pool, references
from kvmesh.bench.soak.report import report
from kvmesh.bench.soak.verdict import Bounds, verdict_ok
from kvmesh.errors import ProcessError
from kvmesh.harness.connector import connector_config, shipped_chunk_size
from kvmesh.harness.model import ensure_model
from kvmesh.harness.ports import free_port
from kvmesh.harness.processes import crash, install_signal_handlers, spawn, stop_process
from kvmesh.harness.replicas import Replica, start_replicas
from kvmesh.harness.services import RedisServer

# The slowest (a vLLM restart takes 30-120 s here) last, so a short run still sees the others.
FAULTS = ("redis_stop", "redis_kill", "disk_full", "router_restart", "replica_kill")
# A restart that is not serving by then is a failed fault (reported with the replica's log),
# not a run that waits on: the suite's short soak must fail inside pytest's 600 s timeout.
RESTART_TIMEOUT_S = 300.0
_PAGE = os.sysconf("SC_PAGE_SIZE")
_MIB = 1 << 20
# The caches, sized against the pool (24 tenants x 2 questions, ~630-token prompts whose
# first 4 chunks of 128 tokens are the tenant's: ~105 chunks, 512 KiB each with the tiny
# model, ~52 per replica when the router splits the tenants evenly): vLLM's prefix cache holds
# 32 blocks, most of them taken by the requests running; kvmesh's CPU tier 16 chunks and its
# disk tier 24 per replica; Redis holds them all. So loads come from disk and Redis.
VLLM_BLOCKS = 32  # vLLM's KV blocks per replica (128 tokens each on CPU; one is its null block)
MAX_MODEL_LEN = 2048  # prompts are ~630 tokens; vLLM wants max_model_len's blocks free
CPU_TIER_MB = 8
DISK_TIER_MB = 12
TMPFS_MB = 32  # both replicas' disk tiers (2 x 12 MiB) and room for nothing much else
POOL = {"tenants": 24, "questions": 2, "prefix_words": 150}


def _mount_tmpfs(path: str, size_mb: int) -> bool:
    """A real small filesystem for the disk tiers (root only; elsewhere a plain directory)."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", path], capture_output=True
    )
    return proc.returncode == 0


def _rss_by_group() -> dict[int, int]:
    """Resident bytes per process group, from /proc."""
    out: dict[int, int] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                pgid = int(f.read().rsplit(")", 1)[1].split()[2])
            with open(f"/proc/{pid}/statm") as f:
                rss = int(f.read().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            continue
        out[pgid] = out.get(pgid, 0) + rss
    return out


@dataclass
class Fleet:
    model_dir: str
    workdir: str
    disk_mb: int = TMPFS_MB
    router_port: int = 0  # chosen when the router first starts, kept across its restarts
    replicas: list[Replica] = field(default_factory=list)
    redis: RedisServer | None = None
    router: subprocess.Popen[bytes] | None = None
    tmpfs: bool = False
    rss_samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def disk_root(self) -> str:
        return os.path.join(self.workdir, "disk")

    def connector(self, i: int) -> dict[str, Any]:
        assert self.redis is not None
        return connector_config(
            self.redis.url,
            cpu_gb=CPU_TIER_MB / 1024,
            remote_timeout_s=0.5,
            local_disk=os.path.join(self.disk_root, f"replica{i}"),
            # Below the tmpfs: the tier believes it has room, so only the filler makes it full.
            max_local_disk_size=DISK_TIER_MB / 1024,
        )

    def start(self, need_tmpfs: bool = True) -> None:
        """Start Redis, the replicas and the router. ``need_tmpfs``: the disk fault is asked
        for, and without a real small filesystem it could not be injected: fail now rather
        than after the run (the verdict would fail it anyway)."""
        self.tmpfs = _mount_tmpfs(self.disk_root, self.disk_mb)
        if need_tmpfs and not self.tmpfs:
            raise ProcessError(
                "the disk_full fault needs a tmpfs for the disk tiers (mount needs root); "
                "run as root or leave disk_full out of --faults"
            )
        self.redis = RedisServer().start()
        self.replicas = [
            Replica(
                self.model_dir,
                cpu=i % max(os.cpu_count() or 1, 1),
                num_blocks=VLLM_BLOCKS,
                max_model_len=MAX_MODEL_LEN,
                kv_transfer=self.connector(i),
                events_ipc=f"ipc://{os.path.abspath(self.workdir)}/events{i}.sock",
                log_path=os.path.join(self.workdir, f"replica{i}.log"),
                # Every process of a replica on its own core, as the benchmarks run them. Unpinned,
                # a restarted replica hung in `import torch`: MKL counts cores by pinning itself
                # to each allowed core in turn, and on the core of the other replica's busy worker
                # the move did not complete for minutes. Pinned, it only tries its own core.
                pin_process=True,
            )
            for i in range(2)
        ]
        start_replicas(self.replicas)
        self.start_router()

    def start_router(self, timeout: float = 60.0) -> None:
        """Start ``kvmesh router`` and wait for /health. The first start picks a free port
        only now (vLLM's processes bind ports of their own while they start) and tries another
        if it was taken in between; restarts keep the port, as a Service would."""
        first = not self.router_port
        for attempt in range(3 if first else 1):
            if first:
                self.router_port = free_port()
            if self._spawn_router(timeout):
                return
            assert self.router is not None
            stop_process(self.router)
            if not first or attempt == 2:
                break
        log = os.path.join(self.workdir, "router.log")
        raise TimeoutError(f"the router did not become healthy within {timeout:.0f} s; see {log}")

    def _spawn_router(self, timeout: float) -> bool:
        args = [sys.executable, "-m", "kvmesh.cli", "router", "--model", self.model_dir]
        args += ["--port", str(self.router_port)]
        for i, r in enumerate(self.replicas):
            args += ["--replica", f"{r.url},events={r.events_endpoint},name=replica{i}"]
        self.router = spawn(args, dict(os.environ), os.path.join(self.workdir, "router.log"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.router.poll() is None:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/health", timeout=1) as resp,
            ):
                if resp.status == 200:
                    return True
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        if self.router is not None:
            stop_process(self.router)
        for r in self.replicas:
            r.stop()
        if self.redis is not None:
            self.redis.stop()
        if self.tmpfs:
            subprocess.run(["umount", "-l", self.disk_root], capture_output=True)

    # -- faults: each blocks until the fleet is whole again ---------------------------------------
    def replica_kill(self, hold_s: float) -> str:
        victim = self.replicas[1]
        assert victim.proc is not None
        crash(victim.proc)  # every process of it but Python's resource tracker
        stop_process(victim.proc)
        victim.proc = None
        time.sleep(hold_s)
        victim.start()
        victim.wait_ready(RESTART_TIMEOUT_S)
        return "replica1 SIGKILLed and restarted"

    def redis_kill(self, hold_s: float) -> str:
        assert self.redis is not None
        self.redis.kill()
        time.sleep(hold_s)
        self.redis.start()
        return f"redis SIGKILLed, restarted empty on port {self.redis.port} after {hold_s:.0f} s"

    def redis_stop(self, hold_s: float) -> str:
        assert self.redis is not None and self.redis.proc is not None
        self.redis.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(hold_s)
        finally:
            self.redis.proc.send_signal(signal.SIGCONT)
        return f"redis SIGSTOPped for {hold_s:.0f} s"

    def disk_full(self, hold_s: float) -> str:
        if not self.tmpfs:  # not injected: the verdict fails the run (faults_injected)
            raise ProcessError("no tmpfs could be mounted (needs root), so no real full filesystem")
        filler = os.path.join(self.disk_root, "filler")
        written = 0
        with open(filler, "wb") as f:
            block = b"\0" * (1 << 20)
            with contextlib.suppress(OSError):  # ENOSPC: the filesystem is full, as wanted
                while True:
                    f.write(block)
                    f.flush()
                    written += len(block)
        time.sleep(hold_s)
        os.unlink(filler)
        return f"tmpfs filled ({written >> 20} MiB filler) for {hold_s:.0f} s"

    def router_restart(self, hold_s: float) -> str:
        """A rolling restart as an orchestrator does it: SIGTERM (the router stops accepting and
        finishes the answers in flight), then a new process with an empty index."""
        assert self.router is not None
        t = time.monotonic()
        stop_process(self.router, timeout=60.0)
        drained = time.monotonic() - t
        time.sleep(hold_s)
        self.start_router()
        return f"router stopped with SIGTERM (drained in {drained:.1f} s) and restarted"

    def faults(self) -> dict[str, Callable[[float], str]]:
        return {
            "replica_kill": self.replica_kill,
            "redis_kill": self.redis_kill,
            "redis_stop": self.redis_stop,
            "disk_full": self.disk_full,
            "router_restart": self.router_restart,
        }

    def rss(self) -> dict[str, int]:
        """Resident bytes now: each replica's and the router's process group, Redis."""
        groups = _rss_by_group()
        parts: dict[str, int | None] = {
            f"replica{i}": r.proc.pid if r.proc else None for i, r in enumerate(self.replicas)
        }
        parts["router"] = self.router.pid if self.router else None
        now = {name: groups[pgid] for name, pgid in parts.items() if pgid is not None and pgid in groups}
        if self.redis and self.redis.proc:
            with (
                contextlib.suppress(OSError, ValueError, IndexError),
                open(f"/proc/{self.redis.proc.pid}/statm") as f,
            ):
                now["redis"] = int(f.read().split()[1]) * _PAGE
        return now

    def sample_rss(self, t: float) -> None:
        """Record every process's RSS at ``t`` (seconds since the load began)."""
        self.rss_samples.append((t, self.rss()))


def schedule(duration_s: float, faults: tuple[str, ...]) -> list[tuple[float, str]]:
    """Faults spread over the first 70% of the run; the last 30% is quiet, for recovery
    (the injector also waits a recovery window after each fault: :func:`_run_faults`)."""
    if not faults:
        return []
    first, last = 0.15 * duration_s, 0.70 * duration_s
    step = (last - first) / max(len(faults) - 1, 1)
    return [(first + i * step, name) for i, name in enumerate(faults)]


def _run_faults(
    fleet: Fleet,
    plan: list[tuple[float, str]],
    t0: float,
    hold_s: float,
    events: list[FaultEvent],
    stop: threading.Event,
    gap_s: float = 0.0,
) -> None:
    """Inject ``plan``'s faults at their times, each at least ``gap_s`` after the previous
    one ended (its recovery is observed before the next fault)."""
    ready = 0.0
    for at, name in plan:
        if stop.wait(max(0.0, max(at, ready) - (time.monotonic() - t0))):
            return
        start = time.monotonic() - t0
        fault = fleet.faults()[name]
        injected = True
        try:
            note = fault(hold_s)
        except Exception as exc:  # the soak reports a fault that could not be injected
            note, injected = f"fault failed: {type(exc).__name__}: {exc}", False
        events.append(FaultEvent(name, start, time.monotonic() - t0, note, injected))
        ready = events[-1].end + gap_s


def pool_chunks(model_dir: str, pool: list[Prompt], chunk_size: int) -> int:
    """Distinct full chunks of the pool's prompts as the replicas see them (chat template
    applied): what the caches would have to hold for every prompt to hit."""
    from kvmesh.routing.tokenize import PromptTokenizer
    from kvmesh.sim.workload import blocks_of

    tok = PromptTokenizer.from_dir(model_dir)
    chunks: set[int] = set()
    for p in pool:
        chunks.update(blocks_of(tok.chat({"messages": p.messages()}).tolist(), chunk_size))
    return len(chunks)


def rss_report(
    samples: list[tuple[float, dict[str, int]]], first_fault: float
) -> tuple[dict[str, int], dict[str, int], list[dict[str, Any]]]:
    """From the RSS samples: each process's RSS once warm (its peak under load before the
    first fault: the base of its bound), its peak over the run, and the samples."""
    warm: dict[str, int] = {}
    peak: dict[str, int] = {}
    for t, now in samples:
        for name, rss in now.items():
            peak[name] = max(peak.get(name, 0), rss)
            if t < first_fault:
                warm[name] = max(warm.get(name, 0), rss)
    series = [{"t": round(t, 1), **{k: round(v / _MIB, 1) for k, v in now.items()}} for t, now in samples]
    return warm, peak, series


def kv_bytes_per_token(model_dir: str) -> int:
    """KV bytes per token of the model as the replicas run it (float32: the harness's dtype)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(cfg["num_hidden_layers"]) * 2 * int(cfg["num_key_value_heads"]) * int(head_dim) * 4


def run(
    model_dir: str,
    minutes: float = 10.0,
    concurrency: int = 16,
    faults: tuple[str, ...] = FAULTS,
    hold_s: float = 10.0,
    deadline_s: float = 60.0,
    json_path: str | None = None,
    plot_path: str | None = None,
    workdir: str | None = None,
    bounds: Bounds | None = None,
) -> dict[str, Any]:
    prov = provenance("soak")  # the code this run measures: read now, the tree may move on
    bounds = bounds or Bounds()
    install_signal_handlers()
    workdir = workdir or tempfile.mkdtemp(prefix="kvmesh-soak-")
    fleet = Fleet(model_dir, workdir)
    duration = minutes * 60.0
    records: list[Record] = []
    events: list[FaultEvent] = []
    stop = threading.Event()
    pool = prompt_pool(**POOL)
    chunk = shipped_chunk_size()
    chunk_bytes = chunk * kv_bytes_per_token(model_dir)
    pool_info = {
        **POOL,
        "prompts": len(pool),
        "replicas": 2,
        "chunks": pool_chunks(model_dir, pool, chunk),
        "chunk_tokens": chunk,
        "vllm_cache_chunks": VLLM_BLOCKS,
        "cpu_tier_chunks": CPU_TIER_MB * _MIB // chunk_bytes,
        "disk_tier_chunks": DISK_TIER_MB * _MIB // chunk_bytes,
    }
    print(f"kvmesh soak: starting 2 replicas, redis and the router (logs in {workdir}) ...")
    try:
        fleet.start(need_tmpfs="disk_full" in faults)
        client = Client(fleet.url, "tiny", max_tokens=12, deadline_s=deadline_s)
        reference = asyncio.run(references(client, pool))
        client.t0 = t0 = time.monotonic()
        fleet.sample_rss(0.0)
        plan = schedule(duration, faults)
        injector = threading.Thread(
            target=_run_faults,
            args=(fleet, plan, t0, hold_s, events, stop, bounds.fault_gap_s),
            daemon=True,
        )
        sampler_stop = threading.Event()

        def sampler() -> None:
            while not sampler_stop.wait(1.0):
                fleet.sample_rss(time.monotonic() - t0)

        quiet_s = max(0.3 * duration, bounds.fault_gap_s)

        def should_stop(t: float) -> bool:
            """The load runs its minutes and, however long the faults took, a quiet spell
            after the last one, so recovery is always observed."""
            last = max((e.end for e in events), default=0.0)
            return t >= duration and not injector.is_alive() and t >= last + quiet_s

        threading.Thread(target=sampler, daemon=True).start()
        injector.start()
        asyncio.run(chat_load(client, pool, reference, concurrency, should_stop, records.append))
        injector.join()
        sampler_stop.set()
        duration = max(duration, time.monotonic() - t0)
    finally:
        stop.set()
        fleet.stop()
    settings = {
        "minutes": minutes,
        "concurrency": concurrency,
        "hold_s": hold_s,
        "deadline_s": deadline_s,
        "faults": list(faults),
        "tmpfs": fleet.tmpfs,
    }
    return report(
        records,
        events,
        rss_report(fleet.rss_samples, min((e.start for e in events), default=duration)),
        duration,
        settings,
        pool_info,
        bounds,
        json_path,
        plot_path,
        prov,
    )


def main(args: Any) -> int:
    """``kvmesh soak`` (the parser: :mod:`kvmesh.bench.soak.cli`)."""
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        print(
            f"kvmesh soak: unknown fault(s) {', '.join(unknown)}; valid: {', '.join(FAULTS)}", file=sys.stderr
        )
        return 2
    out = run(
        ensure_model(args.model),
        minutes=args.minutes,
        concurrency=args.concurrency,
        faults=faults,
        hold_s=args.hold,
        deadline_s=args.deadline,
        json_path=args.json,
        plot_path=args.plot,
        bounds=Bounds(recovery_within_s=args.recovery_within),
    )
    return 0 if verdict_ok(out) else 1
