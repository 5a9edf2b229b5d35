"""Shared output for benchmarks: a plain-text table, JSON and a grouped bar plot."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any


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
