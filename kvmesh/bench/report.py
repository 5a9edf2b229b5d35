"""Shared output for benchmarks: a plain-text table, JSON, grouped bars and one-panel-per-metric bars."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

# The replay metrics (kvmesh.bench.workload.METRICS) with their panel titles: a rate, seconds
# and requests/s each need an axis of their own.
METRIC_PANELS: tuple[tuple[str, str], ...] = (
    ("hit_rate", "prefix hit rate"),
    ("ttft_p50_s", "TTFT p50 (s)"),
    ("ttft_p90_s", "TTFT p90 (s)"),
    ("requests_per_s", "requests/s"),
)


def git_commit() -> str | None:
    """The short commit of the code a run measures (``+dirty`` when ``kvmesh/`` has changes
    not committed), or ``None`` outside a git checkout. Read it when the run starts: the tree
    may move on during a long one."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "kvmesh"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [
        max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)
    ]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    print(f"wrote {path}")


def write_plot(
    path: str,
    labels: Sequence[str],
    series: dict[str, Sequence[float]],
    ylabel: str,
    title: str,
    annotations: Sequence[str] | None = None,
) -> None:
    """Grouped bars: one group per label, one bar per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(labels) + 2), 4.5))
    n = len(series)
    width = 0.8 / max(n, 1)
    xs = list(range(len(labels)))
    for i, (name, values) in enumerate(series.items()):
        pos = [x - 0.4 + width * (i + 0.5) for x in xs]
        ax.bar(pos, values, width, label=name)
    if annotations:
        tops = [max(vals[j] for vals in series.values()) for j in range(len(labels))]
        for x, top, text in zip(xs, tops, annotations, strict=True):
            ax.annotate(text, (x, top), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def write_panels(
    path: str,
    rows: Mapping[str, Mapping[str, Any]],
    panels: Sequence[tuple[str, str]],
    title: str,
) -> None:
    """One panel per metric, each with its own y axis; in each, one bar per row (``rows``:
    label -> metric -> value; a missing or None value draws no bar), its value written on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(rows)
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 4.2), squeeze=False)
    colors = [f"C{i}" for i in range(len(labels))]
    for ax, (key, name) in zip(axes[0], panels, strict=True):
        xs = [i for i, label in enumerate(labels) if rows[label].get(key) is not None]
        ys = [float(rows[labels[i]][key]) for i in xs]
        bars = ax.bar(xs, ys, color=[colors[i] for i in xs])
        ax.bar_label(bars, labels=[f"{y:.3g}" for y in ys], fontsize=8, padding=2)
        ax.set_title(name, fontsize=10)
        ax.set_xticks([])
        ax.set_ylim(0, max(ys, default=1.0) * 1.18 or 1.0)
        ax.grid(axis="y", alpha=0.3)
    from matplotlib.patches import Patch

    handles = [Patch(color=c) for c in colors]
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    rows_of_legend = (len(labels) + 2) // 3
    fig.tight_layout(rect=(0, 0.06 * rows_of_legend, 1, 0.95))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
