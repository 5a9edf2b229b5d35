"""The TTFT cost model and its picker: pure code on a fake clock, with the router's own index."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from kvmesh.events import BlockStored
from kvmesh.index import BlockIndex
from kvmesh.router.config import RouterConfig
from kvmesh.routing.cost import MAX_PREDICTION_S, MIN_PREDICTION_S, CostModel, CostPicker, CostSettings
from kvmesh.routing.fit import (
    BASE,
    COMPUTE,
    MEDIA,
    QUEUE,
    UNMEASURED_FRACTION,
    ReplicaFit,
    Report,
    lat_i,
    load_i,
)
from kvmesh.routing.picker import build_picker
from kvmesh.routing.scorers import ReplicaState, RoutingRequest, prompt_key
from kvmesh.routing.table import ReplicaTable

REMOTE, CPU, GPU = MEDIA.index("REMOTE"), MEDIA.index("CPU"), MEDIA.index("GPU")
_hash = itertools.count(1)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def hold(index: BlockIndex, replica: str, tokens: np.ndarray, medium: str = "GPU", bs: int = 16) -> None:
    n = len(tokens) // bs
    ev = BlockStored(
        tuple(next(_hash) for _ in range(n)), None, tuple(int(t) for t in tokens[: n * bs]), bs, medium=medium
    )
    index.store(replica, ev)


def prompt(seed: int, n: int = 1024) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n, dtype=np.uint32)


def request(tokens: np.ndarray) -> RoutingRequest:
    return RoutingRequest(tokens, key=prompt_key(tokens))


def table(*names: str, **waiting: float) -> ReplicaTable:
    return ReplicaTable.of([ReplicaState(n, waiting=waiting.get(n, 0.0)) for n in names])


@pytest.fixture
def index() -> BlockIndex:
    idx = BlockIndex()
    for r in ("a", "b"):
        idx.add_replica(r)
    return idx


@pytest.fixture
def clock() -> Clock:
    return Clock()


def picker(index: BlockIndex, clock: Clock, **settings: float) -> CostPicker:
    model = CostModel(CostSettings(**settings), clock)  # type: ignore[arg-type]
    for r in ("a", "b"):
        known(model, r)
    return CostPicker(index, model)


def known(model: CostModel, name: str, compute: float = 1.0, base: float = 0.01) -> None:
    """A replica whose figures are known: 1,000 tokens/s, 10 ms base, cheap CPU, slow REMOTE."""
    model.set_param(name, BASE, base)
    model.set_param(name, COMPUTE, compute)
    model.set_param(name, QUEUE, 1.0)
    model.set_param(name, load_i(CPU), 0.01)
    model.set_param(name, lat_i(CPU), 0.0)
    model.set_param(name, load_i(REMOTE), 0.2)
    model.set_param(name, lat_i(REMOTE), 0.005)


def test_a_load_slower_than_recomputing_counts_as_recompute(index: BlockIndex, clock: Clock) -> None:
    p = picker(index, clock)
    toks = prompt(1)
    hold(index, "a", toks[:512], "REMOTE")  # REMOTE is everyone's (the shared tier)
    d = p.pick(request(toks), table("a", "b"))
    fast = d.parts["ttft_s"]["a"]
    assert fast == pytest.approx(0.01 + 0.005 + 0.2 * 0.512 + 1.0 * 0.512)
    p.model.set_param("a", load_i(REMOTE), 5.0)  # now loading is 5x slower than computing
    p.model.set_param("b", load_i(REMOTE), 5.0)
    d = p.pick(request(toks), table("a", "b"))
    assert d.parts["ttft_s"]["a"] == pytest.approx(0.01 + 1.024)
    assert d.parts["loading_s"]["a"] == 0.0


def test_the_gpu_prefix_wins_and_the_cut_keeps_fast_media(index: BlockIndex, clock: Clock) -> None:
    p = picker(index, clock)
    toks = prompt(2)
    hold(index, "a", toks[:256], "GPU")
    hold(index, "a", toks[:768], "CPU")
    d = p.pick(request(toks), table("a", "b"))
    assert d.replica == "a"
    assert d.parts["ttft_s"]["a"] == pytest.approx(0.01 + 0.01 * 0.512 + 1.0 * 0.256)
    assert d.parts["ttft_s"]["b"] == pytest.approx(0.01 + 1.024)


def test_an_unmeasured_medium_is_never_free(index: BlockIndex, clock: Clock) -> None:
    """A replica with no figures: a CPU hit is costed near recomputing (UNMEASURED_FRACTION of
    it, plus a latency), never as free, until TTFTs or a report measure it."""
    model = CostModel(clock=clock)
    p = CostPicker(index, model)
    toks = prompt(3)
    hold(index, "a", toks, "CPU")
    d = p.pick(request(toks), table("a", "b"))
    assert d.parts["loading_s"]["a"] >= UNMEASURED_FRACTION * d.parts["computing_s"]["b"]
    assert d.parts["ttft_s"]["a"] >= UNMEASURED_FRACTION * d.parts["ttft_s"]["b"]


def test_the_ledger_spreads_a_burst_within_one_scrape(index: BlockIndex, clock: Clock) -> None:
    p = picker(index, clock)
    got = []
    for i in range(10):  # ten new 1,024-token prompts at once: no first byte, no scrape yet
        d = p.pick(request(prompt(100 + i)), table("a", "b"))
        assert p.sent(d, d.replica) is not None
        got.append(d.replica)
    assert sorted(Counter(got).values()) == [5, 5]


def test_the_queue_is_priced_at_what_the_fit_knows_now(index: BlockIndex, clock: Clock) -> None:
    """A burst sent while the fit was 10x too slow: once the fit knows better, the requests
    still queued are priced at the new rate, not at the seconds predicted when they were sent."""
    p = picker(index, clock)
    for i in range(4):  # four new 1,024-token prompts on 'a': 1 s of prefill each at 1,000 tokens/s
        d = p.pick(request(prompt(300 + i)), table("a"))
        assert p.sent(d, "a") is not None
    assert p.model.describe()["a"]["ledger"]["queued_s"] == pytest.approx(4 * 1.024)
    new = p.pick(request(prompt(400)), table("a"))
    assert new.parts["waiting_s"]["a"] == pytest.approx(4 * 1.024)
    p.model.set_param("a", COMPUTE, 0.1)  # learned: 10,000 tokens/s
    assert p.model.describe()["a"]["ledger"]["queued_s"] == pytest.approx(4 * 0.1024)
    new = p.pick(request(prompt(400)), table("a"))
    assert new.parts["waiting_s"]["a"] == pytest.approx(4 * 0.1024)
    assert new.parts["ttft_s"]["a"] == pytest.approx(0.01 + 5 * 0.1024)


def test_a_burst_sent_before_the_fit_knew_teaches_the_right_queue_coefficient(
    index: BlockIndex, clock: Clock
) -> None:
    """Bursts of eight new prompts on one replica, the first sent while the fit is cold
    (1 s per 1k tokens; truth: 0.1 s, and a request waits for every prefill ahead of it).
    Each observation's Q is priced at the coefficients known when it is learned from, so
    from the second burst on every prediction is within 25%; priced when sent, the queue
    coefficient learned the cold fit's error (0.08-0.3) and predictions stayed 0.5-1.9x off."""
    model = CostModel(clock=clock)
    p = CostPicker(index, model)
    seed = 500
    ratios = []
    for _ in range(12):
        tickets = []
        for _ in range(8):
            seed += 1
            d = p.pick(request(prompt(seed)), table("a"))
            t = p.sent(d, "a")
            assert t is not None
            tickets.append(t)
        start = clock.t
        for k, t in enumerate(tickets):
            clock.t = start + 0.01 + 0.1024 * (k + 1)  # its own prefill after k others
            ratios.append(t.predicted / (clock.t - t.sent_at))
            t.first_byte()
            t.finished()
    assert min(ratios[8:]) > 0.8 and max(ratios[8:]) < 1.25
    assert model.effective(model.rows(("a",)))[0][QUEUE] > 0.5


