"""``kvmesh bench router``: routers x replica kinds side by side on three workloads.

Two vLLM replicas per replica kind (one core each: every process of a replica is pinned
to its core, since vLLM's engine core busy-polls; each replica's own KV cache capped at
``NUM_BLOCKS`` blocks, fewer than the tenants' prefixes). The setups
(:data:`kvmesh.bench.router.setups.SETUPS`): every vllm-router policy over plain and over
kvmesh replicas, four over LMCache replicas, and the kvmesh router over kvmesh *and* plain
replicas (the controls that split the cache's share from the router's). The workloads
(:func:`kvmesh.bench.router.setups.workloads`): the default one the router was tuned on,
a held-out synthetic one and the shared conversation trace, never tuned on. Setups of
groups that are up together take turns round by round, every other round in reverse.

Also measured: the kvmesh router's added latency on realistic text, streaming, with a
live index, at 2k and 32k tokens (:mod:`kvmesh.bench.router.overhead`), and the block index's
lookup p99 at 1M blocks as wall-clock time under concurrent event ingestion
(:mod:`kvmesh.bench.router.index_lookup`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvmesh.bench.common.groups import Params, Setup
from kvmesh.bench.common.workload import METRICS, Arrival
from kvmesh.bench.router import setups as rs
from kvmesh.bench.router.costcases import LOADS, SLOW, cost_targets, with_loads
from kvmesh.bench.runner import METRIC_PANELS, median_ratio, print_table, provenance, write_json
from kvmesh.harness.model import DEFAULT_TINY_MODEL, ensure_model
from kvmesh.harness.processes import install_signal_handlers

NUM_BLOCKS = 40  # 5,120 tokens per replica: fewer than the tenants' prefixes
PREFIX_WORDS = 250  # the default workload's system prompts: ~1,000 tokens with the template
TTFT_RATIO_TARGET = 0.8  # kvmesh over kvmesh replicas vs the best vllm-router row of any kind
PLAIN_RATIO_TARGET = 0.9  # kvmesh router over plain replicas vs the best vllm-router over plain
OVERHEAD_TARGETS_MS = {2000: 2.0, 32000: 5.0}
INDEX_P99_TARGET_MS = 1.0
SETUPS = rs.SETUPS
SETUP_NAMES = rs.SETUP_NAMES
select_setups = rs.select_setups


def params(quick: bool, arrival: Arrival = "sessions", prefix_words: int = 0) -> Params:
    """The default workload's shape as :class:`~kvmesh.bench.common.groups.Params` (read by
    ``kvmesh bench epp-ttft`` and the simulator's ``bench_router`` workload)."""
    words = prefix_words or PREFIX_WORDS
    turns, repeats, overhead_n = (2, 1, 100) if quick else (3, 2, 200)
    return Params(12, 2, turns, concurrency=4, repeats=repeats, overhead_n=overhead_n, arrival=arrival,
                  prefix_words=words, num_blocks=NUM_BLOCKS)  # fmt: skip


# -- pure helpers (unit-tested) --------------------------------------------------------------
def paired_ratio(
    ours: Sequence[Mapping[str, Any]], theirs: Sequence[Mapping[str, Any]], key: str
) -> float | None:
    """Median over repeats of ours[i][key] / theirs[i][key]: repeat i of both ran in the same
    round, minutes apart at most, so the machine's drift cancels in each ratio."""
    return median_ratio([a.get(key) for a in ours], [b.get(key) for b in theirs])


def _best(rows: Sequence[Mapping[str, Any]], caches: set[str] | None = None) -> Mapping[str, Any] | None:
    peers = [r for r in rows if r["router"] == "vllm-router" and "error" not in r and r.get("ttft_p90_s")
             and (caches is None or r["cache"] in caches)]  # fmt: skip
    return min(peers, key=lambda r: float(r["ttft_p90_s"])) if peers else None


def _find(rows: Sequence[Mapping[str, Any]], cache: str) -> Mapping[str, Any] | None:
    return next((r for r in rows if r["router"] == "kvmesh" and r["policy"] == "kvmesh"
                 and r["cache"] == cache and "error" not in r and r.get("ttft_p90_s")), None)  # fmt: skip


