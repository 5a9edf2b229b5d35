"""``kvmesh soak``: real replicas under load while their dependencies fail, checked for wrong KV.

Two vLLM replicas with the kvmesh connector share a Redis tier; each has a disk tier on a
small tmpfs (a real full filesystem, not a flag), behind a ``kvmesh router`` process. N
users send streaming chats (temperature 0) from a fixed prompt pool whose fault-free
answers were recorded first. A schedule injects, one after the other: SIGKILL a replica and
restart it, SIGKILL Redis and restart it, SIGSTOP Redis for a while, fill the disk tier's
filesystem, restart the router (SIGTERM, as a rolling restart does). The verdict: no answer
differs from its reference, none hangs past its deadline, every failure is retryable (see
:mod:`kvmesh.bench.soak_load`), memory stays bounded, and the hit rate comes back after each
fault.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from kvmesh.bench.soak_load import Client, FaultEvent, Record, chat_load, prompt_pool, references, report
from kvmesh.harness.connector import connector_config
from kvmesh.harness.model import ensure_model
from kvmesh.harness.ports import free_port
from kvmesh.harness.processes import install_signal_handlers, spawn, stop_process
from kvmesh.harness.replicas import Replica, start_replicas
from kvmesh.harness.services import RedisServer

# The slowest (a vLLM restart takes 30-120 s here) last, so a short run still sees the others.
FAULTS = ("redis_stop", "redis_kill", "disk_full", "router_restart", "replica_kill")
_PAGE = os.sysconf("SC_PAGE_SIZE")


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
    disk_mb: int = 96
    router_port: int = 0  # chosen when the router first starts, kept across its restarts
    replicas: list[Replica] = field(default_factory=list)
    redis: RedisServer | None = None
    router: subprocess.Popen[bytes] | None = None
    tmpfs: bool = False
    peak_rss: dict[str, int] = field(default_factory=dict)

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
            cpu_gb=0.25,
            remote_timeout_s=0.5,
            local_disk=os.path.join(self.disk_root, f"replica{i}"),
            # Below the tmpfs: the tier believes it has room, so only the filler makes it full.
            max_local_disk_size=self.disk_mb * 0.6 / 1024,
        )

    def start(self) -> None:
        self.tmpfs = _mount_tmpfs(self.disk_root, self.disk_mb)
        self.redis = RedisServer().start()
        self.replicas = [
            Replica(
                self.model_dir,
                cpu=i % max(os.cpu_count() or 1, 1),
                num_blocks=200,
                kv_transfer=self.connector(i),
                events_ipc=f"ipc://{os.path.abspath(self.workdir)}/events{i}.sock",
                log_path=os.path.join(self.workdir, f"replica{i}.log"),
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
        os.killpg(victim.proc.pid, signal.SIGKILL)
        stop_process(victim.proc)
        victim.proc = None
        time.sleep(hold_s)
        victim.start()
        victim.wait_ready()
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
        if not self.tmpfs:
            time.sleep(hold_s)
            return "skipped: no tmpfs could be mounted (needs root), so no real full filesystem"
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

    def sample_rss(self) -> None:
        groups = _rss_by_group()
        parts: dict[str, int | None] = {
            f"replica{i}": r.proc.pid if r.proc else None for i, r in enumerate(self.replicas)
        }
        parts["router"] = self.router.pid if self.router else None
        for name, pgid in parts.items():
            if pgid is not None and pgid in groups:
                self.peak_rss[name] = max(self.peak_rss.get(name, 0), groups[pgid])
        if self.redis and self.redis.proc:
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{self.redis.proc.pid}/statm") as f:
                    rss = int(f.read().split()[1]) * _PAGE
                self.peak_rss["redis"] = max(self.peak_rss.get("redis", 0), rss)


def schedule(duration_s: float, faults: tuple[str, ...]) -> list[tuple[float, str]]:
    """Faults spread over the first 70% of the run; the last 30% is quiet, for recovery."""
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
) -> None:
    for at, name in plan:
        if stop.wait(max(0.0, at - (time.monotonic() - t0))):
            return
        start = time.monotonic() - t0
        fault = fleet.faults()[name]
        try:
            note = fault(hold_s)
        except Exception as exc:  # the soak reports a fault that could not be injected
            note = f"fault failed: {type(exc).__name__}: {exc}"
        events.append(FaultEvent(name, start, time.monotonic() - t0, note))


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
) -> dict[str, Any]:
    install_signal_handlers()
    workdir = workdir or tempfile.mkdtemp(prefix="kvmesh-soak-")
    fleet = Fleet(model_dir, workdir)
    duration = minutes * 60.0
    records: list[Record] = []
    events: list[FaultEvent] = []
    stop = threading.Event()
    print(f"kvmesh soak: starting 2 replicas, redis and the router (logs in {workdir}) ...")
    try:
        fleet.start()
        pool = prompt_pool(tenants=6, questions=4, prefix_words=300)
        client = Client(fleet.url, "tiny", max_tokens=12, deadline_s=deadline_s)
        reference = asyncio.run(references(client, pool))
        client.t0 = t0 = time.monotonic()
        plan = schedule(duration, faults)
        injector = threading.Thread(
            target=_run_faults, args=(fleet, plan, t0, hold_s, events, stop), daemon=True
        )
        sampler_stop = threading.Event()

        def sampler() -> None:
            while not sampler_stop.wait(1.0):
                fleet.sample_rss()

        quiet_s = max(0.3 * duration, 20.0)

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
    return report(
        records,
        events,
        fleet.peak_rss,
        duration,
        {"minutes": minutes, "concurrency": concurrency, "hold_s": hold_s, "deadline_s": deadline_s},
        json_path,
        plot_path,
    )


def add_soak_parser(sub: Any) -> None:
    p = sub.add_parser(
        "soak",
        help="2 vLLM replicas + Redis + disk + router under load while faults are injected",
        description="Streaming chats through the router while replicas, Redis, the disk and the router "
        "fail; exits 1 if any answer was wrong, hung or failed without a retryable status.",
    )
    p.add_argument("--model", default=".cache/models/tiny", help="model directory (built if missing)")
    p.add_argument("--minutes", type=float, default=10.0, help="length of the load (default 10)")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent streaming chats (default 16)")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}")
    p.add_argument("--hold", type=float, default=10.0, help="seconds each fault lasts (default 10)")
    p.add_argument("--deadline", type=float, default=60.0, help="a request running longer is a hang")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--plot", help="write the timeline PNG here")
    p.set_defaults(func=_soak_command)


def _soak_command(args: Any) -> int:
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
    )
    return 0 if verdict_ok(out) else 1


def verdict_ok(out: dict[str, Any]) -> bool:
    """No wrong text, no hang, no silent cut, no non-retryable error."""
    return all(int(out[k]) == 0 for k in ("wrong", "hang", "interrupted", "error"))