def test_a_hot_prefix_does_not_pile_onto_its_holder(index: BlockIndex, clock: Clock) -> None:
    """'a' holds 7/8 of a hot prompt on GPU: it takes the prompt while its queue of short
    prefills is shorter than computing the whole prompt on 'b', then 'b' gets one."""
    p = picker(index, clock)
    toks = prompt(4, 2048)
    hold(index, "a", toks[:1792], "GPU")
    got = []
    for _ in range(10):
        d = p.pick(request(toks), table("a", "b"))
        p.sent(d, d.replica)
        got.append(d.replica)
    # 0.256 s of work each on 'a' against 2.048 s on 'b': b's turn comes after ~8 on 'a'
    assert got[0] == "a" and "b" in got and 6 <= got.count("a") <= 9


def test_first_bytes_drain_the_ledger_and_teach_the_fit(index: BlockIndex, clock: Clock) -> None:
    model = CostModel(clock=clock)
    p = CostPicker(index, model)
    rng = np.random.default_rng(0)
    errors = []
    for i in range(300):
        toks = prompt(i, int(rng.integers(64, 3000)))
        d = p.pick(request(toks), table("a"))
        t = p.sent(d, "a")
        assert t is not None
        clock.t += 0.02 + len(toks) / 4000 * rng.lognormal(0, 0.05)  # truth: 4,000 tokens/s + 20 ms
        if i >= 50:
            errors.append(abs(t.predicted - (clock.t - t.sent_at)) / (clock.t - t.sent_at))
        t.first_byte()
        t.finished()
    fit = model.describe()["a"]
    assert fit["prefill_tokens_per_s"] == pytest.approx(4000, rel=0.1)
    assert fit["ledger"] == {
        "queued_s": 0.0,
        "pending": 0,
        "in_flight": 0,
        "mean_service_s": fit["ledger"]["mean_service_s"],
    }
    assert float(np.median(errors)) < 0.1


