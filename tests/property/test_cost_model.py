"""Properties of the cost model and its fit (kvmesh.routing.cost, kvmesh.routing.fit, kvmesh.core.rls).

* whatever the inputs (gauges, matches, reports, fitted state, ledger), a prediction is
  finite, positive and bounded;
* the fit converges on data drawn from a known model, outliers included;
* adversarial observations keep the fit inside its box, with a finite covariance;
* a replica's report, whatever its JSON, is parsed without raising and leaves predictions bounded.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.rls import RobustRLS
from kvmesh.routing.cost import MAX_PREDICTION_S, MIN_PREDICTION_S, CostModel, CostSettings
from kvmesh.routing.fit import (
    BASE,
    COMPUTE,
    DECODE,
    LOWER,
    MEDIA,
    N_PARAMS,
    QUEUE,
    UPPER,
    ReplicaFit,
    lat_i,
    load_i,
)
from kvmesh.routing.reports import report_from_figures, report_from_metrics
from kvmesh.routing.scorers import ReplicaState, RoutingRequest
from kvmesh.routing.table import ReplicaTable

ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)
WILD = st.one_of(ANY_FLOAT, st.floats(-1e308, 1e308), st.sampled_from([0.0, -1.0, 1e12, float("nan")]))


class _Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def _request(n_tokens: int, table: ReplicaTable, held: np.ndarray) -> RoutingRequest:
    """A request whose per-medium matches are ``held`` (as the index's array would give)."""
    req = RoutingRequest(np.zeros(n_tokens, dtype=np.uint32), key=1)
    matches: Any = {"x": None}  # any truthy mapping: the aligned cache below is what is read
    req.matches = matches
    req.aligned = (table, matches, held)
    return req


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 6),
    tokens=st.integers(0, 200_000),
    data=st.data(),
)
def test_predictions_are_finite_positive_and_bounded(n: int, tokens: int, data: st.DataObject) -> None:
    clock = _Clock()
    model = CostModel(CostSettings(), clock)
    names = [f"r{i}" for i in range(n)]
    states = [
        ReplicaState(name, waiting=data.draw(WILD), running=data.draw(WILD), kv_usage=data.draw(WILD))
        for name in names
    ]
    for name in names:
        for i in range(N_PARAMS):  # any fitted state the box allows
            model.set_param(name, i, data.draw(st.floats(float(LOWER[i]), float(UPPER[i]))))
        if data.draw(st.booleans()):
            model.gauges_scraped(name, at=clock.t - data.draw(st.floats(0, 10)))
    table = ReplicaTable.of(states)
    held = np.array([[data.draw(WILD) for _ in range(5)] for _ in range(n)])
    tickets = []
    for _ in range(data.draw(st.integers(0, 6))):
        p = model.predict(_request(tokens, table, held), table)
        tickets.append(model.sent(p, data.draw(st.integers(0, n - 1))))
        clock.t += data.draw(st.floats(0, 100))
    for t in tickets:
        if data.draw(st.booleans()):
            t.first_byte()
        t.finished()
    p = model.predict(_request(tokens, table, held), table)
    for arr in (p.ttft, p.service, p.waiting, p.loading, p.computing, p.features):
        assert np.isfinite(arr).all()
    assert (p.ttft >= MIN_PREDICTION_S).all() and (p.ttft <= MAX_PREDICTION_S).all()
    assert (p.service >= 0).all() and (p.computing >= 0).all() and (p.loading >= 0).all()
    ref = model.reference(table)
    assert np.isfinite(ref).all() and (ref >= MIN_PREDICTION_S).all() and (ref <= MAX_PREDICTION_S).all()


def _features(rng: np.random.Generator) -> np.ndarray:
    """Features of a request as the model builds them: computed tokens, queue, decodes, loads."""
    x = np.zeros(N_PARAMS)
    x[BASE] = 1.0
    computed = rng.uniform(0.0, 4.0)
    decoding = float(rng.integers(0, 8))
    x[COMPUTE] = computed
    x[QUEUE] = rng.uniform(0.0, 3.0) if rng.random() < 0.5 else 0.0
    x[DECODE] = computed * decoding
    for j in range(len(MEDIA)):
        if rng.random() < 0.4:
            x[load_i(j)] = rng.uniform(0.05, 3.0)
            x[lat_i(j)] = 1.0
    return x


