"""``policy: cost``: route each request to the replica with the lowest predicted time to first token.

For every candidate the model predicts (see :mod:`kvmesh.routing.fit` for the fitted
coefficients and docs/cost-model.md for the whole derivation):

* **waiting**: the prefill work already queued there, in seconds: what this router sent
  and has not seen a first byte of (its own ledger, exact and instant, so a burst within
  one scrape interval sees itself), plus the requests vLLM's gauges say are waiting beyond
  those (at this replica's mean prefill time), plus the slowdown its running decodes add;
* **loading**: for each medium holding part of the prefix, tokens over its fitted rate plus
  its per-load latency, in the order a replica uses them (its GPU cache, then CPU, disk,
  other media, the shared tier), cut where computing the rest is cheaper (the connector
  applies the same rule with its own measurements);
* **computing**: the tokens nothing supplies, at the fitted prefill rate.

The picker takes the lowest prediction. Near-equal predictions (within ``tie_tolerance``)
count as equal and go by rendezvous hash of the prompt, so equal prompts agree (and find
each other's cache) while different prompts spread. Herding is guarded by the ledger: a
request sent to a replica adds its predicted prefill there at once, and the speculative
index entry makes the next request of the same prefix see it there, behind that queue.

Gauges from a replica are bounded (``max_gauge``) and ignored once older than
``gauge_stale_s``; predictions are clipped to ``[MIN_PREDICTION_S, MAX_PREDICTION_S]`` and
never NaN. The model is pure (no I/O); its clock is injected, so the simulator drives it
on simulated time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmesh.routing.fit import (
    BASE,
    COMPUTE,
    DECODE,
    LAT_COLUMNS,
    LOAD_COLUMNS,
    MEDIA,
    N_PARAMS,
    POOL_EVIDENCE,
    QUEUE,
    UNMEASURED_FRACTION,
    ReplicaFit,
    Report,
    blend_weights,
    lat_i,
    load_i,
    pool_weight,
)
from kvmesh.routing.picker import Decision, Picker
from kvmesh.routing.scorers import (
    PrefixScorer,
    PrefixSource,
    ReplicaState,
    RoutingRequest,
    as_table,
    medium_tokens,
)
from kvmesh.routing.table import ReplicaTable

MIN_PREDICTION_S = 1e-4
MAX_PREDICTION_S = 3600.0
# medium_tokens' columns (REMOTE, DISK, CPU, GPU, unknown) in MEDIA's order
_COLUMNS = np.array([3, 2, 1, 4, 0])
_NO_ROWS = np.zeros(0, dtype=np.int64)
_MEDIA_AT = np.arange(len(MEDIA))
# the features of a request's own prefill work (its service): all but BASE and QUEUE
_SERVICE_MASK = np.ones(N_PARAMS)
_SERVICE_MASK[[BASE, QUEUE]] = 0.0


@dataclass(frozen=True)
class CostSettings:
    """Knobs of the model (``cost:`` in the router config; defaults are the documented ones)."""

    tie_tolerance: float = 0.05  # relative: predictions this close to the best are equal
    tie_tolerance_s: float = 0.002  # ... or this close in seconds
    forgetting: float = 0.995  # RLS forgetting factor: ~200 requests of memory per replica
    gauge_stale_s: float = 2.0  # a replica's load gauges older than this are ignored
    max_gauge: float = 10_000.0  # requests; a gauge above is cut to this

    @classmethod
    def of(cls, config: Any) -> CostSettings:
        """From a config section with these field names (``RouterConfig.cost``), or defaults."""
        if config is None:
            return cls()
        return cls(**{f: getattr(config, f) for f in cls.__dataclass_fields__ if hasattr(config, f)})


class Prediction:
    """Per candidate: predicted TTFT and its parts, and the features the fit learns from.

    The features are kept as their ingredients (a candidate that holds nothing of the prompt
    has four non-zero ones) and built for the candidate a request is sent to
    (:meth:`feature_row`), or for every candidate on demand (:attr:`features`).
    """

    __slots__ = (
        "_computed",
        "_cut",
        "_decoding",
        "_extra",
        "_held",
        "_holders",
        "_queued",
        "computing",
        "loading",
        "names",
        "rows",
        "ttft",
        "waiting",
    )

    def __init__(
        self,
        names: tuple[str, ...],
        rows: np.ndarray,
        ttft: np.ndarray,
        parts: tuple[np.ndarray, np.ndarray, np.ndarray],
        inputs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        holdings: tuple[np.ndarray, np.ndarray, np.ndarray],
    ) -> None:
        self.names = names
        self.rows = rows
        self.ttft = ttft
        self.waiting, self.loading, self.computing = parts
        # per candidate; _extra: requests the gauges show waiting beyond this router's own
        self._computed, self._queued, self._decoding, self._extra = inputs
        # the candidates holding some of the prompt (positions), their thousands of tokens
        # per medium, and the last medium each loads from
        self._holders, self._held, self._cut = holdings

    def feature_row(self, i: int) -> np.ndarray:
        """Candidate ``i``'s features (a fresh array of N_PARAMS)."""
        x = np.zeros(N_PARAMS)
        x[BASE] = 1.0
        x[COMPUTE] = self._computed[i]
        x[QUEUE] = self._queued[i]
        x[DECODE] = self._computed[i] * self._decoding[i]
        at = np.flatnonzero(self._holders == i)
        if at.size:
            k = at[0]
            used = self._cut[k] >= _MEDIA_AT
            x[LOAD_COLUMNS] = self._held[k] * used
            x[LAT_COLUMNS] = (self._held[k] > 0) & used
        return x

    @property
    def features(self) -> np.ndarray:
        """Every candidate's features, ``(len(names), N_PARAMS)``."""
        x = np.zeros((len(self.names), N_PARAMS))
        x[:, BASE] = 1.0
        x[:, COMPUTE] = self._computed
        x[:, QUEUE] = self._queued
        x[:, DECODE] = self._computed * self._decoding
        used = _MEDIA_AT[None, :] <= self._cut[:, None]
        x[self._holders, LOAD_COLUMNS] = self._held * used
        x[self._holders, LAT_COLUMNS] = (self._held > 0) & used
        return x