def test_a_request_that_ends_without_a_first_byte_teaches_nothing(index: BlockIndex, clock: Clock) -> None:
    p = picker(index, clock)
    d = p.pick(request(prompt(5)), table("a", "b"))
    t = p.sent(d, d.replica)
    assert t is not None
    before = p.model.fits[d.replica].observations
    t.finished()
    t.first_byte()  # too late: ignored
    assert p.model.fits[d.replica].observations == before
    assert p.model.describe()[d.replica]["ledger"]["pending"] == 0


def test_gauges_count_only_beyond_our_own_and_only_while_fresh(index: BlockIndex, clock: Clock) -> None:
    p = picker(index, clock)
    toks = prompt(6)
    p.model.gauges_scraped("a")
    p.model.gauges_scraped("b")
    warm = p.pick(request(toks), table("a", "b"))
    p.sent(warm, "a")  # mean service on a known now
    busy = p.pick(request(toks), table("a", "b", a=20.0))  # 20 waiting, 1 of them ours
    assert busy.parts["waiting_s"]["a"] > 10 * busy.parts["ttft_s"]["b"]
    clock.t += 10.0  # the scrape is 10 s old: ignored
    stale = p.pick(request(toks), table("a", "b", a=20.0))
    assert stale.parts["waiting_s"]["a"] < busy.parts["waiting_s"]["a"] / 5


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -5.0, 1e300])
def test_absurd_gauges_give_a_bounded_prediction(index: BlockIndex, clock: Clock, bad: float) -> None:
    p = picker(index, clock)
    p.model.gauges_scraped("a")
    t = ReplicaTable.of([ReplicaState("a", waiting=bad, running=bad), ReplicaState("b")])
    d = p.pick(request(prompt(7)), t)
    got = np.array(list(d.parts["ttft_s"].values()))
    assert np.isfinite(got).all() and (got >= MIN_PREDICTION_S).all() and (got <= MAX_PREDICTION_S).all()


