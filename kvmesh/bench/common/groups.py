"""Replica groups side by side and the setups over them interleaved: the engine of
``kvmesh bench router`` and ``kvmesh demo``.

A *group* is two vLLM replicas with one kind of KV cache (``none``: plain vLLM,
``lmcache``: one ``lmcache server`` per replica, ``kvmesh``: kvmesh's connector over a
shared tier). Each replica gets one core (every process of it pinned there: vLLM's engine
core busy-polls and would otherwise take CPU from the other replica's worker) and its own
KV cache capped at ``num_blocks`` blocks. A *setup* is a router and policy over a group.
The groups of a phase are up at the same time and their setups take turns, repeat by
repeat, every other repeat in reverse order: this machine drifts by 15-20% over minutes,
and a ratio between two groups must not depend on which ran first. Every run gets tenant
texts of its own (its own seed) and the replicas' prefix caches are reset before it, so no
setup profits from another.

All replicas get the same arguments apart from the KV connector: the PEERS.md fairness
settings (:mod:`kvmesh.harness.replicas`); ``--enable-scale-out`` (without it vLLM answers
403 to the ``/v1/chat/completions/render`` calls vllm-router's ``kv_aware`` tokenizes with);
``VLLM_SERVER_DEV_MODE=1`` (for ``/reset_prefix_cache``); and vLLM KV events, relayed on
loopback by an :class:`~kvmesh.harness.events.EventForwarder` per replica and read only by
the routers that use them. Every router runs in a process of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from kvmesh.bench.common.corpus import zipf_words
from kvmesh.bench.common.workload import Arrival, Workload, idle_ttfts, median_summary, replay, words
from kvmesh.bench.runner import interleaved
from kvmesh.harness.connector import connector_config
from kvmesh.harness.events import EventForwarder
from kvmesh.harness.ports import free_port
from kvmesh.harness.replicas import Replica, start_replicas_on
from kvmesh.harness.services import shared_tier

MODEL_NAME = "tiny"
# replica groups; kvmesh-slow: kvmesh replicas whose shared tier is behind a slow link
GROUPS = ("none", "lmcache", "kvmesh", "kvmesh-slow")
SLOW_LATENCY_S = 0.05  # kvmesh-slow: one way, a round trip of 100 ms per chunk read
SLOW_BANDWIDTH_BPS = 100e6
REPLICAS = 2  # per group
IDLE_MISSES = 12  # lone first turns per group (half on each replica) for the idle-miss floor
# vLLM's dev mode gives POST /reset_prefix_cache (a clean cache per run); scale-out gives the
# /v1/chat/completions/render endpoint that vllm-router's kv_aware tokenizes with.
REPLICA_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
REPLICA_ARGS = ["--enable-scale-out"]
_NATIVE_CACHE = {"vllm-router": "none", "kvmesh": "kvmesh"}
_CACHE_LABEL = {"none": "plain", "lmcache": "lmcache", "kvmesh": "kvmesh", "kvmesh-slow": "kvmesh-slow"}

Log = Callable[[str], None]


@dataclass(frozen=True)
class Setup:
    router: str  # "vllm-router" | "kvmesh"
    policy: str
    cache: str  # "none" | "lmcache" | "kvmesh": also the replica group

    @property
    def name(self) -> str:
        """``router:policy``, plus ``+cache`` when it is not the router's own kind of replica
        (``vllm-router:kv_aware+lmcache``, ``kvmesh:round-robin+plain``)."""
        base = f"{self.router}:{self.policy}"
        return base if _NATIVE_CACHE.get(self.router) == self.cache else f"{base}+{_CACHE_LABEL[self.cache]}"


@dataclass(frozen=True)
class Params:
    tenants: int
    users: int
    turns: int
    concurrency: int
    repeats: int
    overhead_n: int = 200
    arrival: Arrival = "sessions"
    prefix_words: int = 250
    num_blocks: int = 40  # each replica's own KV cache, in 128-token blocks
    # More of the workload's shape (Workload.multi_tenant): prompt lengths drawn up to
    # prefix_words_max, question length, Zipf-distributed words instead of the 15 syllables.
    prefix_words_max: int = 0
    question_words: int = 40
    zipf: bool = False


def floor_seed(cache: str) -> int:
    """Seed of the tenant texts of a group's idle-miss measurement (no run shares it)."""
    return 5000 + GROUPS.index(cache)


