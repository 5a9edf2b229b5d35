"""Properties of the cost model and its fit (kvmesh.routing.cost, kvmesh.routing.fit, kvmesh.core.rls).

* whatever the inputs (gauges, matches, reports, fitted state, ledger), a prediction is
  finite, positive and bounded;
* the fit converges on data drawn from a known model, outliers included;
* adversarial observations keep the fit inside its box, with a finite covariance;
* a replica's report, whatever its JSON, is parsed without raising and leaves predictions bounded;
* the prediction (holders of the prompt in full, the others by their four coefficients) equals,
  bit for bit, the same model computed over every candidate's 14 features at once.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.rls import RobustRLS
from kvmesh.routing.cost import (
    _COLUMNS,
    MAX_PREDICTION_S,
    MIN_PREDICTION_S,
    CostModel,
    CostSettings,
)
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
    for arr in (p.ttft, p.waiting, p.loading, p.computing, p.features):
        assert np.isfinite(arr).all()
    assert (p.ttft >= MIN_PREDICTION_S).all() and (p.ttft <= MAX_PREDICTION_S).all()
    assert (p.computing >= 0).all() and (p.loading >= 0).all()
    ref = model.reference(table)
    assert np.isfinite(ref).all() and (ref >= MIN_PREDICTION_S).all() and (ref <= MAX_PREDICTION_S).all()


_LOAD = np.array([load_i(j) for j in range(len(MEDIA))])
_LAT = np.array([lat_i(j) for j in range(len(MEDIA))])


def _whole_matrix(model: CostModel, req: RoutingRequest, table: ReplicaTable) -> dict[str, np.ndarray]:
    """The prediction as the model computed it before it split holders from the rest: every
    candidate's 14 coefficients and features as matrices (the reference for the test below)."""
    rows = model.rows(table.names)
    theta = model.effective(rows)
    n, total = len(rows), req.num_tokens / 1e3
    assert req.aligned is not None
    tokens = req.aligned[2]
    held = np.clip(np.nan_to_num(tokens[:, _COLUMNS] / 1e3, nan=0.0, posinf=total, neginf=0.0), 0.0, total)
    queued, decoding, _ = model._load_state(table, rows)
    per_ktok = theta[:, COMPUTE] + theta[:, DECODE] * decoding
    has = held > 0
    load_cost = theta[:, _LOAD] * held + theta[:, _LAT] * has
    cum_tok = np.cumsum(held, axis=1)
    options = np.cumsum(load_cost, axis=1) + per_ktok[:, None] * np.maximum(total - cum_tok, 0.0)
    cut = np.argmin(options, axis=1)
    used = np.arange(len(MEDIA))[None, :] <= cut[:, None]
    computed = np.maximum(total - cum_tok[np.arange(n), cut], 0.0)
    x = np.zeros((n, N_PARAMS))
    x[:, BASE] = 1.0
    x[:, COMPUTE] = computed
    x[:, QUEUE] = queued
    x[:, DECODE] = computed * decoding
    x[:, _LOAD] = held * used
    x[:, _LAT] = has * used
    parts = theta * x
    loading = parts[:, _LOAD].sum(axis=1) + parts[:, _LAT].sum(axis=1)
    return {
        "ttft": np.clip(
            np.nan_to_num(parts.sum(axis=1), nan=MAX_PREDICTION_S), MIN_PREDICTION_S, MAX_PREDICTION_S
        ),
        "waiting": parts[:, QUEUE] + parts[:, DECODE],
        "loading": loading,
        "computing": parts[:, COMPUTE],
        "features": x,
    }


HELD = st.one_of(st.just(0.0), st.floats(0, 300_000), WILD)  # zeros often: most candidates hold nothing


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 12), tokens=st.integers(0, 200_000), data=st.data())
def test_prediction_equals_the_whole_matrix_computation(n: int, tokens: int, data: st.DataObject) -> None:
    clock = _Clock()
    model = CostModel(CostSettings(), clock)
    names = [f"r{i}" for i in range(n)]
    states = [ReplicaState(name, waiting=data.draw(WILD), running=data.draw(WILD)) for name in names]
    for name in names:
        for i in data.draw(st.lists(st.integers(0, N_PARAMS - 1), max_size=N_PARAMS)):
            model.set_param(name, i, data.draw(st.floats(float(LOWER[i]), float(UPPER[i]))))
    table = ReplicaTable.of(states)
    held = np.array([[data.draw(HELD) for _ in range(8)] for _ in range(n)])  # medium_tokens' 8 columns
    for _ in range(data.draw(st.integers(0, 3))):  # some ledger and some learning
        p = model.predict(_request(tokens, table, held), table)
        t = model.sent(p, data.draw(st.integers(0, n - 1)))
        clock.t += data.draw(st.floats(0.001, 10))
        t.first_byte()
    req = _request(tokens, table, held)
    want = _whole_matrix(model, req, table)
    got = model.predict(req, table)
    for name, arr in want.items():
        np.testing.assert_array_equal(getattr(got, name), arr, err_msg=name)
    for i in range(n):
        np.testing.assert_array_equal(got.feature_row(i), want["features"][i])


@pytest.mark.parametrize("seed", range(8))
def test_prediction_equals_the_whole_matrix_computation_on_plain_values(seed: int) -> None:
    """The same with unremarkable values (hypothesis favours 0, 1 and the bounds, which add
    exactly in any order; these are where summing in another order shows in the last bit)."""
    rng = np.random.default_rng(seed)
    clock = _Clock()
    model = CostModel(CostSettings(), clock)
    n = 60
    names = [f"r{i}" for i in range(n)]
    table = ReplicaTable.of(
        [ReplicaState(m, waiting=float(rng.integers(9)), running=float(rng.integers(30))) for m in names]
    )
    for name in names:
        for i in range(N_PARAMS):
            if rng.random() < 0.7:
                model.set_param(name, i, float(rng.uniform(LOWER[i], UPPER[i] / 50)))
    held = rng.uniform(0, 3000, size=(n, 8)) * (rng.random((n, 8)) < 0.1)
    model.live_gauges = True  # the gauges count: queues and decodes in every prediction
    for _ in range(20):
        req = _request(int(rng.integers(500, 4000)), table, held)
        t = model.sent(model.predict(req, table), int(rng.integers(0, n)))
        clock.t += float(rng.uniform(0.01, 2))
        t.first_byte()
    req = _request(3000, table, held)
    want = _whole_matrix(model, req, table)
    got = model.predict(req, table)
    for name, arr in want.items():
        np.testing.assert_array_equal(getattr(got, name), arr, err_msg=name)


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