def test_a_lying_report_is_checked_against_observed_ttfts(index: BlockIndex, clock: Clock) -> None:
    """'a' claims its shared tier loads at 1 TB/s; requests that load from it say ~2 s per
    1k tokens. The fleet's pooled fit learns that from the first loads, and 'a' does not
    differ from the fleet (it is the fleet), so its claim counts only as a report: within a
    few loads the predictions put the tier above the prefill cost and stop loading from it."""
    model = CostModel(clock=clock)
    p = CostPicker(index, model)
    lie = Report(at=0.0, bytes_per_token=4096, media={"REMOTE": (1e12, 0.0, 1)})
    model.report("a", lie)
    assert model.fits["a"].rls.theta[load_i(REMOTE)] < 0.01  # believed at first
    rng = np.random.default_rng(1)
    for i in range(120):
        toks = prompt(1000 + i, 1024)
        hold(index, "a", toks[: int(rng.integers(1, 60)) * 16], "REMOTE")
        d = p.pick(request(toks), table("a"))
        t = p.sent(d, "a")
        assert t is not None
        remote = t.x[load_i(REMOTE)]
        computed = t.x[COMPUTE]
        clock.t += 0.01 + 2.0 * remote + 0.5 * computed
        t.first_byte()
        t.finished()
        lie.media["REMOTE"] = (1e12, 0.0, 2 + i)  # it keeps repeating the lie
        model.report("a", lie)
    fit = model.fits["a"]
    assert fit.uses[REMOTE] <= 10  # the lie cost a few loads, not a hundred
    effective = model.effective(np.array([model.rows(("a",))[0]]))[0]
    assert effective[load_i(REMOTE)] > effective[COMPUTE] > 0.3  # loading is predicted slower


def test_a_lying_report_is_set_aside_once_its_own_loads_contradict_it() -> None:
    """The replica's own fit: after DISTRUST_AFTER loads at ~2 s per 1k tokens, a claim of
    1 TB/s is set aside and the fit follows the observations."""
    fit = ReplicaFit("a")
    lie = Report(at=0.0, bytes_per_token=4096, media={"REMOTE": (1e12, 0.0, 1)})
    fit.apply_report(lie)
    assert fit.rls.theta[load_i(REMOTE)] < 0.01
    rng = np.random.default_rng(2)
    for i in range(150):
        x = np.zeros(len(fit.rls.theta))
        x[BASE] = 1.0
        x[COMPUTE] = float(rng.uniform(0.1, 1.0))
        x[load_i(REMOTE)] = float(rng.uniform(0.1, 1.0))
        x[lat_i(REMOTE)] = 1.0
        observed = 0.01 + 0.5 * x[COMPUTE] + 2.0 * x[load_i(REMOTE)]
        fit.observe(x, fit.rls.predict(x), observed)
        lie.media["REMOTE"] = (1e12, 0.0, 2 + i)
        fit.apply_report(lie)
    assert "REMOTE" in fit.distrusted
    assert fit.rls.theta[load_i(REMOTE)] > 0.5  # far from the claimed ~0.004 s per 1k tokens


def _fleet_run(rates: dict[str, float], n: int, seed: int) -> CostModel:
    """``n`` requests round-robin over replicas whose prefill costs ``rates`` s per 1k
    tokens (nothing cached, one at a time), each TTFT with 20% log-normal noise."""
    clock = Clock()
    model = CostModel(clock=clock)
    p = CostPicker(BlockIndex(), model)
    names = tuple(rates)
    rng = np.random.default_rng(seed)
    for i in range(n):
        toks = prompt(10_000 + i, int(rng.integers(64, 2048)))
        name = names[i % len(names)]
        t = p.sent(p.pick(request(toks), table(*names)), name)
        assert t is not None
        clock.t += (0.01 + rates[name] * t.x[COMPUTE]) * float(rng.lognormal(0.0, 0.2))
        t.first_byte()
        t.finished()
    return model


def test_identical_replicas_are_predicted_by_the_fleet_fit() -> None:
    """Four replicas alike: their own fits drift apart on the noise, but none differs from
    the fleet by more than twice its standard error for long, so predictions use the pooled
    fit and agree with each other and with the truth."""
    model = _fleet_run(dict.fromkeys("abcd", 0.5), 800, seed=3)
    names = tuple("abcd")
    effective = model.effective(model.rows(names))[:, COMPUTE]
    own = np.array([model.fits[n].rls.theta[COMPUTE] for n in names])
    assert np.all(np.abs(effective / 0.5 - 1.0) < 0.1), effective
    assert np.ptp(effective) <= np.ptp(own)
    assert np.mean([model.fits[n].distinct(model.pooled) for n in names]) < 0.5


