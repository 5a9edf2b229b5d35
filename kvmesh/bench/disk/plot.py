"""Plots of ``kvmesh bench disk``: DLWA vs utilisation per placement, the write-latency CDF
on this machine's disk, and the timeline of an eviction burst."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

COLORS = {"none": "tab:red", "hints": "tab:orange", "segments": "tab:green", "none (no trim)": "tab:gray"}


def plot(path: str, rows: list[dict[str, Any]], real: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.6))
    base = [
        r for r in rows if r["trace"] == "conversation" and r["write_mode"] == "back" and r["chunk"] == 256
    ]
    for p in ("none", "hints", "segments"):
        rs = sorted((r for r in base if r["placement"] == p), key=lambda r: r["util"])
        a.plot([100 * r["util"] for r in rs], [r["dlwa_steady"] for r in rs], "o-", color=COLORS[p], label=p)
        if rs and "dlwa_no_trim" in rs[0]:
            a.plot(
                [100 * r["util"] for r in rs],
                [r["dlwa_no_trim"] for r in rs],
                "s--",
                color=COLORS["none (no trim)"] if p == "none" else COLORS[p],
                alpha=1.0 if p == "none" else 0.5,
                label=f"{p}, no discard",
            )
    a.axhline(1.1, color="k", lw=0.8, ls=":", label="target 1.1 (segments)")
    a.set_xlabel("device utilisation (%)")
    a.set_ylabel("simulated DLWA (second half of the run)")
    a.set_title("DLWA vs utilisation (conversation trace, write-back)", fontsize=10)
    a.legend(fontsize=8)
    firsts: dict[str, dict[str, Any]] = {}
    for r in real:
        firsts.setdefault(r["placement"], r)
    for p, r in firsts.items():
        lat = np.sort(np.asarray(r["_lat"])) * 1e3
        b.plot(lat, np.arange(1, len(lat) + 1) / len(lat), color=COLORS[p], label=p)
    b.set_xscale("log")
    b.set_xlabel("per-chunk write latency (ms, this machine's disk)")
    b.set_ylabel("CDF")
    b.set_title("write-latency CDF (write-back, 90%)", fontsize=10)
    b.legend(fontsize=8)
    for p, r in firsts.items():
        puts = r["_puts"]
        if not puts:
            continue
        t0 = puts[0][0]
        ts = np.array([t - t0 for t, _, _ in puts])
        n = np.array([k for _, _, k in puts])
        # The busiest second of the run: the burst.
        bins = np.arange(0, ts.max() + 0.05, 0.05)
        hist, _ = np.histogram(ts, bins=bins, weights=n)
        if not len(hist):
            continue
        peak = bins[int(np.argmax(np.convolve(hist, np.ones(20), mode="same")))]
        lo = max(peak - 0.5, 0.0)
        sel = (bins[:-1] >= lo) & (bins[:-1] < lo + 1.0)
        c.step(bins[:-1][sel] - lo, hist[sel] / 0.05, where="post", color=COLORS[p], label=p)
    c.set_xlabel("time in the burst (s)")
    c.set_ylabel("chunks written per second")
    c.set_title("eviction burst: write rate over the busiest second", fontsize=10)
    c.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
