"""``kvmesh demo``: what kvmesh adds to plain vLLM, in one run on one machine.

Three setups on the same multi-tenant chat workload (tenants with a long shared system
prompt, users in multi-turn conversations, four in flight), each over two vLLM replicas of
the tiny model with one core each and their own KV cache capped below the workload's. By
default that is the workload the kvmesh router's weights were tuned on (``kvmesh bench
router``'s default one), and the output says so; ``--workload held-out`` runs bench router's
held-out shape instead (other tenant counts, prompt lengths, word distribution, arrival),
one the weights never saw:

1. **plain vLLM + round-robin**: what users run today (the kvmesh router, round-robin
   policy, over replicas without a connector);
2. **kvmesh replicas + round-robin**: the same routing over replicas with kvmesh's
   connector and a shared tier (Redis, or a shared directory without redis-server), so a
   replica loads a prefix the other computed: *the cache's share* of the gain;
3. **kvmesh replicas + kvmesh router**: the kvmesh policy (prefix location, queued prefill
   work, load) over the same kvmesh replicas: *the router's share*.

The plain and the kvmesh replica groups are up together and the setups take turns, repeat
by repeat, every other repeat in reverse (:mod:`kvmesh.bench.common.groups`, the machinery of
``kvmesh bench router``); every run gets its own tenant texts and starts from reset prefix
caches. It prints a table of the medians, one sentence per row, and writes a PNG with one
panel per metric. Every process it started is stopped on exit or Ctrl-C.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvmesh.bench.common.groups import Params, Setup, run_interleaved
from kvmesh.bench.common.workload import METRICS
from kvmesh.bench.runner import METRIC_PANELS, Provenance, print_table, provenance, write_json, write_panels
from kvmesh.harness.model import DEFAULT_TINY_MODEL, ensure_model
from kvmesh.harness.processes import install_signal_handlers

DEFAULT_MODEL = DEFAULT_TINY_MODEL
PLAIN_RR = Setup("kvmesh", "round-robin", "none")
KVMESH_RR = Setup("kvmesh", "round-robin", "kvmesh")
KVMESH = Setup("kvmesh", "kvmesh", "kvmesh")
SETUPS = (PLAIN_RR, KVMESH_RR, KVMESH)
TITLES = {
    PLAIN_RR: "plain vLLM + round-robin",
    KVMESH_RR: "kvmesh replicas + round-robin",
    KVMESH: "kvmesh replicas + kvmesh router",
}
PHASES = (("none", "kvmesh"),)  # both groups up together, all three setups interleaved
LOWER_IS_BETTER = {"hit_rate": False, "ttft_p50_s": True, "ttft_p90_s": True, "requests_per_s": False}
# What each workload is to the router: the one its weights were tuned on, or one they never saw.
WORKLOADS = {
    "default": "the workload the kvmesh router's weights were tuned on (bench router's default)",
    "held-out": "bench router's held-out workload: the router's weights were never tuned on it",
}
HELD_OUT_SEED = 7000  # the held-out texts: no seed of the default workload's runs


def params(
    tenants: int = 12,
    users: int = 2,
    turns: int = 3,
    concurrency: int = 4,
    repeats: int = 3,
    num_blocks: int = 40,
    prefix_words: int = 250,
) -> Params:
    """The demo's workload. The defaults are ``kvmesh bench router``'s default workload (the
    one the router's weights were tuned on): 12 tenants x ~1,000 prefix tokens against 2
    replicas x 40 blocks x 128 tokens, so plain replicas must recompute what the other one
    holds."""
    return Params(tenants, users, turns, concurrency, repeats, arrival="sessions",
                  prefix_words=prefix_words, num_blocks=num_blocks)  # fmt: skip


def held_out_params(concurrency: int = 4, repeats: int = 3, num_blocks: int = 40) -> Params:
    """``kvmesh bench router``'s held-out workload (:func:`kvmesh.bench.router.setups.workloads`),
    which the router's weights were never tuned on."""
    from kvmesh.bench.router.setups import workloads

    w = next(spec for spec in workloads(quick=False) if spec.name == "held-out")
    return Params(w.tenants, w.users, w.turns, concurrency, repeats, arrival=w.arrival,
                  prefix_words=w.prefix_words, num_blocks=num_blocks, prefix_words_max=w.prefix_words_max,
                  question_words=w.question_words, zipf=w.zipf)  # fmt: skip


def seed_of(setup: Setup, repeat: int) -> int:
    """Tenant texts of one run: different for every setup and repeat."""
    return 1 + SETUPS.index(setup) + len(SETUPS) * repeat


def held_out_seed_of(setup: Setup, repeat: int) -> int:
    """:func:`seed_of` for the held-out workload: texts no default run uses."""
    return HELD_OUT_SEED + seed_of(setup, repeat)


# -- the summary (pure, unit-tested) ---------------------------------------------------------
def ratio(new: Any, old: Any) -> float | None:
    """``new / old``, or None when either is missing or ``old`` is 0."""
    if new is None or old is None or not float(old):
        return None
    return float(new) / float(old)


def split_gain(base: float, mid: float, full: float, lower_is_better: bool) -> dict[str, Any]:
    """How a metric's change from ``base`` (plain + round-robin) to ``full`` (kvmesh
    replicas + router) divides between the cache (base -> mid) and the router (mid -> full).

    ``gain``: whether ``full`` is better than ``base``; ``cache_pct`` / ``router_pct``: each
    step's share of the change, in percent (they add up to 100; a step that went the wrong
    way has a negative share). Both are None when nothing changed.
    """
    total = full - base
    better = total < 0 if lower_is_better else total > 0
    if total == 0:
        return {"gain": False, "cache_pct": None, "router_pct": None}
    cache = 100.0 * (mid - base) / total
    return {"gain": better, "cache_pct": round(cache, 1), "router_pct": round(100.0 - cache, 1)}


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"x{value:.2f}"


def paired_ratio(new: Mapping[str, Any], old: Mapping[str, Any], key: str) -> float | None:
    """``new``'s ``key`` over ``old``'s: the median of the per-repeat ratios when both rows
    carry their ``repeats`` (repeat *i* of every setup ran back to back, so the pair shares
    the machine's state at that moment), else the ratio of the medians."""
    pairs = zip(new.get("repeats") or (), old.get("repeats") or (), strict=False)
    ratios = [r for r in (ratio(a.get(key), b.get(key)) for a, b in pairs) if r is not None]
    return statistics.median(ratios) if ratios else ratio(new.get(key), old.get(key))


def _step(new: Mapping[str, Any], old: Mapping[str, Any]) -> str:
    """What changed from row ``old`` to row ``new``, in a clause. The x figures are medians of
    paired ratios (same repeat, back to back) and the seconds are each row's medians over the
    repeats, so on a noisy run a ratio below 1 can sit beside medians that rose: the
    clause says which is which."""
    return (
        f"hit rate {old['hit_rate']:.2f} -> {new['hit_rate']:.2f}, "
        f"TTFT p50 {_x(paired_ratio(new, old, 'ttft_p50_s'))} and "
        f"p90 {_x(paired_ratio(new, old, 'ttft_p90_s'))} "
        f"(paired; medians {old['ttft_p90_s']:.3f} -> {new['ttft_p90_s']:.3f} s), "
        f"requests/s {_x(paired_ratio(new, old, 'requests_per_s'))}"
    )


def _share(split: Mapping[str, Any], what: str) -> str:
    cache, router = split["cache_pct"], split["router_pct"]
    if cache is None:
        return f"{what} did not change"
    if not split["gain"]:
        return f"{what} (medians) got worse overall (cache {cache:.0f}%, router {router:.0f}% of it)"
    return f"of the gain in {what} (medians) the cache gives {cache:.0f}% and the router {router:.0f}%"


def sentences(rows: Mapping[Setup, Mapping[str, Any]]) -> list[str]:
    """One sentence per setup row: the baseline, the cache's step, the router's step and the
    split of the whole gain (a row that failed says so)."""
    base, mid, full = (rows.get(s) for s in SETUPS)
    out = []
    for setup, row in zip(SETUPS, (base, mid, full), strict=True):
        if row is None or "error" in row or row.get("ttft_p90_s") is None:
            why = (row or {}).get("error", "no run")
            out.append(f"{TITLES[setup]}: no figures ({why}).")
    if out:
        return out
    assert base is not None and mid is not None and full is not None
    p90 = split_gain(base["ttft_p90_s"], mid["ttft_p90_s"], full["ttft_p90_s"], lower_is_better=True)
    rps = split_gain(base["requests_per_s"], mid["requests_per_s"], full["requests_per_s"], False)
    return [
        f"{TITLES[PLAIN_RR]} (what users run today): hit rate {base['hit_rate']:.2f}, TTFT p50 "
        f"{base['ttft_p50_s']:.3f} s, p90 {base['ttft_p90_s']:.3f} s, {base['requests_per_s']:.2f} "
        "requests/s: every replica recomputes whatever prefix its own cache lost or never had.",
        f"{TITLES[KVMESH_RR]}, the cache's share: {_step(mid, base)}: a replica loads from the "
        "shared tier the prefixes the other one computed, instead of recomputing them.",
        f"{TITLES[KVMESH]}, the router's share: {_step(full, mid)} on top; against plain vLLM "
        f"{_step(full, base)}; {_share(p90, 'TTFT p90')}, {_share(rps, 'requests/s')}.",
    ]


def table(rows: Mapping[Setup, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The printed table: one row per setup, with its TTFT p90 against the baseline's."""
    base = rows.get(PLAIN_RR, {})
    out = []
    for setup in SETUPS:
        row = rows.get(setup, {})
        line: dict[str, Any] = {"setup": TITLES[setup]}
        if "error" in row or not row:
            line["note"] = str(row.get("error", "no run"))[:80]
        else:
            line.update({k: row.get(k) for k in METRICS})
            line["p90_vs_plain"] = _x(paired_ratio(row, base, "ttft_p90_s")) if base else "n/a"
            line["errors"] = row.get("errors", 0)
        out.append(line)
    return out


# -- the run ---------------------------------------------------------------------------------
def run(
    model_dir: str = DEFAULT_MODEL,
    json_path: str | None = None,
    plot_path: str | None = None,
    p: Params | None = None,
    workdir: str | None = None,
    workload_name: str = "default",
) -> dict[str, Any]:
    """Run the demo; returns (and optionally writes) :func:`report`'s ``{"rows", "sentences",
    "split", "workload", "wall_s"}``. ``workload_name``: a key of :data:`WORKLOADS` (``p``
    is its shape: :func:`params` or :func:`held_out_params`)."""

    def log(msg: str) -> None:
        print(msg, flush=True)

    p = p or params()
    prov = provenance("demo")  # the code this run measures: read now, the tree may move on
    install_signal_handlers()
    model_dir = ensure_model(model_dir, "tiny")
    workdir = workdir or tempfile.mkdtemp(prefix="kvmesh-demo-")
    t0 = time.monotonic()
    log(
        f"kvmesh demo on {WORKLOADS[workload_name]}: {' | '.join(TITLES[s] for s in SETUPS)}; "
        f"{p.tenants} tenants x {p.users} users x "
        f"{p.turns} turns, {p.concurrency} in flight, {p.repeats} repeats interleaved; 2 + 2 replicas x "
        f"{p.num_blocks} KV blocks; logs in {workdir}"
    )
    seeds = held_out_seed_of if workload_name == "held-out" else seed_of
    outcome = run_interleaved(SETUPS, PHASES, p, model_dir, workdir, seeds, log, idle_floor=False)
    rows = {s: {**row, "repeats": outcome.runs[s]} for s, row in zip(SETUPS, outcome.rows(), strict=True)}
    workload = {
        "name": workload_name,
        "tuned_on": workload_name == "default",
        "what": WORKLOADS[workload_name],
        "tenants": p.tenants,
        "users": p.users,
        "turns": p.turns,
        "concurrency": p.concurrency,
        "prefix_words": p.prefix_words,
        "replica_kv_blocks": p.num_blocks,
        "repeats": p.repeats,
        "arrival": p.arrival,
        "prefix_words_max": p.prefix_words_max,
        "question_words": p.question_words,
        "zipf": p.zipf,
    }
    return report(rows, workload, round(time.monotonic() - t0, 1), json_path, plot_path, prov)


def report(
    rows: Mapping[Setup, Mapping[str, Any]],
    workload: Mapping[str, Any],
    wall_s: float,
    json_path: str | None = None,
    plot_path: str | None = None,
    prov: Provenance | None = None,
) -> dict[str, Any]:
    """Print the table and the sentences, write the JSON and the PNG; returns the JSON's
    content. ``rows``: per setup, the medians and its ``repeats``; ``prov``: the run's
    provenance (the code measured; read now when None)."""
    lines = sentences(rows)
    split = {}
    if all(s in rows and "error" not in rows[s] for s in SETUPS):
        split = {
            k: split_gain(rows[PLAIN_RR][k], rows[KVMESH_RR][k], rows[KVMESH][k], LOWER_IS_BETTER[k])
            for k in METRICS
            if all(rows[s].get(k) is not None for s in SETUPS)
        }
    out: dict[str, Any] = {
        "rows": [{"setup": TITLES[s], **rows.get(s, {"error": "no run"})} for s in SETUPS],
        "sentences": lines,
        "split": split,
        "ratios": "x figures: medians over repeats of paired ratios (same repeat, back to back); "
        "split: from the medians of each setup",
        "workload": dict(workload),
        "wall_s": wall_s,
    }
    print()
    print_table(table(rows), ["setup", *METRICS, "p90_vs_plain", "errors", "note"])
    print()
    if "what" in workload:
        print(f"Workload: {workload['what']}.")
    for line in lines:
        print("- " + line)
    print(f"\ntotal {wall_s:.0f} s", flush=True)
    if json_path:
        write_json(json_path, out, prov or provenance("demo"))
    if plot_path:
        w = workload
        write_panels(
            plot_path,
            {TITLES[s]: rows[s] for s in SETUPS if s in rows and "error" not in rows[s]},
            METRIC_PANELS,
            title=f"kvmesh demo: 2 vLLM replicas per setup x {w['replica_kv_blocks']} KV blocks, "
            f"{w['tenants']} tenants x {w['users']} users x {w['turns']} turns, {w['concurrency']} in "
            f"flight; medians of {w['repeats']}",
        )
    return out


def rows_from_json(data: Mapping[str, Any]) -> dict[Setup, dict[str, Any]]:
    """The ``rows`` argument of :func:`report` back from a demo JSON (to re-render it)."""
    by_title = {t: s for s, t in TITLES.items()}
    return {by_title[r["setup"]]: {k: v for k, v in r.items() if k != "setup"} for r in data["rows"]}


def failed(out: Mapping[str, Any]) -> Sequence[str]:
    """The setups of a finished run that have no figures or lost requests (empty: all good)."""
    return [r["setup"] for r in out["rows"] if "error" in r or r.get("errors")]


__all__ = ["SETUPS", "TITLES", "failed", "paired_ratio", "params", "ratio", "report", "rows_from_json", "run",
           "sentences", "split_gain", "table"]  # fmt: skip
