"""What ``kvmesh bench router`` runs: the setups (router x policy x replica kind), the
workloads (the default one the router was tuned on, two held-out ones it never was), the
LMCache replica group with a shared Redis, and the interleaved run over all of them.

Controls: every vllm-router policy runs over plain *and* kvmesh replicas, and the kvmesh
router runs over plain replicas too, so a row's gain splits into what the cache gives
(same router, other replicas) and what routing gives (same replicas, other router).
vllm-router's session-affinity policies (``consistent_hash``, ``sticky_least_loaded``)
read the ``x-session-id`` header every workload sends (vllm-router's
``policies/hash_key.rs`` checks it first), the header the kvmesh router reads too.

Fair peers: LMCache replicas get what kvmesh replicas get, a Redis both replicas of the
group share (LMCache's ``resp`` L2 adapter; kvmesh's ``redis://`` tier), beside 1 GB of L1
DRAM per ``lmcache server`` (the launcher's default, :mod:`kvmesh.bench.common.peers`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

from kvmesh.bench.common import groups
from kvmesh.bench.common.corpus import zipf_words
from kvmesh.bench.common.groups import Setup
from kvmesh.bench.common.peers import VLLM_ROUTER_POLICIES  # all of vllm-router 0.1.17's
from kvmesh.bench.common.workload import Arrival, RunResult, Workload, replay
from kvmesh.bench.router.costcases import (
    COST_SETUPS,
    SLOW,
    SLOW_SETUPS,
    cost_records,
    measure_capacity,
    needs_capacity,
    resolve,
)
from kvmesh.bench.runner import interleaved
from kvmesh.harness.events import EventForwarder
from kvmesh.harness.replicas import Replica, start_replicas_on

Log = Callable[[str], None]
LMCACHE_POLICIES = ("round_robin", "cache_aware", "kv_aware", "consistent_hash")
LMCACHE_L1_GB = 1.0  # what kvmesh.bench.common.peers.LMCacheServer passes (its default)

SETUPS: tuple[Setup, ...] = (
    *(Setup("vllm-router", p, "none") for p in VLLM_ROUTER_POLICIES),
    Setup("kvmesh", "kvmesh", "none"),
    COST_SETUPS[0],  # kvmesh:cost over plain replicas (costcases.py)
    *(Setup("vllm-router", p, "lmcache") for p in LMCACHE_POLICIES),
    *(Setup("vllm-router", p, "kvmesh") for p in VLLM_ROUTER_POLICIES),
    Setup("kvmesh", "round-robin", "kvmesh"),
    Setup("kvmesh", "kvmesh", "kvmesh"),
    COST_SETUPS[1],  # ... and over kvmesh replicas
    *SLOW_SETUPS,  # kvmesh and cost over the slow shared tier
)
SETUP_NAMES = tuple(s.name for s in SETUPS)
# LMCache's group (its servers and L1) runs in a phase of its own, then the plain and the
# kvmesh groups up together, their setups interleaved.
PHASES: tuple[tuple[str, ...], ...] = (("lmcache",), ("none", "kvmesh"), (SLOW,))
REPLICA_KIND = {"none": "plain vLLM", "lmcache": "LMCache MP (L1 1 GB + shared Redis)",
                "kvmesh": "kvmesh (shared Redis)",
                SLOW: "kvmesh (shared Redis behind a 50 ms, 100 MB/s link)"}  # fmt: skip


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload shape. ``synthetic``: :meth:`Workload.multi_tenant`; ``trace``: the
    shared conversation trace (:mod:`kvmesh.bench.router.trace_workload`)."""

    name: str
    kind: Literal["synthetic", "trace"]
    held_out: bool
    seed_base: int
    tenants: int = 12
    users: int = 2
    turns: int = 3
    prefix_words: int = 250
    prefix_words_max: int = 0
    question_words: int = 40
    zipf: bool = False  # realistic word distribution instead of the 15-syllable vocabulary
    arrival: Arrival = "sessions"
    concurrency: int = 4
    conversations: int = 16  # trace: conversations replayed
    rate: float = 4.0  # trace: requests per second


def workloads(quick: bool) -> tuple[WorkloadSpec, ...]:
    """The default workload (the one the router's weights were tuned on) and the held-out
    ones (never tuned on: other seeds, tenant counts, prompt lengths, word distribution,
    arrival; and the real trace)."""
    turns = 2 if quick else 3
    return (
        WorkloadSpec("default", "synthetic", False, 1000, 12, 2, turns, 250),
        WorkloadSpec("held-out", "synthetic", True, 7000, 8, 3, 2, 200, 700, 25, True, "turns"),
        WorkloadSpec("trace", "trace", True, 9000, conversations=10 if quick else 40),
    )


