"""Scorers and picker: pure code, no server (the trace simulator uses them the same way)."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kvmesh.errors import ConfigError
from kvmesh.events import BlockStored
from kvmesh.index import BlockIndex
from kvmesh.router.config import RouterConfig
from kvmesh.routing.config import POLICIES, ReplicaConfig, Weights
from kvmesh.routing.health import parse_vllm_gauges
from kvmesh.routing.picker import build_picker
from kvmesh.routing.scorers import (
    KVUtilScorer,
    PrefillScorer,
    PrefixScorer,
    QueueScorer,
    ReplicaState,
    RoutingRequest,
    SessionScorer,
    prefill_cost,
    prompt_key,
)
from kvmesh.routing.sessions import SessionTable

_engine_hash = itertools.count(1)


def hold(index: BlockIndex, replica: str, tokens: np.ndarray, medium: str = "GPU", bs: int = 16) -> None:
    """Tell the index that ``replica`` holds the whole blocks of ``tokens`` in ``medium``."""
    n = len(tokens) // bs
    hashes = tuple(next(_engine_hash) for _ in range(n))
    ev = BlockStored(hashes, None, tuple(int(t) for t in tokens[: n * bs]), bs, medium=medium)
    index.store(replica, ev)


def prompt(seed: int, n: int = 256) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n, dtype=np.uint32)


def request(tokens: np.ndarray, session: str | None = None) -> RoutingRequest:
    return RoutingRequest(tokens, session_id=session, key=prompt_key(tokens))


def states(*names: str, **loads: float) -> list[ReplicaState]:
    return [ReplicaState(n, waiting=loads.get(n, 0.0)) for n in names]


@pytest.fixture
def index() -> BlockIndex:
    idx = BlockIndex()
    for r in ("a", "b", "c"):
        idx.add_replica(r)
    return idx


# -- single scorers ------------------------------------------------------------------------------


def test_prefix_score_is_matched_fraction_weighted_by_medium(index: BlockIndex) -> None:
    toks = prompt(1, 256)
    hold(index, "a", toks[:128], "GPU")
    hold(index, "b", toks[:128], "CPU")
    hold(index, "c", toks[:256], "DISK")
    got = PrefixScorer(index).score(request(toks), states("a", "b", "c"))
    assert got == pytest.approx({"a": 0.5, "b": 0.5 * 0.8, "c": 0.5})


def test_prefix_scorer_weights_mixed_media_per_block(index: BlockIndex) -> None:
    toks = prompt(2, 64)
    hold(index, "a", toks[:32], "GPU")
    hold(index, "a", toks[:64], "CPU")  # first half on both: the better medium counts
    got = PrefixScorer(index, {"GPU": 1.0, "CPU": 0.5, "DISK": 0, "REMOTE": 0}).score(
        request(toks), states("a", "b")
    )
    assert got["a"] == pytest.approx((32 * 1.0 + 32 * 0.5) / 64)
    assert got["b"] == 0.0


def test_remote_blocks_count_for_every_replica(index: BlockIndex) -> None:
    toks = prompt(3, 64)
    hold(index, "a", toks, "REMOTE")
    got = PrefixScorer(index).score(request(toks), states("a", "b", "c"))
    assert got == pytest.approx({"a": 0.3, "b": 0.3, "c": 0.3})


def test_queue_scorer_relative_and_damped() -> None:
    q = QueueScorer(smoothing=4)
    req = request(prompt(4))
    assert q.score(req, states("a", "b")) == {"a": 1.0, "b": 1.0}
    small = q.score(req, states("a", "b", b=1))
    assert small["a"] - small["b"] == pytest.approx(0.2)  # one request: a small nudge
    big = q.score(req, states("a", "b", b=100))
    assert big["a"] - big["b"] > 0.95
    # in-flight requests count even before the next scrape shows them
    live = [ReplicaState("a", in_flight=6), ReplicaState("b", waiting=1, running=1)]
    assert q.score(req, live)["b"] > q.score(req, live)["a"]


def test_kv_util_scorer_prefers_free_cache() -> None:
    reps = [ReplicaState("a", kv_usage=0.9), ReplicaState("b", kv_usage=0.1), ReplicaState("c")]
    got = KVUtilScorer().score(request(prompt(5)), reps)
    assert got == pytest.approx({"a": 0.1, "b": 0.9, "c": 0.5})


def test_prefill_cost_gpu_is_free_lower_tiers_are_a_load(index: BlockIndex) -> None:
    toks = prompt(4, 512)
    hold(index, "a", toks[:256])
    hold(index, "b", toks[:128], medium="CPU")
    req = request(toks)
    PrefixScorer(index).score(req, states("a", "b", "c"))  # fills req.matches
    assert prefill_cost(req, "a", 0.1) == pytest.approx(256)
    assert prefill_cost(req, "b", 0.1) == pytest.approx(384 + 12.8)
    assert prefill_cost(req, "c", 0.1) == 512  # nothing held: all of it
    assert prefill_cost(request(toks), "a", 0.1) == 512  # no matches asked: all of it
    with pytest.raises(ValueError, match="load_cost"):
        PrefillScorer(load_cost=1.5)


def test_prefill_scorer_adds_queued_work_to_own_cost() -> None:
    req = request(prompt(5, 400))
    reps = states("a", "b")
    reps[0].prefill_tokens = 2000.0
    got = PrefillScorer(smoothing_tokens=100).score(req, reps)
    assert got["b"] == 1.0 and got["a"] == pytest.approx((400 + 100) / (2400 + 100))


def test_session_scorer_and_table_bound() -> None:
    table = SessionTable(capacity=2)
    table.record("s1", "b")
    got = SessionScorer(table).score(request(prompt(6), session="s1"), states("a", "b"))
    assert got == {"a": 0.0, "b": 1.0}
    table.record("s2", "a")
    table.record("s3", "a")
    assert table.get("s1") is None and len(table) == 2
    table.forget_replica("a")
    assert len(table) == 0


# -- the picker ------------------------------------------------------------------------------------


def test_kvmesh_follows_the_prefix(index: BlockIndex) -> None:
    picker = build_picker("kvmesh", index)
    for seed, holder in ((10, "a"), (11, "b"), (12, "c")):
        toks = prompt(seed, 512)
        hold(index, holder, toks[:448])
        assert picker.pick(request(toks), states("a", "b", "c")).replica == holder


def test_prefix_beats_a_small_queue_but_not_a_long_one(index: BlockIndex) -> None:
    toks = prompt(20, 512)
    hold(index, "a", toks)
    picker = build_picker("kvmesh", index)
    assert picker.pick(request(toks), states("a", "b", a=2)).replica == "a"
    # a's queue is much longer (> 8 more and > 1.5x): the load term dominates
    d = picker.pick(request(toks), states("a", "b", a=30, b=3))
    assert d.replica == "b" and d.overloaded == ["a"]
    assert d.ranked == ["b", "a"]  # a is still a fallback


def test_follow_up_leaves_a_holder_busy_with_a_long_prefill(index: BlockIndex) -> None:
    """GPU holder a is computing someone's 2,400-token miss; b can load the prefix from the
    shared tier: the follow-up goes to b. Behind a short follow-up it stays on a."""
    toks = prompt(23, 2048)
    hold(index, "a", toks[:1920])
    hold(index, "b", toks[:1920], medium="REMOTE")
    sessions = SessionTable()
    sessions.record("user-1", "a")
    picker = build_picker("kvmesh", index, sessions)
    busy = states("a", "b")
    busy[0].in_flight, busy[0].prefill_tokens = 1, 2400.0
    assert picker.pick(request(toks, "user-1"), busy).replica == "b"
    short = states("a", "b")
    short[0].in_flight, short[0].prefill_tokens = 1, 300.0
    assert picker.pick(request(toks, "user-1"), short).replica == "a"
    # Request counts alone (the queue term) cannot tell the two cases apart.
    queue_only = QueueScorer()
    assert queue_only.score(request(toks), busy) == queue_only.score(request(toks), short)


def test_misses_spread_by_the_work_queued_not_the_request_count(index: BlockIndex) -> None:
    picker = build_picker("kvmesh", index)
    reps = states("a", "b")
    reps[0].in_flight, reps[0].prefill_tokens = 1, 50.0  # a short follow-up
    reps[1].in_flight, reps[1].prefill_tokens = 1, 2400.0  # a long miss
    assert {picker.pick(request(prompt(s, 2048)), reps).replica for s in range(20)} == {"a"}


def test_prefix_only_policy_piles_onto_the_holder(index: BlockIndex) -> None:
    toks = prompt(21, 512)
    hold(index, "a", toks)
    picker = build_picker("prefix", index)
    assert picker.pick(request(toks), states("a", "b", a=1000)).replica == "a"


def test_a_burst_of_one_prefix_spreads_once_queues_grow(index: BlockIndex) -> None:
    """Simulate in-flight counts: a hot prefix must not take every request of a burst."""
    picker = build_picker("kvmesh", index)
    toks = prompt(22, 512)
    hold(index, "a", toks)
    reps = states("a", "b", "c")
    chosen: Counter[str] = Counter()
    for _ in range(60):
        name = picker.pick(request(toks), reps).replica
        chosen[name] += 1
        next(r for r in reps if r.name == name).in_flight += 1
    assert chosen["a"] > chosen["b"] and chosen["a"] > chosen["c"]
    assert chosen["b"] + chosen["c"] > 0


def test_ties_are_deterministic_and_spread_over_replicas(index: BlockIndex) -> None:
    picker = build_picker("kvmesh", index)
    reps = states("a", "b", "c")
    firsts = [picker.pick(request(prompt(s)), reps).replica for s in range(60)]
    again = [build_picker("kvmesh", index).pick(request(prompt(s)), reps).replica for s in range(60)]
    assert firsts == again
    assert set(firsts) == {"a", "b", "c"}  # no favourite by list position
    # the order of the candidate list does not matter either
    assert firsts == [picker.pick(request(prompt(s)), reps[::-1]).replica for s in range(60)]


def test_session_affinity_wins_ties(index: BlockIndex) -> None:
    sessions = SessionTable()
    picker = build_picker("kvmesh", index, sessions)
    sessions.record("user-1", "c")
    assert {picker.pick(request(prompt(s), "user-1"), states("a", "b", "c")).replica for s in range(20)} == {
        "c"
    }


def test_policies_by_name(index: BlockIndex) -> None:
    assert set(POLICIES) == {"kvmesh", "cost", "prefix", "least-loaded", "round-robin", "random"}
    reps = states("a", "b", "c", a=5, b=0, c=9)
    req = request(prompt(30))
    assert build_picker("least-loaded").pick(req, reps).replica == "b"
    rr = build_picker("round-robin")
    assert [rr.pick(req, reps).replica for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    r1, r2 = build_picker("random"), build_picker("random")
    seq = [r1.pick(req, reps).replica for _ in range(30)]
    assert seq == [r2.pick(req, reps).replica for _ in range(30)]  # seeded
    assert len(set(seq)) == 3
    with pytest.raises(ValueError, match="unknown routing policy"):
        build_picker("fastest")
    with pytest.raises(ValueError, match="needs a prefix source"):
        build_picker("prefix")


def test_weights_come_from_config(index: BlockIndex) -> None:
    toks = prompt(40, 512)
    hold(index, "a", toks)
    reps = states("a", "b", a=1)
    assert build_picker("kvmesh", index).pick(request(toks), reps).replica == "a"
    load_only = RouterConfig(weights=Weights(prefix=0, queue=1, kv_util=0, session=0))
    assert build_picker("kvmesh", index, config=load_only).pick(request(toks), reps).replica == "b"
    with pytest.raises(ValueError, match="no scorer with a positive weight"):
        build_picker(
            "kvmesh",
            index,
            config=RouterConfig(weights=Weights(prefix=0, queue=0, kv_util=0, session=0, prefill=0)),
        )


# -- config ------------------------------------------------------------------------------------------


def test_config_from_yaml_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        "policy: prefix\n"
        "weights: {prefix: 3, queue: 2}\n"
        "medium_weights: {CPU: 0.7}\n"
        "replicas:\n"
        "  - http://127.0.0.1:8100,events=tcp://127.0.0.1:5600,name=r0\n"
        "  - {url: 'http://127.0.0.1:8101/'}\n"
    )
    cfg = RouterConfig.from_yaml(path)
    assert cfg.policy == "prefix" and cfg.weights.prefix == 3 and cfg.weights.kv_util == 0.5
    assert cfg.medium_weights.CPU == 0.7 and cfg.medium_weights.GPU == 1.0
    assert cfg.replicas[0] == ReplicaConfig(
        url="http://127.0.0.1:8100", name="r0", events="tcp://127.0.0.1:5600"
    )
    assert cfg.replicas[1].key == "http://127.0.0.1:8101"

    path.write_text("polcy: kvmesh\n")
    with pytest.raises(ConfigError, match="unknown key 'polcy'"):
        RouterConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="policy"):
        RouterConfig.from_dict({"policy": "fastest"})
    with pytest.raises(ConfigError, match=r"weights\.queue"):
        RouterConfig.from_dict({"weights": {"queue": -1}})
    with pytest.raises(ConfigError, match="must be unique"):
        RouterConfig.from_dict({"replicas": ["http://h:1", "http://h:1"]})
    with pytest.raises(ConfigError, match="cannot read"):
        RouterConfig.from_yaml(tmp_path / "missing.yaml")


def test_replica_spec_parsing() -> None:
    r = ReplicaConfig.parse("http://10.0.0.5:8000,events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558")
    assert (r.url, r.events, r.replay, r.key) == (
        "http://10.0.0.5:8000",
        "tcp://10.0.0.5:5557",
        "tcp://10.0.0.5:5558",
        "http://10.0.0.5:8000",
    )
    for bad in ("10.0.0.5:8000", "http://h:1,evnts=x", "http://h:1,events"):
        with pytest.raises(ConfigError):
            ReplicaConfig.parse(bad)


def test_parse_vllm_gauges() -> None:
    text = (
        "# HELP vllm:num_requests_waiting Number of requests waiting.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 7.0 1700000000000\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25\n'
        'vllm:num_requests_waiting_by_reason{reason="x"} 99\n'
        "vllm:prompt_tokens_total 1234\n"
    )
    assert parse_vllm_gauges(text) == {
        "num_requests_waiting": 5.0,
        "num_requests_running": 7.0,
        "kv_cache_usage_perc": 0.375,
    }
    assert parse_vllm_gauges("vllm:gpu_cache_usage_perc 0.2\n") == {"kv_cache_usage_perc": 0.2}
