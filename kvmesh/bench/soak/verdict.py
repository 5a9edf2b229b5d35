"""The soak's verdict: every check the README states, computed from what the run recorded.

``kvmesh soak`` exits 1 unless every check holds (:func:`checks` on the report, so a JSON
written earlier can be judged again):

- ``wrong``, ``hang``, ``interrupted``, ``error``: none (``error`` includes a failure a fault
  does not explain, see :func:`explain`);
- ``faults_injected``: every fault the run was asked for was injected (one that was skipped
  or failed to inject fails the soak: its absence would pass for resilience);
- ``recovery``: after each fault, a clean window (``clean_window_s`` of answers, all correct,
  hit rate >= ``recovery_hit_fraction`` x the rate before the first fault, less two standard
  errors of a rate measured on that many answers) starts within ``recovery_within_s`` of the
  fault's end;
- ``correct_per_window``: every ``window_s`` window has at least ``min_correct_fraction`` of
  the correct answers a window had before the first fault, except windows that overlap the
  router's restart (nothing can answer while the only router is down);
- ``memory``: each process's peak RSS stays within its bound: its RSS once warm (its peak
  under load before the first fault) plus a stated allowance, so a leak of the allowance
  over the run fails;
- ``pool_overflows``: the prompt pool, split evenly over the replicas, holds more chunks than
  a replica's own caches (vLLM's prefix cache plus kvmesh's CPU tier), so the disk and shared
  tiers carry load and their faults touch kvmesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvmesh.bench.soak.load import FaultEvent, Record, hit_rate

# Which fault explains a failure that clients retry: a refused or unanswered connection
# only while the router restarts; a stream broken off by the router's error event only while
# a replica dies (or the router drains).
EXPLAINED_BY: dict[str, tuple[str, ...]] = {
    "router_down": ("router_restart",),
    "broken_stream": ("replica_kill", "router_restart"),
}
MUST_BE_ZERO = ("wrong", "hang", "interrupted", "error")


@dataclass(frozen=True)
class Bounds:
    """What the verdict holds the run to (written into the JSON as ``bounds``)."""

    window_s: float = 10.0
    min_correct_fraction: float = 0.25
    recovery_within_s: float = 30.0
    clean_window_s: float = 10.0
    recovery_hit_fraction: float = 0.9
    restart_grace_s: float = 2.0  # after the router's restart: clients still on their back-off
    # Peak RSS may exceed the warm RSS by this much, per kind of process (MiB).
    rss_allowance_mb: dict[str, float] = field(
        default_factory=lambda: {"replica": 384.0, "router": 128.0, "redis": 64.0}
    )

    @property
    def fault_gap_s(self) -> float:
        """The least time between a fault's end and the next one's start: room for its recovery."""
        return self.recovery_within_s + self.clean_window_s

    def allowance_mb(self, process: str) -> float:
        kind = process.rstrip("0123456789")
        return self.rss_allowance_mb.get(kind, min(self.rss_allowance_mb.values()))

    def with_(self, **changes: Any) -> Bounds:
        return replace(self, **changes)

    def record(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def record(self) -> dict[str, Any]:
        return asdict(self)


def _overlaps(r: Record, events: Sequence[FaultEvent], names: tuple[str, ...], grace: float) -> bool:
    return any(e.name in names and r.start <= e.end + grace and r.end >= e.start for e in events)


def explain(records: Sequence[Record], events: Sequence[FaultEvent], grace_s: float) -> list[Record]:
    """``records`` with each retryable failure that no fault explains (:data:`EXPLAINED_BY`:
    a router_down outside the router's restart, a broken stream outside a replica's death)
    turned into an ``error``: clients may retry those only because the fault is expected."""
    out = []
    for r in records:
        names = EXPLAINED_BY.get(r.outcome)
        if names is not None and not _overlaps(r, events, names, grace_s):
            r = replace(r, outcome="error", detail=f"{r.outcome} outside {'/'.join(names)}: {r.detail}")
        out.append(r)
    return out


def windows(
    records: Sequence[Record], events: Sequence[FaultEvent], duration: float, bounds: Bounds
) -> dict[str, Any]:
    """Correct answers per ``window_s`` window (complete windows only), the least a window
    must have, and which windows the router's restart exempts."""
    w = bounds.window_s
    first = min((e.start for e in events), default=duration)
    before = sum(1 for r in records if r.outcome == "correct" and r.end < first)
    per_window_before = before * w / first if first > 0 else 0.0
    least = max(1, math.ceil(bounds.min_correct_fraction * per_window_before))
    rows = []
    for k in range(int(duration // w)):
        lo, hi = k * w, (k + 1) * w
        exempt = any(
            e.name == "router_restart" and lo < e.end + bounds.restart_grace_s and hi > e.start
            for e in events
        )
        correct = sum(1 for r in records if r.outcome == "correct" and lo <= r.end < hi)
        rows.append({"t": lo, "correct": correct, "exempt": exempt})
    return {
        "window_s": w,
        "correct_per_window_before_faults": round(per_window_before, 1),
        "least": least,
        "rows": rows,
    }


def recovery_s(
    records: Sequence[Record], fault_end: float, baseline: float, window_s: float, fraction: float = 0.9
) -> float | None:
    """Seconds from a fault's end until a ``window_s`` window of answers has no failure and a
    hit rate of at least ``fraction`` x the pre-fault ``baseline``, less two standard errors
    of a rate measured on that window's answers (:func:`hit_slack`); ``None`` if that never
    happens."""
    ends = sorted({r.end for r in records if r.end >= fault_end})
    for t in ends:
        window = [r for r in records if t <= r.end < t + window_s]
        if not window or window[-1].end < t + window_s * 0.8:
            continue
        if not all(r.outcome == "correct" for r in window):
            continue
        if (hit_rate(window) or 0.0) >= fraction * baseline - hit_slack(baseline, len(window)):
            return t - fault_end
    return None


def hit_slack(baseline: float, answers: int) -> float:
    """Two standard errors of a hit rate near ``baseline`` measured on ``answers`` answers.
    A short run's window holds a few dozen answers: with none of it, a fleet back to its
    pre-fault rate still missed ``fraction`` x that rate in most windows (5-second windows of
    a 1-minute soak ranged 0.45-0.71 around a 0.73 pre-fault rate, no fault active), and
    the check failed by chance. A fleet that has not recovered (0.14-0.34 while a replica
    restarts, in the same run) stays well below it."""
    if answers <= 0 or not 0.0 < baseline < 1.0:
        return 0.0
    return 2.0 * math.sqrt(baseline * (1.0 - baseline) / answers)


def checks(out: dict[str, Any]) -> list[Check]:
    """Every check of the module docstring, from a report (:func:`kvmesh.bench.soak.load.report`)."""
    bounds = Bounds(**out["bounds"])
    result = [Check(k, int(out[k]) == 0, f"{out[k]} {k}") for k in MUST_BE_ZERO]

    done = {f["name"]: f for f in out["faults"]}
    missing = [
        f"{name}: {done[name]['note'] if name in done else 'never started'}"
        for name in out["settings"]["faults"]
        if name not in done or not done[name].get("injected", False)
    ]
    result.append(Check("faults_injected", not missing, "; ".join(missing) or "every fault injected"))

    slow = [
        f"{f['name']}: " + ("never" if f["recovery_s"] is None else f"{f['recovery_s']:.1f} s")
        for f in out["faults"]
        if f.get("injected", False)
        and (f["recovery_s"] is None or f["recovery_s"] > bounds.recovery_within_s)
    ]
    result.append(
        Check(
            "recovery",
            not slow,
            "; ".join(slow) or f"every fault recovered within {bounds.recovery_within_s:.0f} s",
        )
    )

    win = out["windows"]
    short = [
        f"{r['t']:.0f} s: {r['correct']}"
        for r in win["rows"]
        if not r["exempt"] and r["correct"] < win["least"]
    ]
    result.append(
        Check(
            "correct_per_window",
            bool(win["rows"]) and not short,
            f"windows under {win['least']} correct answers: {', '.join(short)}"
            if short
            else f"every {bounds.window_s:.0f} s window had >= {win['least']} correct answers"
            if win["rows"]
            else "no complete window",
        )
    )

    over = [
        f"{name}: peak {m['peak_mb']:.0f} MiB, never measured warm (no bound)"
        if m["bound_mb"] is None
        else f"{name}: peak {m['peak_mb']:.0f} MiB > bound {m['bound_mb']:.0f} MiB"
        for name, m in out["memory"].items()
        if m["bound_mb"] is None or m["peak_mb"] > m["bound_mb"]
    ]
    peaks = ", ".join(
        f"{name} {m['peak_mb']:.0f}/{m['bound_mb']:.0f}" for name, m in out["memory"].items() if m["bound_mb"]
    )
    result.append(
        Check(
            "memory",
            bool(out["memory"]) and not over,
            "; ".join(over) or f"every process within its bound (peak/bound MiB: {peaks})"
            if out["memory"]
            else "no process measured",
        )
    )

    pool = out["pool"]
    own = pool["vllm_cache_chunks"] + pool["cpu_tier_chunks"]
    share = pool["chunks"] / pool["replicas"]
    result.append(
        Check(
            "pool_overflows",
            share > own,
            f"{pool['chunks']} chunks in the pool, {share:.0f} per replica; {own} in a replica's own caches",
        )
    )
    return result


def memory(warm: dict[str, int], peak: dict[str, int], bounds: Bounds) -> dict[str, dict[str, float | None]]:
    """Per process: RSS once warm, its peak and its bound (MiB); a process never seen warm
    has no bound (and fails the check)."""
    mib = 2**20
    out: dict[str, dict[str, float | None]] = {}
    for name in sorted(set(warm) | set(peak)):
        w = warm.get(name)
        out[name] = {
            "warm_mb": None if w is None else round(w / mib, 1),
            "peak_mb": round(max(peak.get(name, 0), w or 0) / mib, 1),
            "bound_mb": None if w is None else round(w / mib + bounds.allowance_mb(name), 1),
        }
    return out


def verdict(out: dict[str, Any]) -> dict[str, Any]:
    """``ok`` and the :func:`checks`, as the JSON keeps them."""
    found = checks(out)
    return {"ok": all(c.ok for c in found), "checks": [c.record() for c in found]}


def verdict_ok(out: dict[str, Any]) -> bool:
    """Whether every check holds (the exit status of ``kvmesh soak``)."""
    return all(c.ok for c in checks(out))
