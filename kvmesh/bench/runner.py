"""The shared runner of the benchmark suites: what makes their figures comparable and
traceable, in one place.

* **Provenance** (:func:`provenance` at the start of a run, written into every JSON by
  :func:`write_json`): the commit measured and whether ``kvmesh/`` had uncommitted changes
  (read from git by the code, never typed by hand), the date, the host, the load average
  before and after.
* **Interleaving** (:func:`interleaved`): the setups a run compares take turns, every other
  repeat in reverse, so no setup always runs first or last while the machine drifts.
* **Pairing** (:func:`paired_ratios`, :func:`ratio_summary`): a ratio is repeat ``k`` of one
  side over repeat ``k`` of the other (same round, seconds apart), and the figures quoted
  are the median and p90 of those ratios, never a ratio of two medians.
* **Statistics** (:func:`percentile`: the one percentile) and **output** (a text table, JSON,
  grouped bars, one panel per metric).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

# ``--smoke``, the flag of suites whose ``--quick`` takes too long for the test suite.
SMOKE_HELP = "the smallest run through every code path, for the test suite (its numbers mean nothing)"

# The replay metrics (kvmesh.bench.common.workload.METRICS) with their panel titles: a rate,
# seconds and requests/s each need an axis of their own.
METRIC_PANELS: tuple[tuple[str, str], ...] = (
    ("hit_rate", "prefix hit rate"),
    ("ttft_p50_s", "TTFT p50 (s)"),
    ("ttft_p90_s", "TTFT p90 (s)"),
    ("requests_per_s", "requests/s"),
)


# -- statistics --------------------------------------------------------------------------------
def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile, ``q`` in 0..100, interpolated linearly between the two
    closest ranks of the sorted values (NumPy's default ``method="linear"``; ``q=50`` is the
    median). ``values`` need not be sorted. Raises ValueError for no values, a ``q``
    outside 0..100 or a NaN among the values (a NaN has no rank)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if any(math.isnan(x) for x in xs):
        raise ValueError("percentile of values that include NaN")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# -- interleaving and pairing ------------------------------------------------------------------
def interleaved(items: Sequence[T], step: int) -> list[T]:
    """``items`` in the order step ``step`` runs them: as given on even steps, reversed on
    odd ones, so over the steps each runs as often early as late and no ratio between two
    of them rides on the machine's drift."""
    return list(items) if step % 2 == 0 else list(reversed(items))


def paired_ratios(num: Sequence[float | None], den: Sequence[float | None]) -> list[float]:
    """``num[k] / den[k]`` for every ``k`` both sides have (``num[k]`` not None, ``den[k]``
    neither None nor 0), up to the shorter side: repeat ``k`` of both ran in the same round,
    so the machine's drift cancels in each ratio."""
    return [float(a) / float(b) for a, b in zip(num, den, strict=False) if a is not None and b]


def ratio_summary(ratios: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """``pairs``, the ``ratios`` themselves, and their ``median`` and ``p90`` (None for none)."""
    return {
        "pairs": len(ratios),
        "ratios": [round(r, 4) for r in ratios],
        "median": round(statistics.median(ratios), digits) if ratios else None,
        "p90": round(percentile(ratios, 90), digits) if ratios else None,
    }


def median_ratio(num: Sequence[float | None], den: Sequence[float | None], digits: int = 3) -> float | None:
    """The median of :func:`paired_ratios` (None when no pair has both sides)."""
    ratios = paired_ratios(num, den)
    return round(statistics.median(ratios), digits) if ratios else None


# -- provenance --------------------------------------------------------------------------------
def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state() -> tuple[str | None, bool | None]:
    """The short commit of the code a run measures and whether ``kvmesh/`` has changes not
    committed; ``(None, None)`` outside a git checkout (an installed wheel). A tree shipped
    to another machine (a GPU machine gets the files, and a ``.git`` that need not match
    them) names its commit in ``KVMESH_COMMIT``, which then wins: ``(that, None)``, the
    dirty flag unknown there."""
    shipped = os.environ.get("KVMESH_COMMIT")
    if shipped:
        return shipped, None
    head = (_git("rev-parse", "--short", "HEAD") or "").strip()
    if not head:
        return None, None
    status = _git("status", "--porcelain", "kvmesh")
    return head, None if status is None else bool(status.strip())


def git_commit() -> str | None:
    """:func:`git_state` as one label: ``abc1234``, ``abc1234+dirty``, or None outside a
    checkout. Read it when the run starts: the tree may move on during a long one."""
    head, dirty = git_state()
    return None if head is None else head + ("+dirty" if dirty else "")


def loadavg() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def host_facts() -> dict[str, Any]:
    """What a figure depends on besides the code: CPU model and count (all, and those this
    process may run on), memory, OS and Python."""
    cpu, mem_gib = "", None
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal:"))
        mem_gib = round(int(line.split()[1]) / 2**20, 1)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu or platform.processor(),
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "mem_total_gib": mem_gib,
        "os": platform.platform(),
        "python": sys.version.split()[0],
    }


@dataclass(frozen=True)
class Provenance:
    """What a run measured and where, read when it starts (:func:`provenance`)."""

    suite: str
    commit: str | None
    dirty: bool | None
    date: str  # UTC, ISO 8601
    host: dict[str, Any]
    loadavg_before: list[float] | None
    argv: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @property
    def label(self) -> str | None:
        """The commit as one string, ``abc1234`` or ``abc1234+dirty`` (titles, logs)."""
        return None if self.commit is None else self.commit + ("+dirty" if self.dirty else "")

    def record(self) -> dict[str, Any]:
        """The JSON object of the run's provenance, with the load average now (its end)."""
        return {
            "suite": self.suite,
            "commit": self.commit,
            "dirty": self.dirty,
            "date": self.date,
            "host": self.host,
            "loadavg_before": self.loadavg_before,
            "loadavg_after": loadavg(),
            "duration_s": round(time.monotonic() - self.started, 1),
            "argv": self.argv,
        }


def provenance(suite: str) -> Provenance:
    """Start a run of ``suite``: its commit, dirty flag, date, host and load average now."""
    commit, dirty = git_state()
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return Provenance(suite, commit, dirty, date, host_facts(), loadavg(), list(sys.argv))


# -- output ------------------------------------------------------------------------------------
def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [
        max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)
    ]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def write_json(path: str, data: Mapping[str, Any], prov: Provenance) -> None:
    """``data`` as JSON with the run's ``provenance`` (:meth:`Provenance.record`) beside it:
    no result is written without the commit and dirty flag of the code that produced it.
    Data that already has one (a summary recomputed from an earlier run's JSON) keeps it, the
    measurement's, and this run's goes under ``recomputed``."""
    record = dict(data)
    record["recomputed" if "provenance" in data else "provenance"] = prov.record()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
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
