"""``kvmesh bench stall``: what one request's load costs the rest of the batch, real vLLM.

Four decodes step while a fifth request arrives whose prompt (``--tokens``, 2,000 by
default) is cached only in one place:

* ``disk``: kvmesh's disk tier, page cache dropped (cold disk);
* ``redis_far``: a real redis-server behind :class:`~kvmesh.harness.slowproxy.SlowProxy`
  with a 200 ms round trip (a Redis 200 ms away; no bandwidth cap);
* ``redis_hung``: the same proxy SIGSTOPped once the chunks are in (connections open, nothing
  ever answers: a hung Redis);
* ``vllm`` (the floor, run by default): the prompt still in vLLM's own prefix cache, so
  nothing is loaded at all: what a new request with a cached prompt costs the batch with any
  cache, the physical limit the other sources are read against.

Measured per source: the decodes' inter-token latency p99 after the fifth request arrived,
over the same p99 in a run with no fifth request (trial by trial: target <= 1.2x), and the
fifth request's TTFT. Two modes run side by side, each in a vLLM worker of its own, trials
interleaved (every other trial in reverse order): ``async`` (kvmesh's defaults: lower-tier
loads through vLLM's asynchronous path) and ``sync`` (``async_loads: off``: every lookup
and load inside the step, the behaviour before issue #25). The async mode's TTFT of the
loading request over the sync mode's, paired: target <= 1.1x (a hung Redis excepted: there
the request pays its budget either way).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

from kvmesh.bench.runner import REPO_ROOT, interleaved, paired_ratios, print_table, provenance, ratio_summary
from kvmesh.bench.runner import write_json as _write_json
from kvmesh.bench.ttft.bench import QUIET_S
from kvmesh.bench.ttft.proc import Worker
from kvmesh.errors import ProcessError
from kvmesh.harness.model import DEFAULT_BENCH_MODEL, ensure_model
from kvmesh.harness.services import RedisServer
from kvmesh.harness.slowproxy import SlowProxy

MODES = ("async", "sync")
# all: cpu hits through the async path too (async_loads: all); tail: the defaults plus
# save_unfull_chunk (the prompt's partial last chunk cached: 1,999 of 2,000 tokens loaded);
# proc: the defaults plus disk_read_process (the disk tier's reads in a child process)
ALL_MODES = ("async", "sync", "all", "tail", "proc")
SOURCES = ("disk", "redis_far", "redis_hung")
# cpu: the prompt left in the cpu tier (sync vs async cpu hits); vllm: the prompt left in vLLM's
# own prefix cache, nothing to load: the floor for any cache (a new request joins the batch)
FLOOR = "vllm"
ALL_SOURCES = (*SOURCES, "cpu", FLOOR)
RTT_S = 0.2
ITL_TARGET = 1.2
TTFT_TARGET = 1.1


def _spec(mode: str, model_dir: str, work: str, remote_url: str, tokens: int, decode: int) -> dict[str, Any]:
    kvmesh: dict[str, Any] = {
        "local_disk": os.path.join(work, f"disk-{mode}"),
        "remote_url": remote_url,
        "remote_timeout_s": 2.0,
        "socket_dir": os.path.join(work, "sock"),
        "admin_enabled": False,
    }
    for part in mode.split("+"):  # "tail+proc": both
        if part == "sync":
            kvmesh["async_loads"] = "off"
        elif part == "all":
            kvmesh["async_loads"] = "all"
        elif part == "tail":
            kvmesh["save_unfull_chunk"] = True
        elif part == "proc":
            kvmesh["disk_read_process"] = True
    return {
        "mode": mode,
        "model_dir": model_dir,
        "kvmesh": kvmesh,
        "load_tokens": tokens,
        "decode_tokens": decode,
    }


def _signal(proxy: SlowProxy, sig: signal.Signals) -> None:
    if proxy.proc is not None and proxy.proc.poll() is None:
        os.kill(proxy.proc.pid, sig)


def _trial(w: Worker, proxy: SlowProxy, source: str, k: int) -> dict[str, Any]:
    prep = w.call(300, op="prepare", source=source, trial=k)
    if source == "redis_hung":
        _signal(proxy, signal.SIGSTOP)
    # Each timed run starts once every vLLM worker has stopped spinning: a worker busy-polls
    # its queue (sched_yield) for ~1 s after each step, and all of them are bound to the
    # compute core. Without the pause the run that followed another mode's trial (the loaded
    # one) shared that core with its worker, the run after it (alone) did not: the ratio
    # carried the other process's spin (an "alone" p99 of 114 ms beside 7-20 ms in one run).
    time.sleep(QUIET_S)
    try:
        loaded = w.call(600, op="run", with_load=True, trial=k)
    finally:
        _signal(proxy, signal.SIGCONT)
    time.sleep(QUIET_S)
    alone = w.call(600, op="run", with_load=False, trial=k)
    if source == "redis_hung":
        time.sleep(2.0)  # the breaker's probe finds Redis again before the next trial
    return {"prepare": prep, "loaded": loaded, "alone": alone}


def run(
    quick: bool = False,
    json_path: str | None = None,
    plot_path: str | None = None,
    model_dir: str | None = None,
    trials: int | None = None,
    tokens: int = 2000,
    sources: list[str] | None = None,
    decode_tokens: int | None = None,
    modes: list[str] | None = None,
) -> dict[str, Any]:
    n_trials = trials if trials is not None else (3 if quick else 8)
    chosen = list(sources or (*SOURCES, FLOOR))
    unknown = set(chosen) - set(ALL_SOURCES)
    if unknown:
        raise ValueError(f"unknown source(s) {sorted(unknown)}; valid: {', '.join(ALL_SOURCES)}")
    run_modes = list(modes or MODES)
    parts = {part for m in run_modes for part in m.split("+")}
    if parts - set(ALL_MODES) or "async" not in run_modes:
        raise ValueError(
            f"modes must include async and be among {', '.join(ALL_MODES)} (or several joined by +: "
            f"tail+proc), got {run_modes}"
        )
    prov = provenance("stall")
    model = ensure_model(model_dir or os.path.join(REPO_ROOT, DEFAULT_BENCH_MODEL), "bench")
    decode = decode_tokens or (60 if quick else 160)
    work = tempfile.mkdtemp(prefix="kvmesh-stall-", dir=os.path.join(REPO_ROOT, ".cache"))
    redis = RedisServer().start()
    proxy = SlowProxy(redis.port, latency_s=RTT_S / 2, bandwidth_bps=0.0).start()
    workers: dict[str, Worker] = {}
    records: list[dict[str, Any]] = []
    done = False
    try:
        for mode in run_modes:
            spec_path = os.path.join(work, f"{mode}.json")
            with open(spec_path, "w") as f:
                url = f"redis://127.0.0.1:{proxy.port}"
                json.dump(_spec(mode, model, work, url, tokens, decode), f)
            workers[mode] = Worker(
                mode, spec_path, os.path.join(work, f"{mode}.log"), None, "kvmesh.bench.stall.worker"
            )
        for w in workers.values():
            if not w.answer(600).get("ready"):
                raise ProcessError(f"the {w.setup} worker did not start (log: {w.log_path})")
        step = 0
        for k in range(n_trials):
            for source in chosen:
                for mode in interleaved(run_modes, step):
                    got = _trial(workers[mode], proxy, source, k)
                    records.append({"mode": mode, "source": source, "trial": k, **got})
                    print(f"[stall] trial {k} {source:<10} {mode:<5} {_line(got)}", flush=True)
                step += 1
        done = True
    finally:
        for w in workers.values():
            w.stop()
        _signal(proxy, signal.SIGCONT)
        proxy.stop()
        redis.stop()
        if done:  # as the ttft bench: a run that finished leaves nothing behind
            shutil.rmtree(work, ignore_errors=True)
        else:  # the disk tiers' chunks (~40 MB a run) go; the workers' logs stay for a look
            for mode in run_modes:
                shutil.rmtree(os.path.join(work, f"disk-{mode}"), ignore_errors=True)
            print(f"[stall] the workers' logs are kept in {work}", file=sys.stderr, flush=True)
    results = summarize(records, chosen, run_modes)
    out: dict[str, Any] = {"results": results, "trials": records, "tokens": tokens, "rtt_s": RTT_S}
    cols = ["source", "mode", "itl_ratio_median", "itl_met", "itl_vs_floor"]
    cols += ["itl_max_ms", "load_ttft_ms", "ttft_vs_sync"]
    print_table(results, cols)
    if json_path:
        _write_json(json_path, out, prov)
    if plot_path:
        plot(results, plot_path, f"kvmesh bench stall, commit {prov.label}")
    return out


def plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    """Two panels, a group of bars per source and a bar per mode, both on log scales (the
    sync rows are 100x the async ones): the decodes' ITL p99 over their own, with the 1.2
    target, and the loading request's TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = list(dict.fromkeys(r["source"] for r in results))
    modes = list(dict.fromkeys(r["mode"] for r in results))
    by = {(r["source"], r["mode"]): r for r in results}
    width = 0.8 / max(1, len(modes))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    panels = (("itl_ratio_median", "decodes' ITL p99 / alone"), ("load_ttft_ms", "loading TTFT (ms)"))
    for ax, (key, name) in zip(axes, panels, strict=True):
        for j, mode in enumerate(modes):
            pts = [
                (i + (j - (len(modes) - 1) / 2) * width, float(v))
                for i, s in enumerate(sources)
                if (v := by.get((s, mode), {}).get(key)) is not None
            ]
            bars = ax.bar([x for x, _ in pts], [y for _, y in pts], width, label=mode, color=f"C{j}")
            labels = [f"{y:,.0f}" if y >= 100 else f"{y:.3g}" for _, y in pts]
            ax.bar_label(bars, labels=labels, fontsize=6, padding=1)
        if key == "itl_ratio_median":
            ax.axhline(ITL_TARGET, color="k", linestyle="--", linewidth=0.8, label=f"target {ITL_TARGET}")
        ax.set_yscale("log")
        ax.set_xticks(range(len(sources)), [f"{s} (floor)" if s == FLOOR else s for s in sources], fontsize=8)
        ax.set_title(name + " (log scale)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def _line(got: dict[str, Any]) -> str:
    lo, al = got["loaded"], got["alone"]
    if "error" in lo or "error" in al:
        return f"error: {lo.get('error') or al.get('error')}"
    return (
        f"itl p99 {1000 * (lo['itl_p99_s'] or 0):.1f} ms (alone {1000 * (al['itl_p99_s'] or 0):.1f}), "
        f"load ttft {1000 * (lo['load_ttft_s'] or 0):.0f} ms, cached {lo['load_cached_tokens']}, "
        f"read {', '.join(f'{t} {1000 * v:.0f} ms' for t, v in lo.get('load_read_s', {}).items()) or '-'}"
    )


def summarize(
    records: list[dict[str, Any]], sources: list[str], modes: list[str] | None = None
) -> list[dict[str, Any]]:
    """Per source and mode: the paired ITL-p99 ratio (with the load / alone, same trial) and
    the loading request's TTFT; for async, its TTFT over sync's (and over ``all``'s: a cpu
    hit loaded within its step vs through the async path), paired by trial."""
    modes = list(modes or MODES)
    ok = [r for r in records if "error" not in r["loaded"] and "error" not in r["alone"]]
    rows = []
    for source in sources:
        here = [r for r in ok if r["source"] == source]
        ttft = {m: {r["trial"]: r["loaded"]["load_ttft_s"] for r in here if r["mode"] == m} for m in modes}
        for mode in modes:
            mine = [r for r in ok if r["source"] == source and r["mode"] == mode]
            itl = ratio_summary(
                paired_ratios(
                    [r["loaded"]["itl_p99_s"] for r in mine], [r["alone"]["itl_p99_s"] for r in mine]
                )
            )
            row: dict[str, Any] = {
                "source": source,
                "mode": mode,
                "itl_ratio_median": itl["median"],
                "itl_ratio_p90": itl["p90"],
                "itl_met": None if itl["median"] is None else itl["median"] <= ITL_TARGET,
                # each step is one gap of every decode, so with ~220 gaps (--quick) the p99 is
                # about the third-worst step: the worst gap beside it
                "itl_max_ms": _ms_median([r["loaded"]["itl_max_s"] for r in mine]),
                "itl_max_alone_ms": _ms_median([r["alone"].get("itl_max_s") for r in mine]),
                "load_ttft_ms": _ms_median([r["loaded"]["load_ttft_s"] for r in mine]),
                "cached_tokens": [r["loaded"]["load_cached_tokens"] for r in mine],
            }
            floor = {
                r["trial"]: r["loaded"]["itl_p99_s"] for r in ok if (r["source"], r["mode"]) == (FLOOR, mode)
            }
            if source != FLOOR and floor:
                # the same mode's ITL with nothing to load (the prompt in vLLM's own cache), paired
                paired = [(r["loaded"]["itl_p99_s"], floor[r["trial"]]) for r in mine if r["trial"] in floor]
                row["itl_vs_floor"] = ratio_summary(
                    paired_ratios([a for a, _ in paired], [b for _, b in paired])
                )["median"]
            base = mode.removesuffix("+proc") if mode.endswith("+proc") else "async"
            if mode.endswith("proc") and base in ttft:  # the child's reads against the worker's own
                ks = sorted(set(ttft[mode]) & set(ttft[base]))
                row["ttft_vs_without_proc"] = ratio_summary(
                    paired_ratios([ttft[mode][k] for k in ks], [ttft[base][k] for k in ks])
                )["median"]
            if mode == "async" and "all" in ttft:
                ks = sorted(set(ttft["async"]) & set(ttft["all"]))
                row["ttft_vs_all"] = ratio_summary(
                    paired_ratios([ttft["async"][k] for k in ks], [ttft["all"][k] for k in ks])
                )["median"]
            if mode in ("async", "proc") and "sync" in ttft and mode in ttft:
                ks = sorted(set(ttft[mode]) & set(ttft["sync"]))
                vs = ratio_summary(paired_ratios([ttft[mode][k] for k in ks], [ttft["sync"][k] for k in ks]))
                row["ttft_vs_sync"] = vs["median"]
                row["ttft_met"] = (
                    None if vs["median"] is None or source == "redis_hung" else vs["median"] <= TTFT_TARGET
                )
            rows.append(row)
    return rows


def _ms_median(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return round(1000 * statistics.median(xs), 1) if xs else None