class CostModel:
    """Every replica's fit plus this router's ledger of what it sent where (see module doc)."""

    def __init__(
        self,
        settings: CostSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        live_gauges: bool = False,
    ) -> None:
        self.settings = settings or CostSettings()
        self.clock = clock
        # The simulator's table holds the truth at every instant; a router's scrapes age.
        self.live_gauges = live_gauges
        self.fits: dict[str, ReplicaFit] = {}
        # Every replica's observations also teach one pooled fit: a replica with little
        # evidence of its own is predicted mostly by the fleet's (fit.POOL_EVIDENCE).
        self.pooled = ReplicaFit("fleet", None, self.settings.forgetting)
        self._row: dict[str, int] = {}
        self._theta = np.zeros((0, N_PARAMS))
        self._unmeasured = np.zeros((0, len(MEDIA)), dtype=bool)
        # per coefficient, the weight of the replica's own fit (ReplicaFit.blend)
        self._blend = np.zeros((0, N_PARAMS))
        self._rest = np.zeros((0, N_PARAMS))  # 1 - _blend: the pooled fit's weight
        # ReplicaFit.blend_terms of every row, and the pooled fit's weight: _blend is
        # recomputed for every row at once when the pooled fit's evidence grows
        self._counted = np.zeros((0, N_PARAMS))
        self._evidence = np.zeros((0, N_PARAMS))
        self._pinned = np.zeros((0, N_PARAMS), dtype=bool)
        self._pool = pool_weight(self.pooled)
        # effective() of every row, recomputed in place when a fit or the pooled fit changed
        # (each observation changes the pooled one): in place, because fresh arrays of every
        # row per request cost more in page faults than in arithmetic (the simulator's heap grows).
        self._eff = np.zeros((0, N_PARAMS))
        self._eff_tmp = np.zeros((0, N_PARAMS))
        self._eff_stale = True
        # the ledger, one row per replica
        # The work queued is kept as features, not seconds: the sum of the service features
        # (x * _SERVICE_MASK) of the requests sent and not yet answered, priced with the
        # replica's coefficients at each prediction. Seconds fixed when a request was sent
        # would keep the price of a fit that has since learned (a cold fit's 10x too slow
        # prefill rate stayed in Q until those requests were answered, and the queue
        # coefficient learned to discount it: 4x over-predictions under a burst).
        self._pending_x = np.zeros((0, N_PARAMS))
        self._pending = np.zeros(0)  # requests sent, no first byte yet
        self._in_flight = np.zeros(0)  # requests sent, not finished
        self._mean_x = np.zeros((0, N_PARAMS))  # EWMA of a request's service features
        self._gauges_at = np.zeros(0)  # when the load gauges were scraped (NaN: never)
        # (names, their rows, the same as a slice when they are the first rows in order: a
        # candidate's figures are then views of the model's arrays, not gathered copies)
        self._rows_cache: tuple[tuple[str, ...], np.ndarray, slice | np.ndarray] | None = None
        self.prompt_ktok = 1.0  # EWMA of prompt length (thousands): the reference request
        self.on_observation: Callable[[str, float, float], None] | None = None

    # -- replicas --------------------------------------------------------------------------------
    def fit(self, name: str) -> ReplicaFit:
        got = self.fits.get(name)
        if got is None:
            got = self.fits[name] = ReplicaFit(name, self._fleet_compute(), self.settings.forgetting)
            self._row[name] = len(self._theta)
            self._theta = np.vstack([self._theta, got.rls.theta])
            self._unmeasured = np.vstack([self._unmeasured, got.unmeasured])
            for attr in ("_blend", "_rest", "_counted", "_evidence", "_pinned"):
                arr = getattr(self, attr)
                setattr(self, attr, np.vstack([arr, np.zeros(N_PARAMS, dtype=arr.dtype)]))
            self._eff_stale = True
            for attr in ("_pending", "_in_flight"):
                setattr(self, attr, np.append(getattr(self, attr), 0.0))
            for attr in ("_pending_x", "_mean_x"):
                setattr(self, attr, np.vstack([getattr(self, attr), np.zeros(N_PARAMS)]))
            self._gauges_at = np.append(self._gauges_at, np.nan)
            self._rows_cache = None
            self._sync(name)
        return got

    def _fleet_compute(self) -> float | None:
        """A new replica starts from the fleet's median prefill rate (same model, same kind
        of hardware, usually) instead of the cold default."""
        known = [float(f.rls.theta[COMPUTE]) for f in self.fits.values() if f.observations >= 20]
        return float(np.median(known)) if known else None

    def set_param(self, name: str, i: int, value: float, var: float = 1e-12) -> None:
        """Set parameter ``i`` of ``name``'s fit (kvmesh.routing.fit's indices): for tests
        and what-ifs; the fit moves on from there as requests are observed."""
        fit = self.fit(name)
        fit.rls.set_prior(i, value, var)
        fit.pinned.add(i)  # taken as known: the fleet's pooled fit does not dilute it
        if i >= load_i(0):  # a medium's figure: it counts as measured from now on
            fit.unmeasured[(i - load_i(0)) // 2] = False
        self._sync(name)

    def _sync(self, name: str) -> None:
        row, fit = self._row[name], self.fits[name]
        self._theta[row] = fit.rls.theta
        self._unmeasured[row] = fit.unmeasured
        terms = fit.blend_terms(self.pooled)
        self._counted[row], self._evidence[row], self._pinned[row] = terms
        self._blend[row] = blend_weights(*terms, self._pool)
        self._rest[row] = 1.0 - self._blend[row]
        self._eff_stale = True

    def _reblend(self, x: np.ndarray) -> None:
        """The pooled fit learned from ``x``: where that grew its evidence within its first
        POOL_EVIDENCE observations of a coefficient, its weight in every row's blend, at once."""
        fleet = self.pooled
        if fleet.observations > POOL_EVIDENCE and (fleet.uses[x[LOAD_COLUMNS] > 0] > POOL_EVIDENCE).all():
            return  # the common case, past the start: nothing to recompute
        pool = pool_weight(fleet)
        if (pool != self._pool).any():
            self._pool = pool
            self._blend = blend_weights(self._counted, self._evidence, self._pinned, pool)
            self._rest = 1.0 - self._blend
            self._eff_stale = True

    def report(self, name: str, report: Report) -> None:
        """A replica's own measured figures (bounded by :mod:`kvmesh.routing.reports`)."""
        fit = self.fit(name)
        fit.apply_report(report)
        self._sync(name)

    def gauges_scraped(self, name: str, at: float | None = None) -> None:
        """The pool scraped ``name``'s vLLM gauges now (they are fresh until gauge_stale_s)."""
        self.fit(name)
        self._gauges_at[self._row[name]] = self.clock() if at is None else at

    def rows(self, names: tuple[str, ...]) -> np.ndarray:
        return self._rows(names)[0]

    def _rows(self, names: tuple[str, ...]) -> tuple[np.ndarray, slice | np.ndarray]:
        """The rows of ``names``, and what selects them (a slice where it can)."""
        cached = self._rows_cache
        if cached is not None and (cached[0] is names or cached[0] == names):
            return cached[1], cached[2]
        for n in names:
            self.fit(n)
        rows = np.array([self._row[n] for n in names], dtype=np.int64)
        ix: slice | np.ndarray = slice(0, len(rows)) if np.array_equal(rows, np.arange(len(rows))) else rows
        self._rows_cache = (names, rows, ix)
        return rows, ix

    # -- prediction ------------------------------------------------------------------------------
    def _load_state(
        self, table: ReplicaTable, rows: np.ndarray, ix: slice | np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(queued seconds ahead, requests decoding, requests waiting beyond this router's
        own) per candidate (``ix``: what selects ``rows``, see :meth:`_rows`)."""
        s = self.settings
        if ix is None:
            ix = rows
        pending = self._pending[ix]
        queued = np.zeros(len(rows))
        busy = pending.nonzero()[0]  # a few rows: most replicas have nothing pending here
        if busy.size:
            queued[busy] = self._priced(self._pending_x, rows[busy])
        decoding = np.maximum(self._in_flight[ix] - pending, 0.0)
        # fmax/fmin: NaN → 0, ±inf → the bounds (nan_to_num then clip, in two calls)
        waiting = np.fmin(np.fmax(table.waiting, 0.0), s.max_gauge)
        running = np.fmin(np.fmax(table.running, 0.0), s.max_gauge)
        # Gauges count this router's own requests too: only what is beyond them is extra.
        extra = np.maximum(waiting - pending, 0.0)
        beyond = np.maximum(running - pending, 0.0)
        if not self.live_gauges:  # stale gauges count nothing
            age = self.clock() - self._gauges_at[ix]
            stale = ~(np.isfinite(age) & (age <= s.gauge_stale_s))
            extra[stale] = 0.0
            beyond[stale] = 0.0
        more = extra.nonzero()[0]
        if more.size:
            queued[more] += extra[more] * self._priced(self._mean_x, rows[more])
        np.maximum(decoding, beyond, out=decoding)
        return queued, decoding, extra

    def _priced(self, work: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Seconds of ``work`` (service features per row: _pending_x or _mean_x) at each row's
        current coefficients."""
        # take, not fancy indexing: 2x faster on these few rows of 14
        out: np.ndarray = np.einsum("ij,ij->i", self._effective_all().take(rows, 0), work.take(rows, 0))
        np.maximum(out, 0.0, out=out)
        return out

    def predict(self, request: RoutingRequest, table: ReplicaTable) -> Prediction:
        names = table.names
        rows, ix = self._rows(names)
        n = len(names)
        total = request.num_tokens / 1e3
        tokens = medium_tokens(request, table) if request.num_tokens else None
        holders = _NO_ROWS
        if tokens is not None:  # the index's counts; bounded below (never more than the prompt)
            # A row holds something when one of MEDIA's columns is above 0 (NaN is not),
            # tested column by column: 3x faster than a reduce along rows of 5.
            held_any = tokens[:, 0] > 0
            for j in range(1, len(MEDIA)):
                held_any |= tokens[:, j] > 0
            holders = held_any.nonzero()[0]
        queued, decoding, extra = self._load_state(table, rows, ix)
        # Every candidate loads what its GPU cache holds of the prompt (nothing, for most of
        # 1,000) and computes the rest: four coefficients and the GPU's load, one value per
        # candidate per array. Only the candidates holding part of the prompt in another
        # medium choose among media (_predict_media), and replace their values. Arrays of
        # every candidate's 14 features, fresh per request, grew the simulator's heap (its
        # long-lived entries pin the freed ones), and page faults, not arithmetic, were most
        # of a decision's time.
        eff = self._effective_all()
        base, compute, queue, decode = (eff[ix, j] for j in (BASE, COMPUTE, QUEUE, DECODE))
        held = np.zeros((0, len(MEDIA)))
        cut = _NO_ROWS
        gpu: np.ndarray | None = None  # thousands of tokens in the GPU cache (None: none anywhere)
        if tokens is not None and len(holders):
            held = tokens.take(holders, axis=0)[:, _COLUMNS]
            held /= 1e3
            np.fmin(np.fmax(held, 0.0, out=held), total, out=held)  # NaN → 0
            gpu = np.zeros(n)
            gpu[holders] = held[:, 0]
            cut = np.zeros(len(holders), dtype=np.intp)
        computed = np.full(n, total) if gpu is None else np.maximum(total - gpu, 0.0)
        c_part = compute * computed
        waiting = queue * queued + decode * (computed * decoding)
        # Summed in the order numpy sums a row of the 14 parts (pairwise, eight at a time,
        # then the rest in turn), so a prediction does not depend on how it was computed: the
        # media not loaded add exact zeros.
        ttft = (base + c_part) + waiting
        if gpu is None:
            loading = np.zeros(n)
        else:
            loading = eff[ix, load_i(0)] * gpu + eff[ix, lat_i(0)] * (gpu > 0)
            ttft += loading
            deep = (np.maximum.reduce(held[:, 1:], axis=1) > 0).nonzero()[0]  # positions among the holders
            if len(deep):
                d = holders[deep]
                coefficients = (base[d], compute[d], queue[d], decode[d])
                h = self._predict_media(rows[d], coefficients, held[deep], total, queued[d], decoding[d])
                ttft[d], waiting[d], loading[d], c_part[d], computed[d], cut[deep] = h
        computing = c_part
        ttft = _bounded(ttft)
        self.prompt_ktok += 0.02 * (total - self.prompt_ktok)
        return Prediction(
            names,
            rows,
            ttft,
            (waiting, loading, computing),
            (computed, queued, decoding, extra),
            (holders, held, cut),
        )

    def _predict_media(
        self,
        rows: np.ndarray,
        coefficients: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        held: np.ndarray,
        total: float,
        queued: np.ndarray,
        decoding: np.ndarray,
    ) -> tuple[np.ndarray, ...]:
        """The whole prediction for candidates holding part of the prompt beyond their GPU
        cache (``coefficients``: their BASE, COMPUTE, QUEUE and DECODE; ``held``: thousands of
        tokens per medium, MEDIA's order): ttft, waiting, loading and computing (unbounded),
        the tokens computed and the last medium loaded from (``cut``): the cheapest cut of
        the media, and the 14 parts summed in a fixed order."""
        eff = self._effective_all()
        n = len(rows)
        base, compute, queue, decode = coefficients
        per_ktok = compute + decode * decoding
        has = held > 0
        rate, latency = eff[rows, LOAD_COLUMNS], eff[rows, LAT_COLUMNS]  # per medium
        load_cost = rate * held + latency * has
        cum_tok = np.cumsum(held, axis=1)
        # Load media 0..k (the GPU cache always), compute the rest: the cheapest k.
        options = np.cumsum(load_cost, axis=1) + per_ktok[:, None] * np.maximum(total - cum_tok, 0.0)
        cut = np.argmin(options, axis=1)
        used = _MEDIA_AT[None, :] <= cut[:, None]
        computed = np.maximum(total - cum_tok[np.arange(n), cut], 0.0)
        c_part = compute * computed
        q_part = queue * queued
        d_part = decode * (computed * decoding)
        load_parts = rate * (held * used)
        lat_parts = latency * (has & used)
        # A row of the 14 parts summed as numpy sums it (see predict): pairwise over the first
        # eight (BASE, COMPUTE, QUEUE, DECODE and the first two media's load and latency),
        # then the other six in turn.
        ttft = ((base + c_part) + (q_part + d_part)) + (
            (load_parts[:, 0] + lat_parts[:, 0]) + (load_parts[:, 1] + lat_parts[:, 1])
        )
        for j in range(2, len(MEDIA)):
            ttft += load_parts[:, j]
            ttft += lat_parts[:, j]
        loading = load_parts.sum(axis=1) + lat_parts.sum(axis=1)
        return ttft, q_part + d_part, loading, c_part, computed, cut

    def effective(self, rows: np.ndarray) -> np.ndarray:
        """The coefficients predictions use, per row: each replica's own blended with the
        pooled fleet fit by evidence (fit.POOL_EVIDENCE); a medium neither has measured
        loads at UNMEASURED_FRACTION of the prefill cost."""
        if not self._eff_stale or len(rows) > 1:
            out: np.ndarray = self._effective_all()[rows]
            return out
        # one row (an observation's starting point): computed alone, as _effective_all would
        theta: np.ndarray = self._blend[rows] * self._theta[rows] + self._rest[rows] * self.pooled.rls.theta
        _unmeasured_loads(theta, self._unmeasured[rows] & self.pooled.unmeasured)
        return theta

    def _effective_all(self) -> np.ndarray:
        if self._eff_stale:
            if self._eff.shape != self._theta.shape:
                self._eff = np.empty_like(self._theta)
                self._eff_tmp = np.empty_like(self._theta)
            eff = self._eff
            np.multiply(self._blend, self._theta, out=eff)
            np.multiply(self._rest, self.pooled.rls.theta, out=self._eff_tmp)
            eff += self._eff_tmp
            _unmeasured_loads(eff, self._unmeasured & self.pooled.unmeasured)
            self._eff_stale = False
        return self._eff

    def reference(self, table: ReplicaTable) -> np.ndarray:
        """Predicted TTFT per candidate of a typical new request (the recent mean prompt
        length, nothing cached) sent now: the autoscaling signal."""
        rows = self.rows(table.names)
        theta = self.effective(rows)
        queued, decoding, _ = self._load_state(table, rows)
        per_ktok = theta[:, COMPUTE] + theta[:, DECODE] * decoding
        return _bounded(theta[:, BASE] + theta[:, QUEUE] * queued + per_ktok * self.prompt_ktok)

    # -- the ledger --------------------------------------------------------------------------------
    def sent(self, prediction: Prediction, i: int) -> Ticket:
        """The request was sent to candidate ``i`` of ``prediction``: count it there."""
        row = int(prediction.rows[i])
        x = prediction.feature_row(i)
        work = x * _SERVICE_MASK
        # The work queued ahead of it, as features: its Q is priced again when it is learned
        # from (Ticket.first_byte), at the coefficients known then.
        ahead = self._pending_x[row].copy()
        extra = float(prediction._extra[i])
        if extra:
            ahead += extra * self._mean_x[row]
        self._pending_x[row] += work
        self._pending[row] += 1
        self._in_flight[row] += 1
        mean = self._mean_x[row]
        if np.count_nonzero(mean):
            mean += 0.1 * (work - mean)
        else:
            mean[:] = work
        return Ticket(self, prediction.names[i], row, x, float(prediction.ttft[i]), work, ahead)

    def _observe_all(
        self, name: str, row: int, x: np.ndarray, ahead: np.ndarray, predicted: float, observed: float
    ) -> None:
        start = self.effective(np.array([row]))[0]
        # The fits learn the queue coefficient against the work that was ahead priced at what
        # is known now: Q priced when the request was sent carries the fit of that moment (a
        # cold fit's 10x too slow prefill), and the coefficient would learn to discount that
        # fit's error instead of how the queue delays a prefill.
        x = x.copy()
        x[QUEUE] = max(float(start @ ahead), 0.0)
        pooled = self.pooled.rls.predict(x)
        self.pooled.observe(x, pooled, observed, pooled=pooled)  # the fleet's own residuals
        self._reblend(x)
        self._eff_stale = True
        self.fits[name].observe(x, predicted, observed, start, pooled)
        self._sync(name)
        if self.on_observation is not None:
            self.on_observation(name, predicted, observed)

    def _dequeue(self, row: int, work: np.ndarray) -> None:
        queued = self._pending_x[row]
        queued -= work
        np.maximum(queued, 0.0, out=queued)
        self._pending[row] = max(0.0, self._pending[row] - 1)
        if self._pending[row] == 0:
            queued[:] = 0.0  # no float residue once nothing is pending

    def describe(self) -> dict[str, Any]:
        out = {}
        for name, fit in self.fits.items():
            row = self._row[name]
            at = np.array([row])
            d = fit.describe()
            d["distinct_from_fleet"] = round(fit.distinct(self.pooled), 3)
            d["ledger"] = {
                "queued_s": round(float(self._priced(self._pending_x, at)[0]), 4),
                "pending": int(self._pending[row]),
                "in_flight": int(self._in_flight[row]),
                "mean_service_s": round(float(self._priced(self._mean_x, at)[0]), 4),
            }
            out[name] = d
        return out


class Ticket:
    """One request's life on its replica, as the cost model sees it: sent, first byte, finished."""

    __slots__ = ("_first", "_model", "_open", "ahead", "name", "predicted", "row", "sent_at", "work", "x")

    def __init__(
        self,
        model: CostModel,
        name: str,
        row: int,
        x: np.ndarray,
        predicted: float,
        work: np.ndarray,
        ahead: np.ndarray,
    ):
        self._model = model
        self.name = name
        self.row = row
        self.x = x
        self.predicted = predicted
        self.work = work  # its service features, in the replica's ledger until its first byte
        self.ahead = ahead  # the service features queued ahead of it when it was sent
        self.sent_at = model.clock()
        self._first = False
        self._open = True

    def first_byte(self, now: float | None = None) -> float | None:
        """Its first byte came back: its prefill is done; learn from it. The observed TTFT."""
        if self._first or not self._open:
            return None
        self._first = True
        m = self._model
        t = m.clock() if now is None else now
        m._dequeue(self.row, self.work)
        observed = t - self.sent_at
        m._observe_all(self.name, self.row, self.x, self.ahead, self.predicted, observed)
        return observed

    def finished(self) -> None:
        """It ended (answered, failed or abandoned); without a first byte nothing is learned."""
        if not self._open:
            return
        self._open = False
        m = self._model
        if not self._first:
            m._dequeue(self.row, self.work)
        m._in_flight[self.row] = max(0.0, m._in_flight[self.row] - 1)


def _unmeasured_loads(theta: np.ndarray, blind: np.ndarray) -> None:
    """In place: a medium neither the replica nor the fleet has measured (``blind``) loads at
    UNMEASURED_FRACTION of the replica's prefill cost."""
    np.copyto(theta[:, LOAD_COLUMNS], UNMEASURED_FRACTION * theta[:, COMPUTE, None], where=blind)


def _bounded(values: np.ndarray) -> np.ndarray:
    """``values`` within [MIN_PREDICTION_S, MAX_PREDICTION_S], NaN as the maximum."""
    # np.clip's values (±inf to the bounds, NaN stays NaN) without its wrapper's cost
    out: np.ndarray = np.minimum(np.maximum(values, MIN_PREDICTION_S), MAX_PREDICTION_S)
    np.copyto(out, MAX_PREDICTION_S, where=np.isnan(out))
    return out


class CostDecision(Decision):
    """A :class:`Decision` that carries the prediction (to count the request where it goes)."""

    __slots__ = ("prediction",)
    prediction: Prediction


class CostPicker(Picker):
    """Lowest predicted TTFT first; near-ties by rendezvous hash (see the module docstring)."""

    def __init__(self, source: PrefixSource, model: CostModel) -> None:
        self.policy = "cost"
        self.prefix = PrefixScorer(source)  # asks the index once per request (request.matches)
        self.scorers = [(self.prefix, 0.0)]
        self.overload = None
        self.model = model

    def pick(self, request: RoutingRequest, replicas: Sequence[ReplicaState] | ReplicaTable) -> Decision:
        table = as_table(replicas)
        if not len(table):
            raise ValueError("no candidate replicas")
        self.prefix.score_array(request, table)  # fills request.matches
        pred = self.model.predict(request, table)
        ttft = pred.ttft
        best = float(ttft.min())
        s = self.model.settings
        near = ttft <= best + max(s.tie_tolerance * best, s.tie_tolerance_s)
        totals = np.where(near, -best, -ttft)
        parts = {
            "ttft_s": ttft,
            "waiting_s": pred.waiting,
            "loading_s": pred.loading,
            "computing_s": pred.computing,
        }
        d = CostDecision(self.policy, table, totals, parts, np.zeros(len(table), bool), request.key)
        d.prediction = pred
        return d

    def sent(self, decision: Decision, name: str) -> Ticket | None:
        """Count a request of ``decision`` sent to ``name`` (None: not a cost decision)."""
        pred = getattr(decision, "prediction", None)
        if not isinstance(pred, Prediction):
            return None
        try:
            i = pred.names.index(name)
        except ValueError:
            return None
        return self.model.sent(pred, i)


def build_cost_picker(
    source: PrefixSource | None, config: Any = None, clock: Callable[[], float] | None = None
) -> CostPicker:
    """``policy: cost`` (``config``: a ``RouterConfig``; its ``cost`` section, if any)."""
    if source is None:
        raise ValueError("policy 'cost' needs a prefix source (the block index)")
    settings = CostSettings.of(getattr(config, "cost", None))
    return CostPicker(source, CostModel(settings, clock or time.monotonic))


def median_error(model: CostModel) -> float | None:
    """Median |predicted - observed| / observed over every replica's recent requests."""
    errs = [e for f in model.fits.values() for e in f.errors]
    return float(np.median(errs)) if errs else None