def workload_targets(
    rows: Sequence[Mapping[str, Any]], runs: Mapping[str, Sequence[Mapping[str, Any]]]
) -> dict[str, Any]:
    """One workload's router targets. ``runs``: setup name -> its repeats' summaries, in
    repeat order (for the paired ratios)."""
    out: dict[str, Any] = {}
    for label, cache, peer_caches, target in (
        ("kvmesh_over_best_vllm_router", "kvmesh", None, TTFT_RATIO_TARGET),
        ("kvmesh_router_plain_over_best_vllm_router_plain", "none", {"none"}, PLAIN_RATIO_TARGET),
    ):
        ours, best = _find(rows, cache), _best(rows, peer_caches)
        if ours is None or best is None:
            out[label] = None
            continue
        name_ours = Setup("kvmesh", "kvmesh", cache).name
        name_best = Setup(str(best["router"]), str(best["policy"]), str(best["cache"])).name
        paired = paired_ratio(runs.get(name_ours, []), runs.get(name_best, []), "ttft_p90_s")
        ratio = round(float(ours["ttft_p90_s"]) / float(best["ttft_p90_s"]), 3)
        out[label] = {"best": name_best, "ratio_of_medians": ratio, "median_paired_ratio": paired,
                      "target": target,
                      "met": (paired if paired is not None else ratio) <= target}  # fmt: skip
    return out


