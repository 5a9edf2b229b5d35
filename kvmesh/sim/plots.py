"""Plots of ``kvmesh sim run``: one panel per metric, one group per fleet size."""

from __future__ import annotations

import os
from typing import Any


def plot_policies(path: str, results: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("hit_ratio", "hit ratio"),
        ("ttft_p50_s", "TTFT p50 (s)"),
        ("ttft_p99_s", "TTFT p99 (s)"),
        ("throughput_rps", "requests/s"),
        ("imbalance_prefill", "prefill imbalance (max/mean)"),
    ]
    groups = sorted({(r["replicas"], r["fleet"]) for r in results})
    names = list(dict.fromkeys(r["policy"] for r in results))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 4.2))
    width = 0.8 / max(1, len(names))
    for ax, (key, label) in zip(axes, metrics, strict=True):
        for j, name in enumerate(names):
            ys = []
            for g in groups:
                row = next(
                    (r for r in results if (r["replicas"], r["fleet"]) == g and r["policy"] == name), None
                )
                ys.append(row[key] if row else 0.0)
            ax.bar([x - 0.4 + width * (j + 0.5) for x in range(len(groups))], ys, width, label=name)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{n} {f}" for n, f in groups], fontsize=8)
        ax.set_title(label, fontsize=10)
        if key.startswith("ttft"):
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
