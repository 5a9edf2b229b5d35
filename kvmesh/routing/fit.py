"""One replica's fitted time-to-first-token model (see docs/cost-model.md for the equations).

``TTFT = base + queue * Q + compute * c + decode * c * D
        + sum over loaded media m (load_m * h_m + latency_m * [h_m > 0])``

with ``c`` the prompt's tokens computed there (thousands), ``Q`` the seconds of prefill work
queued ahead of it, ``D`` the requests decoding there, ``h_m`` the tokens loaded from medium
``m`` (thousands). Every coefficient is fitted per replica by :class:`~kvmesh.core.rls.RobustRLS`
from the TTFT the router observes on each request it proxies; what the replica itself reports
(its measured tier throughput and latency, its prefill rate, its KV bytes per token) enters as
a prior and as direct measurements fused into the fit, never as truth: a figure the router's
own observations contradict by more than ``DISTRUST_RATIO`` is set aside. Every parameter
lives in a box, so no input can make a rate negative or unbounded.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvmesh.core.rls import RobustRLS

# The media a prefix can come from, in the order a replica uses them: its own GPU cache
# (vLLM's prefix cache, always used), then kvmesh's tiers from the fastest; OTHER is any
# medium the index knows by another name. A prefix is loaded up to a cut and computed after.
MEDIA = ("GPU", "CPU", "DISK", "OTHER", "REMOTE")
TIER_MEDIUM = {"cpu": "CPU", "disk": "DISK", "remote": "REMOTE"}  # kvmesh tier -> medium
BASE, COMPUTE, QUEUE, DECODE = 0, 1, 2, 3
N_PARAMS = 4 + 2 * len(MEDIA)


def load_i(j: int) -> int:
    return 4 + 2 * j


def lat_i(j: int) -> int:
    return 5 + 2 * j


# The features' names, in order (for records and descriptions).
FEATURES = (
    "base",
    "compute_ktok",
    "queued_s",
    "decode_ktok_x_running",
    *(f"{m}_{what}" for m in MEDIA for what in ("ktok", "loaded")),
)


# Cold start, "never free": a replica nobody has measured computes at 1,000 tokens/s and an
# unmeasured medium loads no faster than computing; both with wide variances, so the first
# few dozen observations replace them.
COLD_COMPUTE = 1.0  # s per 1k tokens
COLD_LATENCY = 0.01
LOWER = np.array([0.0, 1e-4, 0.0, 0.0] + [0.0, 0.0] * len(MEDIA))
UPPER = np.array([10.0, 100.0, 3.0, 10.0] + [100.0, 10.0] * len(MEDIA))
# An unmeasured medium (no report, no observation yet) loads at this fraction of the replica's
# current prefill cost: never free, yet a little better than computing, so that requests
# which load from it are predicted as loading, and their TTFTs measure it.
UNMEASURED_FRACTION = 0.8
# A replica's own fit outweighs the fleet's pooled one as its evidence grows: weight
# (s*n + r) / (n + r + p) per coefficient (n: its observations involving it; r:
# POOL_EVIDENCE for a figure the replica reported, else 0; s: see DISTINCT_K; p: the pooled
# fit's own observations involving it, at most POOL_EVIDENCE: a pooled fit that has seen
# nothing yet is only the cold prior, and must not outweigh what a replica reported).
POOL_EVIDENCE = 20.0
# s: its observations count only as far as they show it differs from the fleet. The pooled
# fit's log residuals on its requests, an exponentially weighted mean b (less the fleet's own
# mean) with standard error se, give s = max(0, 1 - DISTINCT_K * se^2 / b^2) (positive-part
# James-Stein shrinkage). Identical replicas stay on the pooled fit (their own fits drift
# apart on noise: 3.6x in prefill rate on the simulator's identical replicas); a replica 2x
# slower than the rest is told apart within a few dozen requests.
DISTINCT_K = 4.0
DISTRUST_RATIO = 4.0  # a reported figure this far from the fitted one (either way) is set aside
DISTRUST_AFTER = 30  # ... once this many observations involved that medium
REPORT_REL_STD = 0.5  # how much a replica's own figure is trusted: ±50%


@dataclass
class Report:
    """What a replica says about itself, already bounded (:mod:`kvmesh.routing.reports`)."""

    at: float
    bytes_per_token: float | None = None
    prefill_tokens_per_s: float | None = None
    prefill_steps: int = 0
    # medium -> (bytes/s, latency s, loads measured)
    media: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    # kvmesh tier -> (bytes used, capacity bytes or None)
    use: dict[str, tuple[float, float | None]] = field(default_factory=dict)
    source: str = ""


def prior(compute: float | None = None, report: Report | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Prior mean and variance of every parameter: the report's figures where it has them,
    the cold-start values otherwise (``compute``: a fleet figure to start from)."""
    c = compute if compute is not None else COLD_COMPUTE
    if report is not None and report.prefill_tokens_per_s:
        c = 1e3 / report.prefill_tokens_per_s
    theta = np.zeros(N_PARAMS)
    var = np.zeros(N_PARAMS)
    # Wide variances: a ridge prior the data cannot overrule would bias the fit for good.
    theta[BASE], var[BASE] = 0.01, 0.2**2
    theta[COMPUTE], var[COMPUTE] = c, (0.5 * c) ** 2 if compute is not None else c**2
    theta[QUEUE], var[QUEUE] = 1.0, 0.5**2
    theta[DECODE], var[DECODE] = 0.0, (0.2 * c) ** 2 + 1e-8
    for j, m in enumerate(MEDIA):
        if m == "GPU":
            theta[load_i(j)], var[load_i(j)] = 0.0, (0.2 * c) ** 2 + 1e-8
            theta[lat_i(j)], var[lat_i(j)] = 0.0, 0.01**2
            continue
        theta[load_i(j)], var[load_i(j)] = c, c**2  # unmeasured: as slow as computing
        theta[lat_i(j)], var[lat_i(j)] = COLD_LATENCY, 0.05**2
        got = _reported(report, m)
        if got is not None:
            theta[load_i(j)], var[load_i(j)] = got[0], (REPORT_REL_STD * got[0]) ** 2 + 1e-8
            theta[lat_i(j)], var[lat_i(j)] = got[1], (REPORT_REL_STD * got[1] + 0.002) ** 2
    return np.clip(theta, LOWER, UPPER), var