def overhead_targets(measured: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """Added TTFT p50 per prompt size (the worst shape) against its target."""
    out: dict[str, Any] = {}
    for tokens, target in OVERHEAD_TARGETS_MS.items():
        m = measured.get(tokens)
        if not m:
            out[f"overhead_p50_{tokens}"] = None
            continue
        worst = max(float(s["added_ms_p50"]) for s in m["shapes"].values())
        out[f"overhead_p50_{tokens}"] = {"ms": worst, "target_ms": target, "met": worst <= target}
    return out


def index_target(lookup: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not lookup:
        return None
    p99 = max(float(lookup[k]["wall_p99_ms"]) for k in ("hit", "miss"))
    return {"wall_p99_ms": p99, "target_ms": INDEX_P99_TARGET_MS, "met": p99 <= INDEX_P99_TARGET_MS}


def native_rows(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows of each router over its own kind of replica (vllm-router over plain vLLM,
    kvmesh over kvmesh): one per (router, policy), the shape ``kvmesh sim validate`` reads
    from the JSON's top-level ``results``; every row is under ``workloads``."""
    native = {"vllm-router": "none", "kvmesh": "kvmesh"}
    return [r for r in rows if native.get(str(r["router"])) == r["cache"]]


# -- the benchmark -----------------------------------------------------------------------------
def _fmt(row: Mapping[str, Any]) -> dict[str, Any]:
    out = {"setup": f"{row['router']}:{row['policy']}", "replicas": row["replicas"]}
    if "error" in row:
        return {**out, "note": str(row["error"])[:100]}
    out.update({k: row.get(k) for k in METRICS})
    if row.get("errors"):
        out["note"] = f"{row['errors']} failed requests"
    return out


def _label(row: Mapping[str, Any]) -> str:
    kind = {"none": "plain", "lmcache": "LMCache", "kvmesh": "kvmesh", SLOW: "kvmesh, slow tier"}[
        str(row["cache"])
    ]
    return f"{row['router']}:{row['policy']} [{kind}]"


_KIND_COLOR = {"none": "tab:gray", "lmcache": "tab:orange", "kvmesh": "tab:blue", SLOW: "tab:purple"}


def plot_rows(path: str, rows: Sequence[Mapping[str, Any]], title: str) -> None:
    """One horizontal-bar panel per metric, a row per setup (named with its replica kind),
    coloured by replica kind: 15 setups would repeat a 10-colour cycle as vertical bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    labels = [_label(r) for r in ok]
    fig, axes = plt.subplots(1, len(METRIC_PANELS), figsize=(16, 0.38 * len(ok) + 1.6), sharey=True)
    for ax, (key, name) in zip(axes, METRIC_PANELS, strict=True):
        values = [float(r.get(key) or 0.0) for r in ok]
        ax.barh(range(len(ok)), values, color=[_KIND_COLOR[str(r["cache"])] for r in ok])
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.3g}", va="center", fontsize=8)
        ax.set_title(name)
        ax.set_xlim(0, max(values, default=1.0) * 1.25 or 1.0)
    axes[0].set_yticks(range(len(ok)), labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def run(
    quick: bool = False,
    json_path: str | None = None,
    plot_path: str | None = None,
    model_dir: str | None = None,
    setups: Sequence[str] | None = None,
    arrival: Arrival = "sessions",
    prefix_words: int = 0,
    repeats: int = 0,
    workloads: Sequence[str] | None = None,
    measure_overhead: bool = True,
    loads: Sequence[str] = LOADS,
) -> dict[str, Any]:
    """Run the router benchmark; returns (and optionally writes) ``{"results"`` (the default
    workload's :func:`native_rows`), ``"workloads"`` (every workload's rows and targets),
    ``"overhead"``, ``"index_lookup"``, ``"targets"}``. ``arrival`` / ``prefix_words``
    change the default workload (for exploring; the recorded run keeps them)."""

    def log(msg: str) -> None:
        print(msg, flush=True)

    chosen = rs.select_setups(setups)
    specs = list(rs.workloads(quick))
    if arrival != "sessions" or prefix_words:
        d = specs[0]
        specs[0] = rs.WorkloadSpec(d.name, d.kind, d.held_out, d.seed_base, d.tenants, d.users, d.turns,
                                   prefix_words or d.prefix_words, arrival=arrival)  # fmt: skip
    if workloads:
        bad = [w for w in workloads if w not in {s.name for s in specs}]
        if bad:
            raise ValueError(f"unknown workload(s) {bad}; valid: {', '.join(s.name for s in specs)}")
        specs = [s for s in specs if s.name in workloads]
    specs = with_loads(specs, loads)  # each at a light and a heavy offered load (costcases.py)
    n_repeats = repeats or params(quick).repeats
    prov = provenance("router")  # the code this run measures: read now, the tree may move on
    install_signal_handlers()
    model_dir = ensure_model(model_dir or DEFAULT_TINY_MODEL)
    workdir = tempfile.mkdtemp(prefix="kvmesh-bench-router-")
    t_start = time.monotonic()
    log(f"kvmesh bench router{' --quick' if quick else ''}: {len(chosen)} setups x {len(specs)} workloads "
        f"({', '.join(s.name for s in specs)}) x {n_repeats} repeat(s); 2 replicas x {NUM_BLOCKS} KV blocks; "
        f"logs in {workdir}")  # fmt: skip

    runs, failed, idle, capacity = rs.run_all(chosen, specs, n_repeats, NUM_BLOCKS, model_dir, workdir, log)
    per_workload: dict[str, Any] = {}
    for spec in specs:
        rows = rs.rows(runs[spec.name], failed)
        by_name = {s.name: r for s, r in runs[spec.name].items()}
        wt = {**workload_targets(rows, by_name), **cost_targets(rows, by_name)}
        per_workload[spec.name] = {"spec": spec.__dict__, "held_out": spec.held_out, "results": rows,
                                   "runs": by_name, "targets": wt}  # fmt: skip

    overhead: dict[int, Any] = {}
    lookup = None
    if measure_overhead:
        from kvmesh.bench.router.index_lookup import run as index_run
        from kvmesh.bench.router.overhead import measure

        for tokens in OVERHEAD_TARGETS_MS:
            log(f"[router overhead] {tokens}-token prompts, realistic text, streaming, live index")
            try:
                overhead[tokens] = measure(
                    model_dir, tokens=tokens, n=params(quick).overhead_n // (1 + tokens // 8000)
                )
                for shape, s in overhead[tokens]["shapes"].items():
                    log(f"  {shape}: added TTFT p50 {s['added_ms_p50']} ms, p99 {s['added_ms_p99']} ms")
            except Exception as exc:  # a figure of its own: the table above stands
                log(f"  failed: {type(exc).__name__}: {exc}")
        log("[index lookup] 1M blocks, wall clock, under concurrent event ingestion")
        try:
            lookup = index_run(blocks=1_000_000)
            for kind in ("hit", "miss"):
                log(
                    f"  {kind}: wall p50 {lookup[kind]['wall_p50_ms']} ms, "
                    f"p99 {lookup[kind]['wall_p99_ms']} ms"
                )
        except Exception as exc:
            log(f"  failed: {type(exc).__name__}: {exc}")

    targets: dict[str, Any] = {w: v["targets"] for w, v in per_workload.items()}
    targets.update(overhead_targets(overhead))
    targets["index_lookup_p99"] = index_target(lookup)
    main = "default@heavy" if "default@heavy" in per_workload else next(iter(per_workload), "")
    default_rows = native_rows(per_workload.get(main, {}).get("results", []))
    out: dict[str, Any] = {
        "results": default_rows,
        "workloads": per_workload,
        "overhead": {str(k): v for k, v in overhead.items()},
        "index_lookup": lookup,
        "targets": targets,
        "ttft_idle_miss_s": idle,
        "capacity": capacity,  # per phase: what the offered loads were set from
        "repeats": n_repeats,
        "replica_kv_blocks": NUM_BLOCKS,
        "replica_kinds": rs.REPLICA_KIND,
        "total_s": round(time.monotonic() - t_start),
    }
    for name, w in per_workload.items():
        log(f"\n{name} workload{' (held out)' if w['held_out'] else ''}")
        print_table([_fmt(r) for r in w["results"]], ["setup", "replicas", *METRICS, "note"])
    for key, value in targets.items():
        log(f"{key:<24} {value}")
    log(f"total {out['total_s']} s")
    if json_path:
        write_json(json_path, out, prov)
    if plot_path:
        for name, w in per_workload.items():
            path = plot_path if name == main else plot_path.replace(".png", f"-{name.replace('@', '-')}.png")
            plot_rows(path, w["results"], f"{name} workload: 2 vLLM replicas x {NUM_BLOCKS} KV blocks, "
                      f"medians of {n_repeats} repeats")  # fmt: skip
    return out
