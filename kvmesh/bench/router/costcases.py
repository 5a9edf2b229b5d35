"""``kvmesh bench router``'s cost-model additions: the ``cost`` rows, two offered loads, the slow
shared tier, and their targets (issue #24, "Measured").

* **Rows.** ``kvmesh:cost`` over plain and over kvmesh replicas, beside every other setup, and
  over the slow-tier group (:data:`SLOW_SETUPS`) beside the weighted ``kvmesh`` policy.
* **Loads.** Every workload runs at a light and at a heavy offered load, set from the
  replicas' capacity measured in each phase (:func:`measure_capacity`), never hard-coded:
  synthetic workloads are closed loops (``concurrency`` conversations active), the trace is
  an open loop (``rate`` requests per second). Throughput against concurrency is taken as
  ``X(N) = X_max N / (N + N½)`` (``N½`` from the one-at-a-time throughput): light is one
  conversation at a time, heavy the concurrency where ``X(N)`` is 85% of ``X_max``; the
  trace's light rate is 30% of its measured capacity, its heavy one 85%.
* **Slow shared tier.** The ``kvmesh-slow`` group (:func:`kvmesh.bench.common.groups.replica_group`):
  a real redis-server behind :class:`~kvmesh.harness.slowproxy.SlowProxy` (50 ms each way,
  100 MB/s): loading a chunk from it takes longer than computing it on these replicas, as
  in the issue's measurement (a Redis 50 ms away).
* **Records.** A ``cost`` run's router keeps each request's predicted and observed TTFT
  (``GET /kvmesh/cost/records``); the run's summary carries them and their median absolute
  relative error after the first 50 requests.
* **Targets** (:func:`cost_targets`): medians of paired ratios over the repeats.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from kvmesh.bench.common import groups
from kvmesh.bench.common.groups import Setup
from kvmesh.harness.replicas import Replica

SLOW = "kvmesh-slow"  # the replica group whose shared tier is behind the slow proxy (groups.py)
COST_SETUPS = (Setup("kvmesh", "cost", "none"), Setup("kvmesh", "cost", "kvmesh"))
SLOW_SETUPS = (Setup("kvmesh", "kvmesh", SLOW), Setup("kvmesh", "cost", SLOW))
LOADS = ("light", "heavy")
LIGHT_RATE, HEAVY_UTILISATION = 0.3, 0.85
TTFT_TARGET = 0.8  # cost over kvmesh replicas vs the best other row over the same replicas
SLOW_TARGET = 0.7  # cost vs the weighted kvmesh policy on the slow shared tier
ERROR_TARGET = 0.25  # median |predicted - observed| / observed after the first 50 requests
ERROR_AFTER = 50


# -- offered loads -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Capacity:
    """What a replica group sustains: requests/s one at a time and saturated (synthetic, the
    default workload's shape), and the trace's requests/s with every request queued at once."""

    one_at_a_time: float
    saturated: float
    trace: float

    def concurrency(self, utilisation: float) -> int:
        """Closed-loop concurrency for ``utilisation`` of the saturated throughput."""
        half = max(self.saturated / max(self.one_at_a_time, 1e-9) - 1.0, 0.1)  # N½
        return max(1, math.ceil(half * utilisation / (1.0 - utilisation)))


def measure_capacity(
    replicas: Sequence[Replica], cache: str, specs: Sequence[Any], model_dir: str, workdir: str, log: Any
) -> Capacity:
    """Capacity of the group over a round-robin kvmesh router (no routing cleverness): the
    default workload's shape one conversation at a time and all at once, and the trace all
    at once. Texts of their own (no run finds them cached)."""
    from kvmesh.bench.common.workload import replay
    from kvmesh.bench.router import setups as rs
    from kvmesh.bench.router.trace_workload import load_conversations, replay_timed, schedule

    # the default workload's shape when only the trace runs (its capacity is measured too)
    synthetic = next((s for s in specs if s.kind == "synthetic"), rs.workloads(False)[0])
    probe = dataclasses.replace(synthetic, turns=1, users=1)
    groups.reset_prefix_caches([r.url for r in replicas])
    with groups.router_for(Setup("kvmesh", "round-robin", cache), replicas, model_dir, workdir) as url:
        one = replay(rs.build_workload(probe, 4201), url, groups.MODEL_NAME, 1, arrival="turns")
        many = replay(
            rs.build_workload(probe, 4202), url, groups.MODEL_NAME, 4 * groups.REPLICAS, arrival="turns"
        )
        trace_spec = next((s for s in specs if s.kind == "trace"), None)
        trace = 0.0
        if trace_spec is not None:
            rows = load_conversations(trace_spec.conversations)
            trace = replay_timed(schedule(rows, 1000.0), url, groups.MODEL_NAME, 4203).summary()[
                "requests_per_s"
            ]
    cap = Capacity(one.summary()["requests_per_s"], many.summary()["requests_per_s"], trace)
    log(f"  capacity: {cap.one_at_a_time} req/s one at a time, {cap.saturated} saturated, trace {cap.trace}")
    return cap


def with_loads(specs: Sequence[Any], loads: Sequence[str] = LOADS) -> list[Any]:
    """Each workload at each of ``loads`` (of :data:`LOADS`; ``name@load``, other texts per
    load), its concurrency and rate placeholders until :func:`resolve` sets them from a capacity."""
    bad = [x for x in loads if x not in LOADS]
    if bad or not loads:
        raise ValueError(f"unknown load(s) {bad or loads}; valid: {', '.join(LOADS)}")
    out = []
    for spec in specs:
        for i, load in enumerate(LOADS):
            if load not in loads:
                continue
            out.append(
                dataclasses.replace(spec, name=f"{spec.name}@{load}", seed_base=spec.seed_base + 500 * i)
            )
    return out


def needs_capacity(spec: Any) -> bool:
    """Whether ``spec``'s offered load is set from a measured capacity (all but a synthetic
    workload's light load: one conversation at a time)."""
    load = spec.name.rsplit("@", 1)[-1] if "@" in spec.name else None
    return load in LOADS and (load == "heavy" or spec.kind == "trace")


def resolve(specs: Sequence[Any], cap: Capacity | None) -> list[Any]:
    """:func:`with_loads`'s specs with the offered loads of ``cap`` (see the module docstring;
    ``None`` only when no spec :func:`needs_capacity`)."""
    out = []
    for spec in specs:
        load = spec.name.rsplit("@", 1)[-1]
        if load not in LOADS:
            out.append(spec)
            continue
        heavy = load == "heavy"
        if cap is None:
            if needs_capacity(spec):
                raise ValueError(f"{spec.name}'s offered load needs a measured capacity")
            out.append(dataclasses.replace(spec, concurrency=1))
            continue
        if spec.kind == "trace":
            rate = cap.trace * (HEAVY_UTILISATION if heavy else LIGHT_RATE)
            out.append(dataclasses.replace(spec, rate=round(max(rate, 0.1), 3)))
        else:
            n = cap.concurrency(HEAVY_UTILISATION) if heavy else 1
            out.append(dataclasses.replace(spec, concurrency=n))
    return out


# -- per-request predictions ---------------------------------------------------------------------
def cost_records(url: str) -> dict[str, Any]:
    """The cost router's per-request predicted and observed TTFT, and the median absolute
    relative error after the first :data:`ERROR_AFTER` (for a run's summary)."""
    try:
        with urllib.request.urlopen(url + "/kvmesh/cost/records", timeout=10) as resp:
            records = json.loads(resp.read())["records"]
    except (OSError, ValueError, KeyError) as exc:
        return {"cost_records_error": f"{type(exc).__name__}: {exc}"}
    errors = [
        abs(r["predicted_s"] - r["observed_s"]) / r["observed_s"]
        for r in records[ERROR_AFTER:]
        if r["observed_s"] > 0
    ]
    return {
        "cost_records": records,
        "prediction_error_median": round(statistics.median(errors), 4) if errors else None,
    }


# -- targets -----------------------------------------------------------------------------------
def _paired(ours: Sequence[Mapping[str, Any]], theirs: Sequence[Mapping[str, Any]]) -> float | None:
    from kvmesh.bench.runner import median_ratio

    return median_ratio([a.get("ttft_p90_s") for a in ours], [b.get("ttft_p90_s") for b in theirs])


def cost_targets(
    rows: Sequence[Mapping[str, Any]], runs: Mapping[str, Sequence[Mapping[str, Any]]]
) -> dict[str, Any]:
    """One workload's cost targets: cost over kvmesh replicas vs the best other row over the
    same replicas (TTFT p90, ≤ 0.8), the slow-tier ratio against the weighted policy (≤ 0.7),
    and the prediction error (≤ 0.25)."""
    out: dict[str, Any] = {}
    ok = [r for r in rows if "error" not in r and r.get("ttft_p90_s")]
    cost_name = Setup("kvmesh", "cost", "kvmesh").name
    others = [r for r in ok if r["cache"] == "kvmesh" and (r["router"], r["policy"]) != ("kvmesh", "cost")]
    if cost_name in runs and others:
        best = min(others, key=lambda r: float(r["ttft_p90_s"]))
        name = Setup(str(best["router"]), str(best["policy"]), "kvmesh").name
        paired = _paired(runs[cost_name], runs.get(name, []))
        out["cost_over_best_other_on_kvmesh"] = {
            "best": name, "median_paired_ratio": paired, "target": TTFT_TARGET,
            "met": paired is not None and paired <= TTFT_TARGET,
        }  # fmt: skip
    slow_cost, slow_km = (s.name for s in reversed(SLOW_SETUPS))
    if slow_cost in runs and slow_km in runs:
        paired = _paired(runs[slow_cost], runs[slow_km])
        met = paired is not None and paired <= SLOW_TARGET
        out["cost_over_kvmesh_on_slow_tier"] = {
            "median_paired_ratio": paired,
            "target": SLOW_TARGET,
            "met": met,
        }
    errors = [r["prediction_error_median"] for s in (cost_name, slow_cost) for r in runs.get(s, [])
              if r.get("prediction_error_median") is not None]  # fmt: skip
    if errors:
        err = round(statistics.median(errors), 4)
        out["prediction_error_median"] = {"value": err, "target": ERROR_TARGET, "met": err <= ERROR_TARGET}
    return out
