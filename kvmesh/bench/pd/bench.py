"""``kvmesh bench pd``: prefill/decode disaggregation against colocated serving.

Four setups, each two vLLM replicas with one core each (every process of a replica pinned
to its core; replica 0 of every setup on core 0, replica 1 on core 1), serve the same
workload (:mod:`kvmesh.bench.pd.workload`: prompts of 1,500-2,500 tokens, outputs of
128-256 tokens, Poisson arrivals at a rate the pair sustains):

1. ``colocated``: 2 kv_both kvmesh replicas behind the kvmesh router (``kvmesh`` policy);
2. ``kvmesh-pd``: 1 kv_producer + 1 kv_consumer behind ``kvmesh router --pd``;
3. ``vllm-router-pd``: vllm-router ``--vllm-pd-disaggregation`` over vLLM's ExampleConnector
   in kv_producer / kv_consumer roles sharing a directory (the PD stack that runs on CPU
   without NIXL);
4. ``plain-rr``: plain vLLM replicas behind round-robin (the kvmesh router's policy).

Setups take turns trial by trial, every other trial in reverse order, and each trial's
prompts are new to every setup but the same for all of them (paired trials): ratios are the
median over trials of the per-trial ratio. Eight replicas at once do not fit this machine's
memory beside the other work on it, so the setups run in two phases; ``kvmesh-pd`` stays up
through both, so that each ratio the targets name is measured within one phase. Load
average is recorded per trial. Also measured, in the same run: the KV transfer's GB/s over
loopback against a raw socket send of the same bytes (:func:`measure_transfer`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.bench.common.peers import VllmRouter, vllm_router_binary
from kvmesh.bench.pd.workload import make_workload, replay
from kvmesh.bench.runner import interleaved, median_ratio, print_table, provenance, write_json, write_panels
from kvmesh.errors import ProcessError
from kvmesh.harness.connector import pd_config
from kvmesh.harness.ports import free_port
from kvmesh.harness.processes import Service, install_signal_handlers, log_tail
from kvmesh.harness.replicas import Replica, start_replicas_on
from kvmesh.harness.router import RouterProcess

MODEL_NAME = "tiny"
SETUPS = ("colocated", "kvmesh-pd", "vllm-router-pd", "plain-rr")
PHASES: tuple[tuple[str, ...], ...] = (
    ("colocated", "kvmesh-pd", "plain-rr"),
    ("kvmesh-pd", "vllm-router-pd"),
)
TARGETS = {  # (numerator, denominator, metric, bound): the targets
    "itl_p90_pd_over_colocated": ("kvmesh-pd", "colocated", "itl_p90_s", 0.6),
    "ttft_p50_pd_over_colocated": ("kvmesh-pd", "colocated", "ttft_p50_s", 1.5),
    "ttft_p50_pd_over_vllm_router_pd": ("kvmesh-pd", "vllm-router-pd", "ttft_p50_s", 0.8),
}
EXTRA_RATIOS = {
    "itl_p99_pd_over_colocated": ("kvmesh-pd", "colocated", "itl_p99_s"),
    "requests_per_s_pd_over_colocated": ("kvmesh-pd", "colocated", "requests_per_s"),
    "ttft_p50_plain_rr_over_colocated": ("plain-rr", "colocated", "ttft_p50_s"),
    "itl_p90_pd_over_vllm_router_pd": ("kvmesh-pd", "vllm-router-pd", "itl_p90_s"),
}
METRICS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p90_s", "itl_p99_s",
           "requests_per_s", "output_tokens_per_s")  # fmt: skip
PANELS = (("ttft_p50_s", "TTFT p50 (s)"), ("itl_p90_s", "ITL p90 (s)"), ("itl_p99_s", "ITL p99 (s)"),
          ("requests_per_s", "requests/s"))  # fmt: skip
Log = Callable[[str], None]


@dataclass(frozen=True)
class Params:
    trials: int
    requests: int
    rate_per_s: float
    prompt_tokens: tuple[int, int] = (1500, 2500)
    output_tokens: tuple[int, int] = (128, 256)
    transfer_mb: int = 256
    num_blocks: int | None = None  # each replica's own KV cache in blocks (None: vLLM's default)


def params(quick: bool, smoke: bool = False) -> Params:
    if smoke:  # the command runs end to end (the test suite's); its figures mean nothing
        return Params(1, 2, 1.0, (300, 600), (8, 16), transfer_mb=8, num_blocks=64)
    # 0.4 requests/s: the colocated pair sustains it (each request is ~0.6 s of prefill and
    # ~5 s of decode at ~25 ms a token, so about two run at a time) with room for bursts.
    return Params(1, 4, 0.4, transfer_mb=64) if quick else Params(2, 8, 0.4)


# -- pure helpers (unit-tested) --------------------------------------------------------------
def trial_order(phase: Sequence[str], trial: int) -> list[str]:
    """The phase's setups in turn, every other trial in reverse (drift hits all alike)."""
    return interleaved(phase, trial)


