"""The soak's report: outcomes, faults with their recovery, windows, memory, the verdict; JSON
and the timeline plot."""

from __future__ import annotations

import os
from typing import Any

from kvmesh.bench.runner import Provenance, write_json
from kvmesh.bench.soak.load import FaultEvent, Record, hit_rate, summarize, timeline
from kvmesh.bench.soak.verdict import Bounds, explain, memory, recovery_s, verdict, windows


def report(
    records: list[Record],
    events: list[FaultEvent],
    rss: tuple[dict[str, int], dict[str, int], list[dict[str, Any]]],
    duration: float,
    settings: dict[str, Any],
    pool: dict[str, Any],
    bounds: Bounds,
    json_path: str | None = None,
    plot_path: str | None = None,
    prov: Provenance | None = None,
) -> dict[str, Any]:
    """The run's report with its ``verdict``. ``rss``: (RSS per process once warm, peak RSS
    per process, bytes; the samples in MiB); ``settings["faults"]``: the faults asked for; ``pool``: its
    ``chunks`` and a replica's own caches (``vllm_cache_chunks``, ``cpu_tier_chunks``)."""
    records = explain(records, events, bounds.restart_grace_s)
    first_fault = min((e.start for e in events), default=duration)
    last_fault = max((e.end for e in events), default=duration)
    before = [r for r in records if r.end < first_fault]
    after = [r for r in records if r.start > last_fault]
    baseline = hit_rate(before) or 0.0
    out: dict[str, Any] = {
        "settings": settings,
        "bounds": bounds.record(),
        "pool": pool,
        **summarize(records),
        "hit_rate_before_faults": baseline,
        "hit_rate_after_faults": hit_rate(after),
        "memory": memory(rss[0], rss[1], bounds),
        "rss_mb": rss[2],
        "faults": [
            {
                **e.__dict__,
                "recovery_s": recovery_s(
                    records, e.end, baseline, bounds.clean_window_s, bounds.recovery_hit_fraction
                ),
            }
            for e in events
        ],
        "windows": windows(records, events, duration, bounds),
        "timeline": timeline(records, duration, bin_s=5.0),
    }
    out["peak_rss_mb"] = {k: m["peak_mb"] for k, m in out["memory"].items()}
    out["verdict"] = verdict(out)
    print(
        f"soak: {out['requests']} requests, {out['correct']} correct, {out['wrong']} wrong, "
        f"{out['hang']} hangs, {out['retryable']} 503/429, {out['router_down']} refused while the "
        f"router restarted, {out['broken_stream']} streams broken off with an error event, "
        f"{out['interrupted']} cut silently, {out['error']} errors; hit rate "
        f"{baseline:.3f} before faults, {out['hit_rate_after_faults'] or 0:.3f} after"
    )
    for f in out["faults"]:
        print(
            f"  {f['name']:<15} {f['start']:6.1f}-{f['end']:6.1f} s  recovery {f['recovery_s']}  {f['note']}"
        )
    for c in out["verdict"]["checks"]:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['name']:<19} {c['detail']}")
    if json_path and prov is not None:
        write_json(json_path, out, prov)
    if plot_path:
        plot(out, plot_path)
    return out


def plot(out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = out["timeline"]
    ts = [b["t"] for b in bins]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.plot(ts, [b["completed_per_s"] for b in bins], label="correct answers/s")
    failed = [b["failed"] / 5.0 for b in bins]
    top.bar(ts, failed, width=5.0, align="edge", color="tab:red", alpha=0.5, label="failures/s")
    least = out["windows"]["least"] / out["windows"]["window_s"]
    top.axhline(least, color="tab:orange", lw=0.8, ls="--", label="least correct/s (verdict)")
    top.set_ylabel("requests/s")
    top.legend(loc="upper right", fontsize=8)
    bottom.plot(
        ts, [b["hit_rate"] if b["hit_rate"] is not None else float("nan") for b in bins], color="tab:green"
    )
    bottom.set_ylabel("prefix hit rate")
    bottom.set_ylim(0, 1.05)
    bottom.set_xlabel("seconds")
    for ax in (top, bottom):
        for f in out["faults"]:
            ax.axvspan(f["start"], f["end"], color="grey", alpha=0.2)
    for f in out["faults"]:
        top.annotate(f["name"], (f["start"], top.get_ylim()[1]), fontsize=7, va="top", rotation=90)
    verdict = "passed" if out["verdict"]["ok"] else "FAILED"
    fig.suptitle(
        f"kvmesh soak ({verdict}): {out['requests']} requests, {out['wrong']} wrong, {out['hang']} hangs",
        fontsize=10,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