def _reported(report: Report | None, medium: str) -> tuple[float, float] | None:
    """(s per 1k tokens, latency s) of ``medium`` as the report has it, if it can say."""
    if report is None or not report.bytes_per_token:
        return None
    fig = report.media.get(medium)
    if fig is None or fig[0] <= 0:
        return None
    return 1e3 * report.bytes_per_token / fig[0], fig[1]


_MEDIA_COLUMNS = np.arange(load_i(0), N_PARAMS)  # each medium's load and latency, in turn
# Each medium's load and latency columns, of coefficients or features: slices (views, not copies).
LOAD_COLUMNS = slice(load_i(0), N_PARAMS, 2)
LAT_COLUMNS = slice(lat_i(0), N_PARAMS, 2)
_NOT_PINNED = np.zeros(N_PARAMS, dtype=bool)
_NOT_PINNED.flags.writeable = False


def pool_weight(fleet: ReplicaFit | None) -> np.ndarray:
    """Per coefficient, the pooled fit's weight in a blend: its evidence, at most POOL_EVIDENCE."""
    pool = np.full(N_PARAMS, POOL_EVIDENCE)
    if fleet is not None:
        np.minimum(pool, fleet.evidence(), out=pool)
    return pool


def blend_weights(
    counted: np.ndarray, evidence: np.ndarray, pinned: np.ndarray, pool: np.ndarray
) -> np.ndarray:
    """The weight of a replica's own fit (rows of :meth:`ReplicaFit.blend_terms`, any
    leading shape) against the pooled fit's, ``pool`` (:func:`pool_weight`); 0 where neither
    has evidence (both are their priors: the pooled one is the fleet's)."""
    total = evidence + pool
    out: np.ndarray = np.divide(counted, total, out=np.zeros(total.shape), where=total > 0)
    if pinned is not _NOT_PINNED:
        out[pinned] = 1.0
    return out