def paired_ratio(trials: Sequence[Mapping[str, Any]], num: str, den: str, metric: str) -> float | None:
    """Median over the trials both setups completed of ``num[metric] / den[metric]`` (rows
    carry ``setup``, ``phase``, ``trial``); pairs are matched by (phase, trial)."""
    by = {(t["setup"], t["phase"], t["trial"]): t for t in trials}
    pairs = [(row, by[den, phase, trial]) for (setup, phase, trial), row in by.items()
             if setup == num and (den, phase, trial) in by]  # fmt: skip
    return median_ratio([a.get(metric) for a, _ in pairs], [b.get(metric) for _, b in pairs])


def aggregate(setup: str, trials: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A setup's row: the median of each metric over its trials, summed failures."""
    mine = [t for t in trials if t["setup"] == setup]
    row: dict[str, Any] = {"setup": setup, "trials": len(mine)}
    for key in METRICS:
        values = [float(t[key]) for t in mine if t.get(key) is not None]
        row[key] = round(statistics.median(values), 5) if values else None
    row["errors"] = sum(int(t.get("errors", 0)) for t in mine)
    errs = [t["first_error"] for t in mine if t.get("first_error")]
    if errs:
        row["first_error"] = errs[0]
    return row


def targets(trials: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (num, den, metric, bound) in TARGETS.items():
        ratio = paired_ratio(trials, num, den, metric)
        out[name] = {"ratio": ratio, "target_le": bound, "met": None if ratio is None else ratio <= bound}
    for name, (num, den, metric) in EXTRA_RATIOS.items():
        out[name] = {"ratio": paired_ratio(trials, num, den, metric)}
    return out


# -- setups ----------------------------------------------------------------------------------
def transfer_config(setup: str, role: str, workdir: str) -> dict[str, Any] | None:
    """A replica's ``--kv-transfer-config`` in ``setup`` (``role``: kv_both/producer/consumer)."""
    if setup in ("colocated", "kvmesh-pd"):
        # The CPU tier only (every prompt is new, nothing is shared); the scheduler-to-worker
        # socket goes to the replica's own temporary directory (kvmesh.harness.processes.own_tmp)
        return pd_config(role)
    if setup == "vllm-router-pd":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": os.path.join(workdir, "example-kv")},
        }
    return None


ROLES = {
    "colocated": ("kv_both", "kv_both"),
    "kvmesh-pd": ("kv_producer", "kv_consumer"),
    "vllm-router-pd": ("kv_producer", "kv_consumer"),
    "plain-rr": ("", ""),
}


# ExampleConnector saves the KV of a prompt's first scheduled step only, and its consumer
# then fails the engine (``shape mismatch: value tensor of shape [2048, 2, 128] cannot be
# broadcast to indexing result of shape [2432, 2, 128]``) for any prompt longer than
# vLLM-CPU's default 2,048-token step. One step must hold the whole prompt; this only changes
# how the producer (no decodes to stall) and the consumer (one-token prefills) batch.
# ExampleConnector lacks vLLM's SupportsHMA: its replicas keep the hybrid KV cache manager off
# (vLLM would turn it off itself; kvmesh's replicas leave it on, one group on a dense model).
EXTRA_ARGS: dict[str, tuple[str, ...]] = {
    "vllm-router-pd": ("--max-num-batched-tokens", "4096", "--disable-hybrid-kv-cache-manager")
}


class VllmRouterPD(VllmRouter):
    """vllm-router in its vLLM PD mode over one prefill and one decode worker."""

    name = "vllm-router (pd)"

    def __init__(self, prefill_url: str, decode_url: str, log_path: str | None = None) -> None:
        self.port = free_port()
        args = [vllm_router_binary(), "--host", "127.0.0.1", "--port", str(self.port),
                "--vllm-pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url,
                "--policy", "round_robin", "--log-level", "warning"]  # fmt: skip
        # Another command line, the same service (url, readiness) as VllmRouter's.
        Service.__init__(self, args, dict(os.environ), log_path)


Front = VllmRouterPD | RouterProcess


def front(setup: str, urls: Sequence[str], model_dir: str, log_path: str) -> Front:
    """The setup's router (started by the caller)."""
    if setup == "vllm-router-pd":
        return VllmRouterPD(urls[0], urls[1], log_path)
    from kvmesh.router.config import RouterConfig
    from kvmesh.routing.config import ReplicaConfig

    if setup == "kvmesh-pd":
        replicas = (ReplicaConfig(url=urls[0], role="prefill"), ReplicaConfig(url=urls[1], role="decode"))
        cfg = RouterConfig(model=model_dir, replicas=replicas, port=0, pd={"enabled": True})
    else:
        policy = "round-robin" if setup == "plain-rr" else "kvmesh"
        cfg = RouterConfig(model=model_dir, replicas=tuple(ReplicaConfig(url=u) for u in urls), port=0,
                           policy=policy)  # fmt: skip
    return RouterProcess(cfg, log_path)


@contextlib.contextmanager
def setup_replicas(
    setup: str, model_dir: str, workdir: str, log: Log, num_blocks: int | None = None
) -> Iterator[list[Replica]]:
    """Start the setup's two replicas (they load in parallel); stop them after."""
    with contextlib.ExitStack() as stack:
        reps = [
            Replica(model_dir, name=MODEL_NAME, cpu=i, num_blocks=num_blocks,
                    kv_transfer=transfer_config(setup, role, workdir),
                    log_path=os.path.join(workdir, f"{setup}-replica{i}.log"), pin_process=True,
                    extra_args=list(EXTRA_ARGS.get(setup, ())))
            for i, role in enumerate(ROLES[setup])
        ]  # fmt: skip
        took = start_replicas_on(stack, reps)
        log(f"  {setup}: 2 replicas ready in {took:.0f} s")
        yield reps


def warm_up(url: str, model_dir: str, seed: int) -> dict[str, Any]:
    """Two long requests through the setup's router: the first of a new process carries
    seconds of lazy initialisation, on both halves of a PD pair."""
    reqs = make_workload(model_dir, 2, seed, 1.0, (1800, 1800), (8, 8))
    return replay(url, MODEL_NAME, [r.__class__(r.prompt, r.prompt_tokens, r.max_tokens, 0.0) for r in reqs])


# -- the run -------------------------------------------------------------------------------------
TRANSFER_TARGET = 0.8  # the pull's GB/s against a raw socket send of the same bytes
TRANSFER_DIMS = (4, 8, 64)  # layers, KV heads, head size: the tiny model's float32 layout


def measure_transfer(nbytes: int, repeats: int = 5) -> dict[str, Any]:
    """kvmesh's transfer (:func:`kvmesh.transport.loopback.transfer_vs_raw`: a pull from a
    producer process, framing, checks, pool slots, checksums) against a raw loopback send of
    the same bytes, interleaved; ``error`` says why it could not run."""
    try:
        from kvmesh.transport.loopback import transfer_vs_raw

        layers, heads, head = TRANSFER_DIMS
        tokens = max(256, nbytes // (layers * heads * head * 2 * 4) // 256 * 256)
        got = transfer_vs_raw(tokens=tokens, dims=TRANSFER_DIMS, repeats=repeats)
    except (ImportError, ConnectionError, OSError) as exc:
        return {"bytes": nbytes, "error": f"{type(exc).__name__}: {exc}"}
    ratio = float(got["ratio"])
    # Every repeat's figures are kept beside the medians.
    rounded = {
        k: round(v, 3) if isinstance(v, float) else [round(x, 4) for x in v] if isinstance(v, list) else v
        for k, v in got.items()
    }
    return {**rounded, "target_ge": TRANSFER_TARGET, "met": ratio >= TRANSFER_TARGET}


def _start(
    setup: str,
    owner: contextlib.ExitStack,
    model_dir: str,
    workdir: str,
    log: Log,
    urls: dict[str, list[str]],
    num_blocks: int | None = None,
) -> Front:
    """The setup's replicas (their URLs into ``urls``) and router, stopped when ``owner``
    closes; warmed up."""
    reps = owner.enter_context(setup_replicas(setup, model_dir, workdir, log, num_blocks))
    urls[setup] = [r.url for r in reps]
    svc = front(setup, [r.url for r in reps], model_dir, os.path.join(workdir, f"{setup}-router.log"))
    owner.callback(svc.stop)
    svc.start(timeout=180)
    w = warm_up(svc.url, model_dir, 90 + SETUPS.index(setup))
    if not w.get("ok"):
        raise ProcessError(f"warm-up through {svc.name} failed: {w.get('first_error')}")
    return svc


def run_phases(p: Params, model_dir: str, workdir: str, setups: Sequence[str], log: Log) -> dict[str, Any]:
    trials: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    threshold: dict[str, Any] | None = None
    phases = [tuple(s for s in ph if s in setups) for ph in PHASES]
    phases = [ph for ph in phases if ph]
    with contextlib.ExitStack() as keep:  # setups used by a later phase too
        live: dict[str, Front] = {}
        urls: dict[str, list[str]] = {}
        for pi, phase in enumerate(phases):
            later = {s for ph in phases[pi + 1 :] for s in ph}
            with contextlib.ExitStack() as stack:  # setups of this phase only
                for s in phase:
                    if s in live or s in failures:
                        continue
                    owner = keep if s in later else stack
                    log(f"phase {pi + 1}: starting {s}")
                    try:
                        live[s] = _start(s, owner, model_dir, workdir, log, urls, p.num_blocks)
                    except (OSError, ProcessError, TimeoutError) as exc:
                        failures[s] = f"{type(exc).__name__}: {exc}"
                        log(f"  {s} cannot run: {failures[s]}")
                for t in range(p.trials):
                    seed = 7000 + 100 * pi + t
                    reqs = make_workload(
                        model_dir, p.requests, seed, p.rate_per_s, p.prompt_tokens, p.output_tokens
                    )
                    for s in trial_order(phase, t):
                        if s not in live:
                            continue
                        row = replay(live[s].url, MODEL_NAME, reqs)
                        row.update({"setup": s, "phase": pi + 1, "trial": t})
                        if row["errors"]:  # what the replicas said, for the report
                            logs = [os.path.join(workdir, f"{s}-replica{i}.log") for i in range(2)]
                            row["replica_log_errors"] = [log_tail(path, limit=3, chars=600) for path in logs]
                        trials.append(row)
                        log(f"  phase {pi + 1} trial {t} {s}: ttft p50 {row.get('ttft_p50_s')} s, itl p90 "
                            f"{row.get('itl_p90_s')} s, {row.get('requests_per_s')} req/s, "
                            f"{row['errors']} errors, load {row['load_avg_after']}")  # fmt: skip
                if "kvmesh-pd" in live and "kvmesh-pd" in phase and "kvmesh-pd" not in later:
                    threshold = _probe_threshold(urls["kvmesh-pd"], model_dir, workdir, log)
                for s in phase:
                    if s not in later:
                        live.pop(s, None)
    return {"trials": trials, "failures": failures, "threshold_probe": threshold}


def _probe_threshold(urls: Sequence[str], model_dir: str, workdir: str, log: Log) -> dict[str, Any]:
    """:func:`kvmesh.bench.pd.threshold.probe` over the kvmesh PD pair, through a second
    router whose threshold is 0."""
    from kvmesh.bench.pd.threshold import probe
    from kvmesh.router.config import RouterConfig
    from kvmesh.routing.config import ReplicaConfig

    replicas = (ReplicaConfig(url=urls[0], role="prefill"), ReplicaConfig(url=urls[1], role="decode"))
    cfg = RouterConfig(
        model=model_dir, replicas=replicas, port=0, pd={"enabled": True, "pd_threshold_tokens": 0}
    )
    try:
        with RouterProcess(cfg, os.path.join(workdir, "threshold-router.log")) as router:
            router.start(timeout=60)
            got = probe(router.url, urls[1], model_dir, MODEL_NAME)
    except (OSError, ProcessError, TimeoutError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    log(f"  threshold probe: {got}")
    return got


def run(quick: bool, json_path: str, plot_path: str, model_dir: str | None = None,
        setups: Sequence[str] | None = None, smoke: bool = False) -> dict[str, Any]:  # fmt: skip
    from kvmesh.bench.ttft.proc import environment
    from kvmesh.harness.model import DEFAULT_TINY_MODEL, ensure_model

    prov = provenance("pd")  # the code this run measures: read now, the tree may move on
    install_signal_handlers()
    p = params(quick, smoke)
    names = list(setups or SETUPS)
    bad = [s for s in names if s not in SETUPS]
    if bad:
        raise ValueError(f"unknown setup(s) {', '.join(bad)}; valid: {', '.join(SETUPS)}")
    model = ensure_model(model_dir or DEFAULT_TINY_MODEL)
    print(f"kvmesh bench pd: {p}")
    # Kept after the run (the replicas' and routers' logs say why a setup failed); the
    # ExampleConnector's KV files are not.
    workdir = tempfile.mkdtemp(prefix="kvmesh-bench-pd-")
    print(f"  logs in {workdir}")
    try:
        done = run_phases(p, model, workdir, names, print)
    finally:
        shutil.rmtree(os.path.join(workdir, "example-kv"), ignore_errors=True)
    transfer = measure_transfer(p.transfer_mb << 20)
    rows = [aggregate(s, done["trials"]) for s in names]
    for r in rows:
        if r["setup"] in done["failures"]:
            r["error"] = done["failures"][r["setup"]]
    result = {
        "environment": environment(model, quick or smoke, p.trials),
        "params": {**p.__dict__, "phases": [list(ph) for ph in PHASES]},
        "results": rows,
        "targets": targets(done["trials"]),
        "transfer": transfer,
        "threshold_probe": done["threshold_probe"],
        "trials": done["trials"],
    }
    print_table(rows, ("setup", *METRICS, "errors"))
    for name, t in result["targets"].items():
        print(f"  {name}: {t}")
    print(f"  transfer: {transfer}")
    write_json(json_path, result, prov)
    title = f"PD vs colocated, 2 replicas x 1 core ({p.trials} trial(s) x {p.requests} requests)"
    write_panels(plot_path, {r["setup"]: r for r in rows if "error" not in r}, PANELS, title)
    return result


def main(args: argparse.Namespace) -> int:
    """``kvmesh bench pd`` (the parser: :mod:`kvmesh.bench.pd.cli`)."""
    setups = [s.strip() for s in args.setups.split(",")] if args.setups else None
    run(args.quick, args.json, args.plot, args.model, setups, smoke=args.smoke)
    return 0