def aggregate(setup: Setup, runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One result row: the median of each metric over the repeats (``RunResult.summary()``s)."""
    row: dict[str, Any] = {"router": setup.router, "policy": setup.policy, "cache": setup.cache}
    medians = median_summary(runs)
    if not medians:
        detail = "; ".join(str(r["error"]) for r in runs if r.get("error")) or "no request succeeded"
        row["error"] = detail
        return row
    row.update(medians)
    errors = sum(int(r.get("errors", 0)) for r in runs)
    if errors:
        row["errors"] = errors  # failed requests (the metrics cover the others)
    return row


def error_row(setup: Setup, message: str) -> dict[str, Any]:
    return {"router": setup.router, "policy": setup.policy, "cache": setup.cache, "error": message}


# -- replicas ----------------------------------------------------------------------------------
def _post(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> Any:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def reset_prefix_caches(urls: Sequence[str]) -> None:
    for url in urls:
        for attempt in range(10):  # refused while requests are still finishing
            try:
                _post(url + "/reset_prefix_cache", timeout=30)
                break
            except (urllib.error.URLError, OSError):
                if attempt == 9:
                    raise
                time.sleep(0.5)


def chat(url: str, text: str, max_tokens: int = 1) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    _post(url + "/v1/chat/completions", body)


def warm_up(urls: Sequence[str], tag: str) -> None:
    """The first requests of a new process carry seconds of lazy initialisation: store a
    prompt on every replica, reset, send it again (a connector loads it), reset."""
    text = f"warm-up {tag} " + words(random.Random(tag), 500)
    for _ in range(2):
        for url in urls:
            chat(url, text)
        reset_prefix_caches(urls)


@contextlib.contextmanager
def replica_group(
    cache: str, model_dir: str, workdir: str, num_blocks: int, log: Log
) -> Iterator[list[Replica]]:
    """Start the group's services and its replicas (in parallel), warm them up; stop all after."""
    with contextlib.ExitStack() as stack:
        transfers: list[dict[str, Any] | None] = [None] * REPLICAS
        env_extra = dict(REPLICA_ENV)
        if cache == "lmcache":
            from kvmesh.bench.common.peers import LMCACHE_ENV, LMCacheServer, require_lmcache, with_pythonpath

            path = require_lmcache()
            servers = []
            for i in range(REPLICAS):
                server = LMCacheServer(path, os.path.join(workdir, f"lmcache{i}.log"))
                stack.callback(server.stop)
                servers.append(server)
            for server in servers:
                server.start()
            log(f"  lmcache servers on ZMQ ports {', '.join(str(s.port) for s in servers)}")
            transfers = [s.connector() for s in servers]
            if path:
                env_extra["PYTHONPATH"] = with_pythonpath(path)["PYTHONPATH"]
            env_extra.update(LMCACHE_ENV)
        elif cache in ("kvmesh", "kvmesh-slow"):
            if cache == "kvmesh-slow":  # a real redis behind a latency and bandwidth proxy
                from kvmesh.harness.slowproxy import slow_redis

                remote_url = stack.enter_context(slow_redis(SLOW_LATENCY_S, SLOW_BANDWIDTH_BPS))
            else:
                remote_url = stack.enter_context(shared_tier(workdir))
            log(f"  kvmesh shared tier: {remote_url}")
            # a known admin port: the cost policy reads the replicas' measured costs there
            transfers = [connector_config(remote_url, admin_port=free_port()) for _ in range(REPLICAS)]
        forwarders = [stack.enter_context(EventForwarder()) for _ in range(REPLICAS)]
        replicas = [
            Replica(
                model_dir,
                name=MODEL_NAME,
                cpu=i,
                num_blocks=num_blocks,
                kv_transfer=transfers[i],
                events_port=forwarders[i].in_port,
                events_out=forwarders[i].out_port,
                log_path=os.path.join(workdir, f"{cache}-replica{i}.log"),
                env_extra=env_extra,
                extra_args=list(REPLICA_ARGS),
                pin_process=True,
            )
            for i in range(REPLICAS)
        ]
        took = start_replicas_on(stack, replicas)
        log(f"  {REPLICAS} replicas ready in {took:.0f} s; warming up")
        warm_up([r.url for r in replicas], cache)
        yield replicas


def admin_url(replica: Replica) -> str | None:
    """The kvmesh admin API of a replica given an ``admin_port`` here (None: none)."""
    extra = (getattr(replica, "kv_transfer", None) or {}).get("kv_connector_extra_config") or {}
    port = extra.get("admin_port")
    return f"http://127.0.0.1:{port}" if port else None


# -- one run -----------------------------------------------------------------------------------
def kvmesh_router_note(url: str) -> str:
    """What the kvmesh router's index saw (its ``/kvmesh/state``), for the progress output."""
    try:
        with urllib.request.urlopen(url + "/kvmesh/state", timeout=5) as resp:
            state = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"no state ({exc})"
    return f"index {json.dumps(state.get('index'))}; subscribers {json.dumps(state.get('subscribers'))}"


@contextlib.contextmanager
def router_for(setup: Setup, replicas: Sequence[Replica], model_dir: str, workdir: str) -> Iterator[str]:
    """Start the setup's router in its own process; yields its URL."""
    log_path = os.path.join(workdir, f"{setup.name.replace(':', '-')}-router.log")
    router: Any
    if setup.router == "vllm-router":
        from kvmesh.bench.common.peers import VllmRouter

        events = {r.url: r.events_endpoint or "" for r in replicas}
        router = VllmRouter(setup.policy, [r.url for r in replicas], events, MODEL_NAME, log_path)
    else:
        from kvmesh.harness.router import RouterProcess
        from kvmesh.router import RouterConfig
        from kvmesh.routing.config import ReplicaConfig

        cost = setup.policy == "cost"  # it reads each replica's measured costs (admin API)
        config = RouterConfig(
            model=model_dir,
            replicas=tuple(
                ReplicaConfig(
                    url=r.url,
                    events=r.events_endpoint,
                    name=f"replica{i}",
                    admin=admin_url(r) if cost else None,
                )
                for i, r in enumerate(replicas)
            ),
            policy=setup.policy,
            port=0,
            controller={"rebuild": False},  # as the other setups: no index refill from the admin API
        )
        router = RouterProcess(config, log_path)
    with router:
        router.start()
        yield str(router.url)


def run_once(
    setup: Setup, replicas: Sequence[Replica], model_dir: str, workdir: str, p: Params, seed: int
) -> dict[str, Any]:
    """One replay of a fresh workload (tenant texts from ``seed``) through the setup's router:
    ``RunResult.summary()``, plus ``error`` (the first failed request's) if any failed."""
    from tqdm import tqdm

    reset_prefix_caches([r.url for r in replicas])
    workload = Workload.multi_tenant(
        p.tenants, p.users, p.turns, prefix_words=p.prefix_words, question_words=p.question_words, seed=seed,
        prefix_words_max=p.prefix_words_max, text=zipf_words if p.zipf else None,
    )  # fmt: skip
    with router_for(setup, replicas, model_dir, workdir) as url:
        for i in range(len(replicas)):  # the router's own first requests (short: no full block)
            chat(url, f"router warm-up {i}")
        with tqdm(
            total=workload.num_requests, desc=f"  {setup.name}", unit="req", leave=False, disable=None
        ) as bar:
            result = replay(workload, url, MODEL_NAME, p.concurrency, on_done=bar.update, arrival=p.arrival)
        if setup.router == "kvmesh":
            print(f"    kvmesh router: {kvmesh_router_note(url)}", flush=True)
    summary = result.summary()
    errors = [s.error for s in result.samples if not s.ok]
    if errors:
        summary["error"] = errors[0]
    return summary


def measure_idle_miss(replicas: Sequence[Replica], p: Params, cache: str, log: Log) -> float:
    """Median TTFT of new tenants' first turns sent one at a time, straight to the group's
    idle replicas (half to each), with no router: the physical floor of every setup's TTFT
    p90 here. 12 of the 72 requests are such first-touch misses, no cache can serve them,
    and the p90 is at least the fifth-fastest of them; under load each is slower than alone.
    Stores the prompts in whatever cache the group has; the runs reset and reseed."""
    workload = Workload.multi_tenant(IDLE_MISSES, 1, 1, prefix_words=p.prefix_words, seed=floor_seed(cache))
    half = IDLE_MISSES // 2
    ttfts: list[float] = []
    for i, replica in enumerate(replicas[:2]):
        part = Workload(workload.conversations[i * half : (i + 1) * half], workload.max_tokens)
        ttfts += idle_ttfts(part, replica.url, MODEL_NAME)
    floor = round(statistics.median(ttfts), 4)
    log(f"  idle-miss TTFT (lone first turns, no router): median {floor} s, min {min(ttfts):.4f} s")
    return floor


# -- the interleaved runs ------------------------------------------------------------------------
@dataclass
class Outcome:
    """Each setup's runs (``RunResult.summary()``s, in run order), why setups failed, and
    each group's idle-miss floor (when measured)."""

    runs: dict[Setup, list[dict[str, Any]]]
    failed: dict[Setup, str] = field(default_factory=dict)
    idle_miss: dict[str, float] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        """One :func:`aggregate` (or :func:`error_row`) per setup, in the order given."""
        return [
            error_row(s, self.failed[s]) if s in self.failed else aggregate(s, r)
            for s, r in self.runs.items()
        ]


@contextlib.contextmanager
def phase_up(
    setups: Sequence[Setup],
    phase: Sequence[str],
    start: Callable[[str], AbstractContextManager[list[Replica]]],
    failed: dict[Setup, str],
    log: Log,
    label: Callable[[str], str] = str,
) -> Iterator[tuple[dict[str, list[Replica]], list[Setup]]]:
    """Start the replica groups of ``phase`` that ``setups`` use, all up together
    (``start(cache)`` each); a group that does not start has its setups recorded in
    ``failed``. Yields the groups that started and their setups in run order; stops them after."""
    by_group = {cache: g for cache in phase if (g := [s for s in setups if s.cache == cache])}
    with contextlib.ExitStack() as stack:
        alive: dict[str, list[Replica]] = {}
        for cache, group in by_group.items():
            log(f"[{label(cache)} replicas] {', '.join(s.name for s in group)}")
            try:
                alive[cache] = stack.enter_context(start(cache))
            except Exception as exc:  # the group's replicas or services did not start
                message = f"{type(exc).__name__}: {exc}"
                log(f"  {label(cache)} group failed: {message}")
                for setup in group:
                    failed.setdefault(setup, message)
        yield alive, [s for cache in alive for s in by_group[cache]]


def idle_floors(alive: Mapping[str, Sequence[Replica]], p: Params, log: Log) -> dict[str, float]:
    """Each started group's idle-miss TTFT (:func:`measure_idle_miss`); a group whose
    measurement fails is left out (a reference figure: the setups still run)."""
    out: dict[str, float] = {}
    for cache, replicas in alive.items():
        try:
            out[cache] = measure_idle_miss(replicas, p, cache, log)
        except Exception as exc:
            log(f"  idle-miss TTFT failed: {type(exc).__name__}: {exc}")
    return out


def run_interleaved(
    setups: Sequence[Setup],
    phases: Sequence[Sequence[str]],
    p: Params,
    model_dir: str,
    workdir: str,
    seed_of: Callable[[Setup, int], int],
    log: Log,
    idle_floor: bool = True,
) -> Outcome:
    """Run every setup ``p.repeats`` times: per phase, its groups' replicas up together and
    their setups interleaved (every other repeat in reverse). ``seed_of(setup, repeat)``
    gives each run's tenant texts. A group that fails to start, or a setup that fails a
    run, is recorded in ``failed``; the others go on."""
    out = Outcome({s: [] for s in setups})

    def start(cache: str) -> AbstractContextManager[list[Replica]]:
        return replica_group(cache, model_dir, workdir, p.num_blocks, log)

    for phase in phases:
        with phase_up(setups, phase, start, out.failed, log) as (alive, order):
            if idle_floor:
                out.idle_miss.update(idle_floors(alive, p, log))
            if len(order) > 1:
                log(f"  interleaving {', '.join(s.name for s in order)}; every other repeat in reverse")
            for repeat in range(p.repeats):
                for setup in interleaved(order, repeat):
                    if setup in out.failed:
                        continue
                    t0 = time.monotonic()
                    try:
                        summary = run_once(
                            setup, alive[setup.cache], model_dir, workdir, p, seed_of(setup, repeat)
                        )
                    except Exception as exc:  # a setup that cannot run is a result
                        out.failed[setup] = f"{type(exc).__name__}: {exc}"
                        log(f"  {setup.name}: {out.failed[setup]}")
                        continue
                    out.runs[setup].append(summary)
                    log(
                        f"  {setup.name} [{repeat + 1}/{p.repeats}]: hit {summary['hit_rate']}, "
                        f"TTFT p50 {summary['ttft_p50_s']} s p90 {summary['ttft_p90_s']} s, "
                        f"{summary['requests_per_s']} req/s, {summary['errors']} errors "
                        f"({time.monotonic() - t0:.0f} s)"
                    )
    return out