class ReplicaFit:
    """The fit and the router's own ledger of one replica (everything here is bounded)."""

    def __init__(self, name: str, compute: float | None = None, forgetting: float = 0.995) -> None:
        self.name = name
        self.forgetting = forgetting
        theta, var = prior(compute)
        self.rls = RobustRLS(theta, var, LOWER, UPPER, forgetting=forgetting, floor=0.005)
        self.report: Report | None = None
        self._fused: dict[str, tuple[int, float]] = {}  # medium or "compute" -> (count, value) fused
        self.distrusted: set[str] = set()
        self.rejected: dict[str, int] = {}  # why report fields were refused -> how often
        self.uses = np.zeros(len(MEDIA), dtype=np.int64)  # observations that loaded each medium
        self.unmeasured = np.array([m != "GPU" for m in MEDIA])  # neither reported nor observed
        self.pinned: set[int] = set()  # coefficients set by hand (CostModel.set_param)
        self.errors: deque[float] = deque(maxlen=256)  # |pred - obs| / obs of recent requests
        self.observations = 0
        # exponentially weighted sums of the pooled fit's log residuals here: weight, z, z^2
        self.residuals = (0.0, 0.0, 0.0)

    # -- what the replica says ----------------------------------------------------------------
    def apply_report(self, report: Report) -> None:
        """Fuse a report's figures when they are new (more loads measured) and moved (a
        figure the fit has already taken is not taken again: a replica repeating itself is
        no more certain for it)."""
        self.report = report
        if report.prefill_tokens_per_s:
            self._fuse("compute", COMPUTE, 1e3 / report.prefill_tokens_per_s, report.prefill_steps)
        for j, m in enumerate(MEDIA):
            got = _reported(report, m)
            if got is None or m in self.distrusted:
                continue
            self._check_trust(j, m, got[0])
            if m not in self.distrusted and self._fuse(m, load_i(j), got[0], report.media[m][2]):
                self.rls.nudge(lat_i(j), got[1], (REPORT_REL_STD * got[1] + 0.002) ** 2, 0.002**2)
                self.unmeasured[j] = False

    def _fuse(self, key: str, i: int, value: float, count: int) -> bool:
        last = self._fused.get(key)
        if last is not None and (count <= last[0] or abs(value - last[1]) <= 0.1 * max(last[1], 1e-9)):
            return False
        self._fused[key] = (count, value)
        scale = float(self.rls.theta[COMPUTE])  # the data can overrule a claim on this scale
        var = (REPORT_REL_STD * value) ** 2 + 1e-8
        self.rls.nudge(i, value, var, (0.25 * scale) ** 2 if i != COMPUTE else var / 4)
        return True

    def _check_trust(self, j: int, medium: str, value: float) -> None:
        if self.uses[j] < DISTRUST_AFTER:
            return
        fitted = float(self.rls.theta[load_i(j)])
        lo, hi = sorted((max(fitted, 1e-6), max(value, 1e-6)))
        if hi / lo > DISTRUST_RATIO:
            self.distrusted.add(medium)

    def reject(self, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1

    # -- what the router sees ---------------------------------------------------------------
    def residual_mean(self) -> tuple[float, float, float]:
        """(weight, mean, variance of the mean) of the pooled fit's log residuals here."""
        w, s1, s2 = self.residuals
        if w < 2.0:
            return w, 0.0, math.inf
        mean = s1 / w
        return w, mean, max(s2 / w - mean * mean, 1e-6) / w

    def distinct(self, fleet: ReplicaFit | None = None) -> float:
        """How clearly this replica differs from the fleet, 0..1 (see DISTINCT_K): its mean
        log residual under the pooled fit against the fleet's own (``fleet``, the pooled fit:
        log residuals average below zero even where the fit is right, and by as much on
        every replica)."""
        w, mean, var = self.residual_mean()
        if fleet is not None:
            fw, fmean, fvar = fleet.residual_mean()
            if fw >= 2.0:
                mean, var = mean - fmean, var + fvar
        b2 = mean * mean
        if w < 2.0 or b2 <= 0.0:
            return 0.0
        return max(0.0, 1.0 - DISTINCT_K * var / b2)

    def evidence(self) -> np.ndarray:
        """Per coefficient, the observations that involved it."""
        seen = np.full(N_PARAMS, float(self.observations))
        seen[_MEDIA_COLUMNS] = np.repeat(self.uses, 2)
        return seen

    def blend_terms(self, fleet: ReplicaFit | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per coefficient, this replica's evidence as far as it counts (its observations,
        counted as far as they show it differs from the fleet, and what it reported), all
        its evidence, and whether the coefficient is pinned: the weight of its own fit
        against the pooled one is :func:`blend_weights` of them (see POOL_EVIDENCE)."""
        own = self.distinct(fleet)
        seen = self.evidence()
        told = np.zeros(N_PARAMS)
        if "compute" in self._fused:
            told[COMPUTE] = POOL_EVIDENCE
        for j, m in enumerate(MEDIA):
            if m in self._fused:
                told[load_i(j)] = told[lat_i(j)] = POOL_EVIDENCE
        pinned = _NOT_PINNED
        if self.pinned:
            pinned = np.zeros(N_PARAMS, dtype=bool)
            pinned[list(self.pinned)] = True
        return own * seen + told, seen + told, pinned

    def blend(self, fleet: ReplicaFit | None = None) -> np.ndarray:
        """Per coefficient, the weight of this replica's own fit against the pooled one."""
        return blend_weights(*self.blend_terms(fleet), pool_weight(fleet))

    def observe(
        self,
        x: np.ndarray,
        predicted: float,
        observed: float,
        start: np.ndarray | None = None,
        pooled: float | None = None,
    ) -> None:
        """Learn from one request. ``start``: the coefficients its prediction used (the
        fleet's, blended in): a replica's first evidence about a coefficient starts there.
        ``pooled``: the pooled fleet fit's prediction for it (see :meth:`distinct`)."""
        if not (math.isfinite(observed) and 0.0 < observed < 3600.0):
            self.reject("ttft out of range")
            return
        if pooled is not None and math.isfinite(pooled):
            z = math.log(observed / max(pooled, 1e-3))
            w, s1, s2 = self.residuals
            f = self.forgetting
            self.residuals = (f * w + 1.0, f * s1 + z, f * s2 + z * z)
        if start is not None and not self.observations:
            for i in (BASE, QUEUE, DECODE, COMPUTE):
                if i != COMPUTE or "compute" not in self._fused:
                    v = float(start[i])
                    self.rls.set_prior(i, v, max(v, 0.01) ** 2)  # wide: the fleet is not this replica
        loaded = x[LOAD_COLUMNS] > 0
        for j in np.flatnonzero(loaded & self.unmeasured):
            # First evidence about this medium: start it where predictions had it.
            c = (
                UNMEASURED_FRACTION * float(self.rls.theta[COMPUTE])
                if start is None
                else float(start[load_i(j)])
            )
            self.rls.set_prior(load_i(j), c, max(c, COLD_COMPUTE) ** 2)  # wide: nothing is known
            if start is not None:
                self.rls.set_prior(lat_i(j), float(start[lat_i(j)]), 0.05**2)
            self.unmeasured[j] = False
        self.rls.update(x, observed)
        self.observations += 1
        self.uses += loaded
        self.errors.append(abs(predicted - observed) / observed)

    def describe(self, bytes_per_token: float | None = None) -> dict[str, Any]:
        """Fitted figures in readable units (for ``/kvmesh/state``)."""
        th = self.rls.theta
        bpt = bytes_per_token or (self.report.bytes_per_token if self.report else None)
        media: dict[str, Any] = {}
        for j, m in enumerate(MEDIA):
            s_kt = float(th[load_i(j)])
            if self.unmeasured[j]:
                s_kt = UNMEASURED_FRACTION * float(th[COMPUTE])
            media[m] = {
                "load_tokens_per_s": round(1e3 / s_kt, 1) if s_kt > 0 else None,
                "load_bytes_per_s": round(1e3 / s_kt * bpt, 1) if s_kt > 0 and bpt else None,
                "latency_s": round(float(th[lat_i(j)]), 6),
                "observations": int(self.uses[j]),
                "measured": not self.unmeasured[j],
                "report_distrusted": m in self.distrusted,
            }
        errs = sorted(self.errors)
        return {
            "prefill_tokens_per_s": round(1e3 / float(th[COMPUTE]), 1),
            "base_s": round(float(th[BASE]), 5),
            "queue_coef": round(float(th[QUEUE]), 3),
            "decode_slowdown_s_per_ktok": round(float(th[DECODE]), 5),
            "media": media,
            "observations": self.observations,
            "mean_log_residual_under_fleet_fit": round(self.residual_mean()[1], 4),
            "median_abs_rel_error": round(errs[len(errs) // 2], 4) if errs else None,
            "report": None
            if self.report is None
            else {
                "source": self.report.source,
                "bytes_per_token": self.report.bytes_per_token,
                "prefill_tokens_per_s": self.report.prefill_tokens_per_s,
                "media": {
                    m: {"bytes_per_s": v[0], "latency_s": v[1], "loads": v[2]}
                    for m, v in self.report.media.items()
                },
            },
            "rejected_inputs": dict(self.rejected),
        }