def select_setups(names: Sequence[str] | None) -> list[Setup]:
    """The setups named (all when ``names`` is empty), in run order."""
    if not names:
        return list(SETUPS)
    bad = [n for n in names if n not in SETUP_NAMES]
    if bad:
        raise ValueError(f"unknown setup(s) {', '.join(bad)}; valid: {', '.join(SETUP_NAMES)}")
    return [s for s in SETUPS if s.name in names]


def run_seed(spec: WorkloadSpec, setup: Setup, repeat: int) -> int:
    """Texts of one run: different for every workload, setup and repeat, so no setup finds
    another's prompts in a cache that outlives a run (the shared tiers do)."""
    return spec.seed_base * 10_000 + 100 * SETUPS.index(setup) + repeat


def run_order(setups: Sequence[Setup], repeat: int, workload_index: int) -> list[Setup]:
    """Setups in the order one (repeat, workload) round runs them: reversed every other
    round, so over the rounds every setup runs as often early as late in a round and no
    ratio between two setups rides on the machine's drift."""
    return interleaved(setups, repeat + workload_index)


def build_workload(spec: WorkloadSpec, seed: int) -> Workload:
    text = zipf_words if spec.zipf else None
    return Workload.multi_tenant(spec.tenants, spec.users, spec.turns, spec.prefix_words,
                                 spec.question_words, seed=seed, prefix_words_max=spec.prefix_words_max,
                                 text=text)  # fmt: skip


def run_workload(spec: WorkloadSpec, url: str, seed: int, on_done: Callable[[], None] | None) -> RunResult:
    if spec.kind == "trace":
        from kvmesh.bench.router.trace_workload import load_conversations, replay_timed, schedule

        requests = schedule(load_conversations(spec.conversations), spec.rate)
        return replay_timed(requests, url, groups.MODEL_NAME, seed, on_done=on_done)
    workload = build_workload(spec, seed)
    return replay(workload, url, groups.MODEL_NAME, spec.concurrency, on_done=on_done, arrival=spec.arrival)


def num_requests(spec: WorkloadSpec) -> int:
    if spec.kind == "trace":
        from kvmesh.bench.router.trace_workload import load_conversations

        return len(load_conversations(spec.conversations))
    return spec.tenants * spec.users * spec.turns


# -- the LMCache group with a shared Redis ----------------------------------------------------
@contextlib.contextmanager
def lmcache_group(model_dir: str, workdir: str, num_blocks: int, log: Log) -> Iterator[list[Replica]]:
    """Two replicas, each over its own ``lmcache server`` (1 GB L1), both servers writing
    through to one Redis (``--l2-adapter resp``), as both kvmesh replicas share one."""
    from kvmesh.bench.common.peers import LMCACHE_ENV, LMCacheServer, require_lmcache, with_pythonpath
    from kvmesh.harness.services import RedisServer

    path = require_lmcache()
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(RedisServer())
        servers = []
        for i in range(groups.REPLICAS):
            server = LMCacheServer(path, os.path.join(workdir, f"lmcache{i}.log"), l1_size_gb=LMCACHE_L1_GB)
            # two I/O threads: the machine has two cores
            l2 = {"type": "resp", "host": "127.0.0.1", "port": redis.port, "num_workers": 2}
            server.args += ["--l2-adapter", json.dumps(l2)]
            stack.callback(server.stop)
            servers.append(server)
        for server in servers:
            server.start()
        log(f"  lmcache servers on ZMQ ports {', '.join(str(s.port) for s in servers)}, L2 {redis.url}")
        env_extra = {**groups.REPLICA_ENV, **LMCACHE_ENV}
        if path:
            env_extra["PYTHONPATH"] = with_pythonpath(path)["PYTHONPATH"]
        forwarders = [stack.enter_context(EventForwarder()) for _ in servers]
        replicas = [
            Replica(model_dir, name=groups.MODEL_NAME, cpu=i, num_blocks=num_blocks,
                    kv_transfer=s.connector(), events_port=forwarders[i].in_port,
                    events_out=forwarders[i].out_port,
                    log_path=os.path.join(workdir, f"lmcache-replica{i}.log"),
                    env_extra=env_extra, extra_args=list(groups.REPLICA_ARGS), pin_process=True)
            for i, s in enumerate(servers)
        ]  # fmt: skip
        took = start_replicas_on(stack, replicas)
        log(f"  {len(replicas)} replicas ready in {took:.0f} s; warming up")
        groups.warm_up([r.url for r in replicas], "lmcache")
        yield replicas


def _group(
    cache: str, model_dir: str, workdir: str, num_blocks: int, log: Log
) -> AbstractContextManager[list[Replica]]:
    if cache == "lmcache":
        return lmcache_group(model_dir, workdir, num_blocks, log)
    return groups.replica_group(cache, model_dir, workdir, num_blocks, log)


