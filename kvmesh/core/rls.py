"""A small robust online linear regression: recursive least squares (RLS) with forgetting.

Used where kvmesh learns a cost from what it observes, one observation at a time: the engine
fits each tier's load time (:mod:`kvmesh.core.loadcost`), the router each replica's time to
first token (:mod:`kvmesh.routing.fit`). Both see hostile or broken observations (a stalled
replica, a load that hit a GC pause, a replica that lies), so plain RLS is hardened in four
ways, each bounded:

* **relative weighting**: an observation ``y`` is weighted by ``1 / max(√(ŷy), floor)²``, so the
  fit minimises relative error (a 20 ms TTFT matters as much as a 2 s one);
* **ratio clipping** (Huber-like, in ratio): an observation more than ``clip`` times above
  or below the prediction (more while the fit is far off, at most 1000 times) counts as
  exactly that far off, so one absurd observation moves the fit by a bounded step, while a
  real shift (every observation off) widens the limit and is followed within a few dozen
  observations;
* **forgetting** (``λ`` < 1) so that the fit follows a replica whose speed changes, with the
  covariance's trace capped (forgetting otherwise inflates it without bound along directions
  no observation excites: "covariance wind-up") and reset when it stops being finite;
* **box constraints**: what the fit hands out (``theta``) lies in ``[lower, upper]``, so it
  can never return a negative or unbounded rate whatever it is fed. Internally the estimate
  may overshoot the box by half its width (itself a bound): projecting the estimate itself
  after each step would ratchet a parameter whose true value sits on a bound (a latency of
  0) upward, since only the noise pointing into the box would stay. ``theta`` is the
  estimate projected into the box in the metric of its covariance, not clipped coordinate by
  coordinate: a parameter held at its bound moves the parameters correlated with it as
  conditioning on its value would. Two features that nearly always come together (the
  constant and a prefix that every prompt shares) give an estimate such as ``base = -0.03,
  gpu = +0.04``; clipping ``base`` to 0 alone kept ``gpu`` at 0.04 and over-predicted every
  request by 0.03 s (0.04-0.06 s observed: +70%), the projection lowers ``gpu`` with it.

Prior knowledge enters as the starting point and its variance (``theta0``, ``var0``), and
later as :meth:`RobustRLS.nudge`: a direct measurement of one parameter (a replica's own
figure for a tier) fused like a Kalman update, so the fit and the measurement check each
other. Pure numpy; no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

_MAX_X = 1e9
_MAX_LOG_CLIP = math.log(1e3)  # the clip never widens beyond 1000x


def _vec(values: Sequence[float] | np.ndarray, n: int, name: str) -> np.ndarray:
    arr = np.array(values, dtype=float).reshape(-1)
    if arr.shape != (n,) or not np.isfinite(arr).all():
        raise ValueError(f"{name} must be {n} finite numbers, got {values!r}")
    return arr


class RobustRLS:
    """``y ≈ θ·x`` with ``θ`` in a box, learned online (see the module docstring)."""

    __slots__ = (
        "_clip",
        "_hi",
        "_lam",
        "_lo",
        "_max_trace",
        "_raw",
        "_scale_rate",
        "floor",
        "lower",
        "n",
        "p",
        "p0",
        "scale",
        "theta",
        "upper",
    )

    def __init__(
        self,
        theta0: Sequence[float] | np.ndarray,
        var0: Sequence[float] | np.ndarray,
        lower: Sequence[float] | np.ndarray,
        upper: Sequence[float] | np.ndarray,
        *,
        forgetting: float = 0.995,
        clip: float = 2.0,
        floor: float = 1e-3,
        scale0: float = 0.5,
        scale_rate: float = 0.05,
    ) -> None:
        k = len(theta0)
        self.lower = _vec(lower, k, "lower")
        self.upper = _vec(upper, k, "upper")
        if (self.lower > self.upper).any():
            raise ValueError("lower bounds must not exceed upper bounds")
        var = _vec(var0, k, "var0")
        if (var <= 0).any():
            raise ValueError("prior variances must be positive")
        if not 0.5 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0.5, 1], got {forgetting}")
        if clip <= 1 or floor <= 0 or scale0 <= 0 or not 0 < scale_rate < 1:
            raise ValueError("clip must be > 1, floor and scale0 positive and scale_rate in (0, 1)")
        slack = 0.5 * (self.upper - self.lower)
        self._lo, self._hi = self.lower - slack, self.upper + slack
        self._raw = np.clip(_vec(theta0, k, "theta0"), self.lower, self.upper)  # the estimate
        self.theta = self._raw.copy()  # what is handed out: the estimate projected into the box
        self.p0 = np.diag(var)
        self.p = self.p0.copy()
        # Wind-up cap: never more uncertain than the prior was, in total.
        self._max_trace = float(var.sum())
        self._lam = forgetting
        self._clip = clip
        self.floor = floor
        self.scale = scale0  # EWMA of |log(observed / predicted)|: how well the fit does
        self._scale_rate = scale_rate
        self.n = 0

    def __len__(self) -> int:
        return len(self.theta)

    def predict(self, x: np.ndarray) -> float:
        return float(self.theta @ x)

    def update(self, x: Sequence[float] | np.ndarray, y: float) -> float | None:
        """Learn from one observation; returns its relative residual before the step
        (``(y - ŷ) / max(√(ŷy), floor)``), or None when it was rejected (not finite, or ``x``
        not finite): a broken observation is ignored, never learned."""
        xv = np.asarray(x, dtype=float).reshape(-1)
        # Not finite (NaN compares false), or beyond any real feature or observation: ignored,
        # not learned.
        if xv.shape != self.theta.shape or not (np.abs(xv).max() <= _MAX_X and abs(y) <= _MAX_X):
            return None
        raw = float(self._raw @ xv)
        pred = float(self.theta @ xv)
        base = max(pred, self.floor)
        # Clipped in ratio: an observation more than `limit` times off the prediction counts
        # as exactly that far off. The limit is `clip`, or wider while the fit is far off
        # (e^(2 * scale), scale being the EWMA of |log(observed / predicted)|, itself fed
        # clipped ratios): a limit that shrinks as the fit improves would clip the very
        # observations that carry the news; one that never widens would take dozens of
        # steps to leave a prior that is 50x off.
        limit = max(self._clip, math.exp(min(2.0 * self.scale, _MAX_LOG_CLIP)))
        used = min(max(y, base / limit), base * limit)
        # Weight 1/s² with s between prediction and observation (their geometric mean), so
        # that neither a wrong early fit nor a freak observation alone sets the weight.
        s = max(math.sqrt(base * used), self.floor)
        rel = (y - pred) / s
        self.scale += self._scale_rate * (abs(math.log(used / base)) - self.scale)
        px = self.p @ xv
        denom = self._lam * s * s + float(xv @ px)  # weight 1 / s²: relative error
        if denom <= 0 or not np.isfinite(denom):
            self._reset_cov()
            self._hand_out()
            return rel
        gain = px / denom
        self._set(self._raw + gain * (used - raw))
        p = (self.p - gain[:, None] * px[None, :]) / self._lam  # np.outer, without its wrapper
        self.p = 0.5 * (p + p.T)
        self._bound_cov()
        self.n += 1
        return rel

    def nudge(self, i: int, value: float, var: float, min_var: float = 0.0) -> None:
        """Fuse a direct measurement ``value`` (variance ``var``) of parameter ``i``, leaving
        its variance at least ``min_var``: a source that repeats itself is not more certain
        each time, and the observations must stay able to overrule it."""
        if not (np.isfinite(value) and np.isfinite(var) and var > 0 and np.isfinite(min_var)):
            return
        col = self.p[:, i].copy()
        denom = col[i] + var
        if denom <= 0:
            return
        gain = col / denom
        self._set(self._raw + gain * (value - self._raw[i]))
        p = self.p - np.outer(gain, col)
        self.p = 0.5 * (p + p.T)
        if self.p[i, i] < min_var:
            self.p[i, i] = min_var  # a larger diagonal keeps the matrix positive semi-definite
        self._bound_cov()

    def set_prior(self, i: int, value: float, var: float) -> None:
        """Restart parameter ``i`` from ``value`` with variance ``var`` (its correlations
        with the others forgotten)."""
        if not (np.isfinite(value) and np.isfinite(var) and var > 0):
            return
        raw = self._raw.copy()
        raw[i] = min(max(value, self.lower[i]), self.upper[i])
        self._set(raw)
        self.p[i, :] = 0.0
        self.p[:, i] = 0.0
        self.p[i, i] = var
        self.p0[i, i] = var
        self._max_trace = float(np.trace(self.p0))
        self._bound_cov()

    def _set(self, raw: np.ndarray) -> None:
        # np.clip's values (NaN stays NaN) without its wrapper's cost; theta follows the
        # covariance (_hand_out, from _bound_cov), which changes after the estimate
        self._raw = np.minimum(np.maximum(raw, self._lo), self._hi)

    def _hand_out(self) -> None:
        self.theta = project(self._raw, self.p, self.lower, self.upper)

    def _bound_cov(self) -> None:
        """Bound the covariance, then hand out the estimate under it (every change ends here)."""
        diag = self.p.diagonal()
        # A sum is finite only if every entry is (and summing huge finite ones to inf resets
        # it too, which is as well): one reduction instead of a mask and its all().
        if not math.isfinite(float(self.p.sum())) or diag.min() < 0:
            self._reset_cov()
        else:
            tr = float(diag.sum())
            if tr > self._max_trace:
                self.p *= self._max_trace / tr
        self._hand_out()

    def _reset_cov(self) -> None:
        self.p = self.p0.copy()

    def state(self) -> dict[str, Any]:
        return {
            "theta": [float(v) for v in self.theta],
            "std": [float(v) for v in np.sqrt(np.maximum(np.diag(self.p), 0.0))],
            "scale": round(self.scale, 4),
            "updates": self.n,
        }


def project(raw: np.ndarray, p: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """``raw`` moved into the box ``[lower, upper]`` in the metric of its covariance ``p``.

    The coordinates outside the box are held at their bound and the others conditioned on
    those values, as a Gaussian with covariance ``p`` would be: one coordinate at a time
    (``x += P[:, i] (b_i - x_i) / P[i, i]``, then ``P`` conditioned on it too, which makes the
    sequence the joint conditioning). A coordinate that this moves out of the box is held as
    well, and so on. Held coordinates stay held: the result is in the box, and equals ``raw``
    where ``raw`` is in it. Falls back to clipping where the result is not finite.
    """
    clipped: np.ndarray = np.minimum(np.maximum(raw, lower), upper)
    todo = (clipped != raw).nonzero()[0]  # NaN compares unequal
    if not len(todo) or not np.isfinite(raw).all():
        return clipped
    theta = raw.copy()
    cov = p
    last: tuple[np.ndarray, float] | None = None  # the conditioning cov has not taken yet
    with np.errstate(all="ignore"):  # a covariance fed absurd inputs may overflow: checked below
        for _ in range(len(raw)):
            for i in todo:
                if last is not None:  # P conditioned on the coordinate held before this one
                    cov = cov - np.multiply.outer(last[0], last[0] / last[1])
                    last = None
                pii = float(cov[i, i])
                if pii > 0.0:
                    col = cov[:, i]
                    theta += col * ((float(clipped[i]) - float(theta[i])) / pii)
                    last = (col, pii)  # taken only if another coordinate follows: 1 is common
                theta[i] = clipped[i]
            clipped = np.minimum(np.maximum(theta, lower), upper)
            todo = (clipped != theta).nonzero()[0]
            if not len(todo):
                break
    if not np.isfinite(clipped).all():
        fallback: np.ndarray = np.minimum(np.maximum(raw, lower), upper)
        return fallback
    return clipped
