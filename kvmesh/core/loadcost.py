"""The engine's side of "never load what can be computed sooner": measured load and compute costs.

Every load from a lower tier is timed (:class:`TierMeter`: seconds = latency + bytes /
bandwidth, fitted online per tier by :class:`~kvmesh.core.rls.RobustRLS`), and the engine's
prefill rate is learned from vLLM's own steps (:class:`ComputeMeter`: a step's forward time
against the tokens it scheduled; the connector times the steps) or configured
(``prefill_tokens_per_s``). :meth:`LoadCosts.cut` then takes the leading chunks a lookup
found, tier by tier, and returns how many of them are worth loading: the prefix whose
predicted load time, plus the compute of everything after it, is least. A chunk in a tier
slower than recomputing is therefore reported as not loadable and vLLM computes it.

Until both sides are measured the rule does not apply (everything found is loaded, as
before): a tier never tried has no figure, and a replica must not refuse its cache on a
guess. A tier judged too slow is still tried, one chunk of it, once every ``probe_s`` so
that a tier that recovers is seen to recover (otherwise the last slow figure would stand for
ever) while a probe costs one chunk's load.

The figures are exported through :meth:`LoadCosts.figures` (the admin API's ``stats``, the
connector's Prometheus metrics), for the router's cost model to start from.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvmesh.core.rls import RobustRLS

_MB = 1e6
_MIN_LOADS = 3  # timed loads of a tier before its figure is used
PRIOR_BPS = 1e9  # bandwidth assumed of a tier's first load (TierMeter.observe)
_MIN_STEPS = 4  # timed steps (of _MIN_TOKENS or more) before a learned prefill rate is used
_MIN_TOKENS = 64  # shorter steps (decodes, short tails) are mostly fixed cost: not counted
_WINDOW = 64  # recent steps the prefill rate is the median of


class TierMeter:
    """One tier's load time: ``latency_s + bytes * s_per_byte``, fitted per load.

    Observations are whole loads (all the chunks one request read from the tier), so loads
    of different sizes separate the per-load latency from the bandwidth.
    """

    def __init__(self) -> None:
        # θ = (latency s, s per MB); bounds: 0-10 s, 1 TB/s down to 100 KB/s.
        # Wide priors (±0.1 s, ±0.1 s/MB): a tier 50 ms away must not take dozens of loads to show.
        self._fit = RobustRLS([1e-3, 1e-3], [1e-2, 1e-2], [0.0, 1e-6], [10.0, 10.0], forgetting=0.98)
        self.loads = 0
        self.bytes = 0
        self.seconds = 0.0
        self.last_at: float | None = None

    def observe(self, nbytes: int, seconds: float, now: float) -> None:
        if nbytes <= 0 or not np.isfinite(seconds) or seconds < 0:
            return
        if not self.loads:
            # Start from the first load: tiers differ by 1000x, and no prior suits both a
            # local DRAM copy and a store 50 ms away. Its transfer is taken at PRIOR_BPS at
            # most and the rest as latency: loads of one size cannot tell the two apart, and
            # splitting them in half made a far Redis's 0.74 MB loads (0.2 s, all round trip)
            # predict a 12 MB load at 1.7 s, where it took 0.27 s, so the tier was skipped.
            # Optimistic on purpose: a load tried and found slow is measured and cut after;
            # a tier judged slow is only probed.
            mb = nbytes / _MB
            transfer = min(seconds, nbytes / PRIOR_BPS)
            self._fit.set_prior(0, seconds - transfer, max(seconds, 1e-4) ** 2)
            self._fit.set_prior(1, transfer / mb, (seconds / mb) ** 2)
        self._fit.update(np.array([1.0, nbytes / _MB]), seconds)
        self.loads += 1
        self.bytes += nbytes
        self.seconds += seconds
        self.last_at = now

    @property
    def measured(self) -> bool:
        return self.loads >= _MIN_LOADS

    def predict(self, nbytes: float) -> float:
        lat, s_mb = self._fit.theta
        return float(lat + s_mb * nbytes / _MB)

    def figures(self) -> dict[str, Any]:
        lat, s_mb = (float(v) for v in self._fit.theta)
        return {
            "load_bytes_per_s": round(_MB / s_mb, 1),
            "load_latency_s": round(lat, 6),
            "loads": self.loads,
            "load_bytes": self.bytes,
            "load_seconds": round(self.seconds, 6),
        }


class ComputeMeter:
    """The engine's prefill time per token: configured, or measured from vLLM's steps.

    The measure is the median, over the last ``_WINDOW`` steps of at least ``_MIN_TOKENS``
    tokens, of a step's seconds per scheduled token: the per-token cost *including* the
    step's fixed overhead, so it overstates the marginal cost of a token, never understates
    it. That bias is chosen: it errs toward loading, and an estimate that errs the other way
    turns the cache off. A regression slope (``seconds = a + b * tokens``) was tried first
    and was not identifiable on real traffic: a benchmark's steps are all one prompt length
    plus its reload tail, the fixed part absorbed everything, the slope sat at its lower
    bound, and every CPU-tier hit was judged slower than recomputing it (a 1,000-token cached
    prompt then took 0.24 s instead of 0.05 s).
    """

    def __init__(self, tokens_per_s: float | None = None) -> None:
        self.configured = tokens_per_s
        self._per_token: deque[float] = deque(maxlen=_WINDOW)
        self._median: float | None = None  # of _per_token, until the next step is observed
        self.steps = 0

    def observe(self, tokens: int, requests: int, seconds: float) -> None:
        if tokens < _MIN_TOKENS or not np.isfinite(seconds) or seconds <= 0:
            return
        self._per_token.append(float(seconds) / tokens)
        self._median = None
        self.steps += 1

    def seconds_per_token(self) -> float | None:
        if self.configured:
            return 1.0 / self.configured
        if self.steps < _MIN_STEPS:
            return None
        # Every lookup asks, on the scheduler's path: numpy's median took 0.5 ms a call in
        # vLLM's worker (its partition, on a window of 64), and its first call imports
        # numpy.ma (~19 ms, in some request's lookup). Sorting 64 floats takes microseconds.
        median = self._median
        if median is None:
            median = self._median = statistics.median(self._per_token)
        return median

    def figures(self) -> dict[str, Any]:
        spt = self.seconds_per_token()
        return {
            "prefill_tokens_per_s": round(1.0 / spt, 1) if spt else None,
            "prefill_source": "configured" if self.configured else ("steps" if spt else None),
            "steps": self.steps,
        }


class LoadCosts:
    """The meters of one engine and the rule that uses them. Thread-safe."""

    def __init__(
        self,
        bytes_per_token: int,
        tokens_per_s: float | None = None,
        enabled: bool = True,
        probe_s: float = 30.0,
    ) -> None:
        self.bytes_per_token = bytes_per_token
        self.enabled = enabled
        self.probe_s = probe_s
        self.compute = ComputeMeter(tokens_per_s)
        self.tiers: dict[str, TierMeter] = {}
        self.cut_tokens = 0  # tokens found but reported as not worth loading
        self.cuts = 0
        self.unasked = 0  # lookups that did not ask a hopeless tier
        self._probed: dict[str, float] = {}
        self._probe_open: set[str] = set()  # hopeless tiers asked once again: probe one chunk
        self._lock = threading.Lock()
        # Set by the vLLM worker: lower-tier loads run beside the batch (async_loads on), and
        # how many requests the engine's last step ran. See :meth:`_compute_weight`.
        self.loads_beside_batch = False
        self.batch = 0

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            meter = self.tiers.get(tier)
            if meter is None:
                meter = self.tiers[tier] = TierMeter()
            meter.observe(nbytes, seconds, time.monotonic())

    def observe_step(self, tokens: int, requests: int, seconds: float) -> None:
        with self._lock:
            self.compute.observe(tokens, requests, seconds)

    def _compute_weight(self) -> int:
        """What computing a token costs the engine, in units of the loading request's own
        wait. A load that runs beside the batch (vLLM's asynchronous path) makes only its
        request wait; computing the same tokens instead runs in the batch's steps and every
        running request's next token waits for it too. So with ``R`` requests running, a
        token recomputed costs ``1 + R`` times its compute, and a lower tier is skipped only
        when loading is slower than that. Measured (``kvmesh bench stall``, a Redis 200 ms
        away, 4 decodes): unweighted, the rule recomputed 2,000 tokens in a 370-600 ms step
        that every decode waited for, where the load beside them cost its own request
        ~0.65 s and the decodes ~30 ms. With synchronous loads, or nothing running, the
        weight is 1 (the rule as before)."""
        return 1 + max(0, self.batch) if self.loads_beside_batch else 1

    def _copy(self) -> TierMeter | None:
        """The "cpu" meter: what copying a loaded chunk into vLLM's pages costs (the worker
        times it), for chunks of every tier; None until measured."""
        meter = self.tiers.get("cpu")
        return meter if meter is not None and meter.measured else None

    def hopeless(self, tiers: Sequence[str], chunk_tokens: int) -> frozenset[str]:
        """The tiers not worth asking at all: measured, and each further chunk from them
        costs at least computing it, so no prefix however long is loaded sooner than
        computed. A lookup skips their ``contains`` (a round trip to a slow shared tier,
        on every request's path). Once every ``probe_s`` such a tier is asked again, and
        a hit then loads one chunk of it (a probe), so that a recovery is seen."""
        if not self.enabled:
            return frozenset()
        out = set()
        with self._lock:
            spt = self.compute.seconds_per_token()
            if spt is None:
                return frozenset()
            spt *= self._compute_weight()
            now = time.monotonic()
            nbytes = chunk_tokens * self.bytes_per_token
            copy = self._copy()
            extra = copy.predict(nbytes) - copy.predict(0.0) if copy is not None else 0.0
            for tier in tiers:
                meter = self.tiers.get(tier)
                if meter is None or not meter.measured:
                    continue
                if meter.predict(nbytes) - meter.predict(0.0) + extra < chunk_tokens * spt:
                    continue  # a long enough prefix from it beats computing
                last = max(meter.last_at or 0.0, self._probed.get(tier, 0.0))
                if now - last >= self.probe_s:
                    self._probed[tier] = now
                    self._probe_open.add(tier)
                    continue
                out.add(tier)
            self.unasked += bool(out)
        return frozenset(out)

    def cut(self, where: Sequence[str], bounds: Sequence[tuple[int, int]]) -> int:
        """How many of the leading chunks found (``where[i]``: the tier of chunk ``i``,
        ``bounds[i]`` its tokens) to load; the rest is computed. See the module docstring."""
        if not self.enabled or not where:
            return len(where)
        if all(tier == "cpu" for tier in where):
            # A DRAM copy is never what makes loading slower than computing: a mis-measured
            # prefill rate must not be able to switch the cpu tier off.
            return len(where)
        with self._lock:
            spt = self.compute.seconds_per_token()
            if spt is None:
                return len(where)
            spt *= self._compute_weight()  # every chunk here is below cpu: loaded beside the batch
            now = time.monotonic()
            best_k, best = 0, 0.0  # cost relative to computing every chunk found
            load = 0.0
            seen: set[str] = set()
            copy = self._copy()
            for k, (tier, (s, e)) in enumerate(zip(where, bounds, strict=False)):
                # a tier not measured yet reads in no time here: loading is the default
                load += self._chunk_s(k, tier, (e - s) * self.bytes_per_token, seen, copy)[0]
                score = load - e * spt  # load the first k+1 chunks, compute the rest
                if score < best - 1e-12:
                    best_k, best = k + 1, score
            if best_k < len(where):
                tier = where[best_k]
                meter = self.tiers.get(tier)
                seen_at = meter.last_at if meter is not None and meter.last_at is not None else 0.0
                last = max(seen_at, self._probed.get(tier, 0.0))
                if tier in self._probe_open or now - last >= self.probe_s:
                    self._probe_open.discard(tier)
                    # Not loaded for probe_s: measure it again, it may have recovered; with
                    # one chunk of it, so that a probe of a slow tier costs one chunk's load.
                    self._probed[tier] = now
                    return best_k + 1
                self.cuts += 1
                self.cut_tokens += bounds[len(where) - 1][1] - (bounds[best_k - 1][1] if best_k else 0)
            return best_k

    def _chunk_s(
        self, k: int, tier: str, nbytes: int, seen: set[str], copy: TierMeter | None
    ) -> tuple[float, bool]:
        """What loading chunk ``k`` (``nbytes`` from ``tier``) adds to a load: its tier's read
        (a tier's latency once, its first chunk) and its copy into vLLM's pages (the copy's
        fixed cost once); and whether the read is known (cpu, or a measured tier: an
        unmeasured one counts as no time). Adds ``tier`` to ``seen``."""
        step, known = 0.0, True
        if tier != "cpu":
            meter = self.tiers.get(tier)
            known = meter is not None and meter.measured
            if meter is not None and known:
                step = meter.predict(nbytes) - (0.0 if tier not in seen else meter.predict(0.0))
        if copy is not None:  # every chunk loaded is also copied into vLLM's pages
            step += copy.predict(nbytes) - (copy.predict(0.0) if k else 0.0)
        seen.add(tier)
        return step, known

    def predict_s(self, where: Sequence[str], bounds: Sequence[tuple[int, int]]) -> float | None:
        """Seconds to load the chunks ``where`` (their tiers) over ``bounds`` (their tokens)
        into vLLM's pages, as :meth:`cut` weighs them; ``None`` while a tier below cpu
        among them has no figure yet."""
        with self._lock:
            copy = self._copy()
            seen: set[str] = set()
            total = 0.0
            for k, (tier, (s, e)) in enumerate(zip(where, bounds, strict=False)):
                step, known = self._chunk_s(k, tier, (e - s) * self.bytes_per_token, seen, copy)
                if not known:
                    return None
                total += step
            return total

    def figures(self) -> dict[str, Any]:
        """What this engine measured, for the router's cost model (JSON-ready)."""
        with self._lock:
            return {
                "bytes_per_token": self.bytes_per_token,
                **self.compute.figures(),
                "tiers": {name: m.figures() for name, m in self.tiers.items() if m.loads},
                "skipped_loads": self.cuts,
                "skipped_load_tokens": self.cut_tokens,
                "lookups_without_slow_tiers": self.unasked,
            }