# -- one run and the interleaved rounds --------------------------------------------------------
def run_once(
    setup: Setup, spec: WorkloadSpec, replicas: Sequence[Replica], model_dir: str, workdir: str, seed: int
) -> dict[str, Any]:
    """One replay of ``spec`` (texts from ``seed``) through a fresh router of the setup,
    the replicas' prefix caches reset first: ``RunResult.summary()`` (+ the first error)."""
    from tqdm import tqdm

    groups.reset_prefix_caches([r.url for r in replicas])
    with groups.router_for(setup, replicas, model_dir, workdir) as url:
        for i in range(len(replicas)):  # the router's own first requests (short: no full block)
            groups.chat(url, f"router warm-up {i}")
        with tqdm(
            total=num_requests(spec),
            desc=f"  {setup.name} {spec.name}",
            unit="req",
            leave=False,
            disable=None,
        ) as bar:
            result = run_workload(spec, url, seed, bar.update)
        extra = cost_records(url) if setup.policy == "cost" else {}
    offered = {"rate": spec.rate} if spec.kind == "trace" else {"concurrency": spec.concurrency}
    summary = {**result.summary(), **extra, "offered": offered}
    errors = [s.error for s in result.samples if not s.ok]
    if errors:
        summary["error"] = errors[0]
    return summary


Runs = dict[str, dict[Setup, list[dict[str, Any]]]]  # workload -> setup -> summaries


def run_all(
    setups: Sequence[Setup],
    specs: Sequence[WorkloadSpec],
    repeats: int,
    num_blocks: int,
    model_dir: str,
    workdir: str,
    log: Log,
) -> tuple[Runs, dict[Setup, str], dict[str, float], dict[str, dict[str, float]]]:
    """Every setup x workload ``repeats`` times, phase by phase (:data:`PHASES`): a phase's
    groups up together, then rounds of (repeat, workload) with the setups in
    :func:`run_order`. Returns the runs, the setups that failed (and why), each group's
    idle-miss TTFT floor on the default workload's prompts, and each phase's measured
    capacity (when the workloads have offered loads: :mod:`kvmesh.bench.router.costcases`)."""
    runs: Runs = {spec.name: {s: [] for s in setups} for spec in specs}
    failed: dict[Setup, str] = {}
    idle: dict[str, float] = {}
    capacities: dict[tuple[str, ...], dict[str, float]] = {}
    floor_params = groups.Params(1, 1, 1, 1, 1, prefix_words=specs[0].prefix_words, num_blocks=num_blocks)

    def start(cache: str) -> AbstractContextManager[list[Replica]]:
        return _group(cache, model_dir, workdir, num_blocks, log)

    for phase in PHASES:
        with groups.phase_up(setups, phase, start, failed, log, REPLICA_KIND.__getitem__) as (alive, order):
            idle.update(groups.idle_floors(alive, floor_params, log))
            phase_specs = specs
            if alive and any(needs_capacity(s) for s in specs):  # offered loads from this phase's capacity
                probe = next((c for c in ("kvmesh", SLOW) if c in alive), next(iter(alive)))
                cap = measure_capacity(alive[probe], probe, specs, model_dir, workdir, log)
                capacities[phase] = cap.__dict__
                phase_specs = resolve(specs, cap)
            elif alive:  # light synthetic loads only (one at a time): nothing to measure
                phase_specs = resolve(specs, None)
            for repeat in range(repeats):
                for wi, spec in enumerate(phase_specs):
                    for setup in run_order(order, repeat, wi):
                        if setup in failed:
                            continue
                        t0 = time.monotonic()
                        try:
                            seed = run_seed(spec, setup, repeat)
                            summary = run_once(setup, spec, alive[setup.cache], model_dir, workdir, seed)
                        except Exception as exc:  # a setup that cannot run is a result
                            failed[setup] = f"{type(exc).__name__}: {exc}"
                            log(f"  {setup.name}: {failed[setup]}")
                            continue
                        runs[spec.name][setup].append(summary)
                        log(f"  {setup.name} {spec.name} [{repeat + 1}/{repeats}]: "
                            f"hit {summary['hit_rate']}, "
                            f"TTFT p90 {summary['ttft_p90_s']} s, {summary['errors']} errors "
                            f"({time.monotonic() - t0:.0f} s)")  # fmt: skip
    return runs, failed, idle, {"+".join(k): v for k, v in capacities.items()}


def rows(
    runs: Mapping[Setup, Sequence[Mapping[str, Any]]], failed: Mapping[Setup, str]
) -> list[dict[str, Any]]:
    """One row per setup: medians over its repeats, or the reason it failed."""
    out = []
    for s, r in runs.items():
        row = groups.error_row(s, failed[s]) if s in failed and not r else groups.aggregate(s, r)
        row["replicas"] = REPLICA_KIND[s.cache]
        row["runs"] = len(r)
        out.append(row)
    return out