@settings(max_examples=25, deadline=None)
@given(
    compute=st.floats(0.05, 5.0),
    base=st.floats(0.001, 0.2),
    queue=st.floats(0.5, 1.5),
    decode=st.floats(0.0, 0.05),
    loads=st.lists(st.floats(0.0, 3.0), min_size=len(MEDIA), max_size=len(MEDIA)),
    lats=st.lists(st.floats(0.0, 0.05), min_size=len(MEDIA), max_size=len(MEDIA)),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_fit_converges_on_data_from_a_known_model(
    compute: float, base: float, queue: float, decode: float, loads: list[float], lats: list[float], seed: int
) -> None:
    truth = np.zeros(N_PARAMS)
    truth[[BASE, COMPUTE, QUEUE, DECODE]] = base, compute, queue, decode * compute
    for j in range(len(MEDIA)):
        truth[load_i(j)], truth[lat_i(j)] = loads[j], lats[j]
    rng = np.random.default_rng(seed)
    fit = ReplicaFit("r")
    for _ in range(800):
        x = _features(rng)
        y = float(truth @ x) * rng.lognormal(0.0, 0.05)
        if rng.random() < 0.03:  # outliers: a stall, a cached answer
            y *= float(rng.choice([0.05, 20.0]))
        fit.observe(x, fit.rls.predict(x), y)
    test = [_features(rng) for _ in range(300)]
    errors = [abs(fit.rls.predict(x) - truth @ x) / (truth @ x) for x in test]
    assert float(np.median(errors)) < 0.1
    # The prefill rate itself is identified where computing is a material part of a TTFT.
    share = np.mean([truth[COMPUTE] * x[COMPUTE] for x in test]) / np.mean([truth @ x for x in test])
    if share >= 0.2:
        assert abs(fit.rls.theta[COMPUTE] / compute - 1.0) < 0.2


FINITE = st.floats(-1e6, 1e6)


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.lists(st.one_of(ANY_FLOAT, FINITE), min_size=3, max_size=3), ANY_FLOAT), max_size=60
    ),
    nudges=st.lists(st.tuples(st.integers(0, 2), ANY_FLOAT, ANY_FLOAT), max_size=5),
)
def test_adversarial_observations_keep_the_fit_bounded(
    steps: list[tuple[list[float], float]], nudges: list[tuple[int, float, float]]
) -> None:
    lo, hi = np.array([0.0, 1e-4, 0.0]), np.array([10.0, 100.0, 3.0])
    rls = RobustRLS([0.01, 1.0, 1.0], [0.01, 1.0, 0.1], lo, hi)
    for i, value, var in nudges:
        rls.nudge(i, value, var, abs(var) if np.isfinite(var) else 0.0)
    for x, y in steps:
        rls.update(np.array(x), y)
    assert np.isfinite(rls.theta).all() and (rls.theta >= lo).all() and (rls.theta <= hi).all()
    assert np.isfinite(rls.p).all() and (np.diag(rls.p) >= 0).all()
    assert np.trace(rls.p) <= np.trace(rls.p0) * (1 + 1e-9)
    assert np.isfinite(rls.predict(np.array([1.0, 1.0, 1.0])))


KEYS = ["cpu", "disk", "remote", "x", "bytes_per_token", "prefill_tokens_per_s", "tiers", "use",
        "load_bytes_per_s", "load_latency_s", "loads", "bytes_used", "capacity_bytes", "steps"]  # fmt: skip
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), ANY_FLOAT, st.integers(), st.text(max_size=8)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner, max_size=6)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(figures=JSON, page=st.text(max_size=300))
def test_any_report_parses_without_raising_and_keeps_predictions_bounded(figures: Any, page: str) -> None:
    clock = _Clock()
    model = CostModel(CostSettings(), clock)
    report, rejected = report_from_figures(figures, clock.t)
    if report is not None:
        model.report("a", report)
    metrics, _ = report_from_metrics("kvmesh:" + page, clock.t, report)
    if metrics is not None:
        model.report("a", metrics)
    json.dumps(model.describe())  # /kvmesh/state can always render it
    table = ReplicaTable.of([ReplicaState("a"), ReplicaState("b")])
    held = np.array([[0.0, 0.0, 0.0, 0.0, 2.0], [1.0, 0.0, 1.0, 0.0, 0.0]])
    p = model.predict(_request(4096, table, held), table)
    assert (
        np.isfinite(p.ttft).all()
        and (p.ttft >= MIN_PREDICTION_S).all()
        and (p.ttft <= MAX_PREDICTION_S).all()
    )
    assert all(isinstance(r, str) for r in rejected)