def test_a_slower_replica_is_told_apart_from_the_fleet() -> None:
    """'d' prefills at half the others' rate: the pooled fit's residuals there are ~log 2
    apart from the rest, so 'd' (and every other replica: the pooled fit is off for all of
    them now) is predicted by its own fit."""
    model = _fleet_run({"a": 0.5, "b": 0.5, "c": 0.5, "d": 1.0}, 800, seed=4)
    names = tuple("abcd")
    effective = model.effective(model.rows(names))[:, COMPUTE]
    assert 1.7 < effective[3] / np.median(effective[:3]) < 2.3, effective
    assert min(model.fits[n].distinct(model.pooled) for n in names) > 0.8
    assert model.describe()["d"]["distinct_from_fleet"] > 0.8


def test_build_picker_cost_needs_the_index_and_reads_the_config(index: BlockIndex) -> None:
    with pytest.raises(ValueError, match="prefix source"):
        build_picker("cost")
    cfg = RouterConfig.from_dict({"policy": "cost", "cost": {"tie_tolerance": 0.2, "forgetting": 0.99}})
    p = build_picker("cost", index, config=cfg)
    assert isinstance(p, CostPicker) and p.policy == "cost"
    assert p.model.settings.tie_tolerance == 0.2 and p.model.settings.forgetting == 0.99


def test_a_replica_without_evidence_is_predicted_by_the_fleets_pooled_fit(
    index: BlockIndex, clock: Clock
) -> None:
    """Requests to 'a' teach the pooled fit; 'b', never observed, is predicted with it (the
    cold default would say 1,000 tokens/s), and its own fit takes over as it is observed."""
    model = CostModel(clock=clock)
    p = CostPicker(index, model)
    for i in range(60):
        toks = prompt(300 + i, 2048)
        d = p.pick(request(toks), table("a"))
        t = p.sent(d, "a")
        assert t is not None
        clock.t += 0.01 + 2.048 / 20.0  # truth: 20,000 tokens/s
        t.first_byte()
        t.finished()
    d = p.pick(request(prompt(999, 2048)), table("a", "b"))
    assert d.parts["computing_s"]["b"] == pytest.approx(2.048 / 20.0, rel=0.2)
    assert d.parts["computing_s"]["b"] < 0.2 * 2.048  # far from the cold 2 s


def test_a_reported_prefill_rate_is_predicted_with_before_the_fleet_has_seen_anything(
    index: BlockIndex, clock: Clock
) -> None:
    """At a router's start the pooled fit is only the cold default (1,000 tokens/s): a
    replica's reported rate (10,000 tokens/s) is predicted with as it is, not halved toward
    the default; as the pooled fit sees answers its weight grows (at most POOL_EVIDENCE)."""
    model = CostModel(clock=clock)
    p = CostPicker(index, model)
    model.report("a", Report(at=0.0, prefill_tokens_per_s=10_000.0, prefill_steps=10))
    d = p.pick(request(prompt(1, 2048)), table("a"))
    assert d.parts["computing_s"]["a"] == pytest.approx(0.2048, rel=0.05)
    fit = model.fits["a"]
    assert fit.blend(model.pooled)[COMPUTE] == 1.0
    for i in range(30):  # answers at the reported rate: the pooled fit learns it too
        t = p.sent(p.pick(request(prompt(600 + i, 2048)), table("a")), "a")
        assert t is not None
        clock.t += 0.01 + 0.2048
        t.first_byte()
        t.finished()
        assert 0.0 < fit.blend(model.pooled)[COMPUTE] <= 1.0
    assert np.allclose(model._blend[model._row["a"]], fit.blend(model.pooled))  # every row kept in step
    assert fit.blend(model.pooled)[COMPUTE] == pytest.approx(20 / (30 + 20 + 20))
    d = p.pick(request(prompt(2, 2048)), table("a"))
    assert d.parts["computing_s"]["a"] == pytest.approx(0.2048, rel=0.2)
