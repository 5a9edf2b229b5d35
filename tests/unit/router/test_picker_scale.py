"""The picker at fleet scale: same ranking rules at 1,000 replicas, ties spread, no favourite."""

from __future__ import annotations

import numpy as np

from kvmesh.index import BlockIndex
from kvmesh.routing.picker import _tie_break, build_picker
from kvmesh.routing.scorers import ReplicaState, RoutingRequest, prompt_key


def states(n: int) -> list[ReplicaState]:
    return [ReplicaState(f"r{i}", waiting=float(i % 3)) for i in range(n)]


def test_ranking_is_overload_then_score_then_rendezvous_hash() -> None:
    reps = states(1000)
    reps[5].waiting = 500.0  # grossly overloaded: ranked after everyone
    picker = build_picker("least-loaded")
    picker.overload = (8.0, 2.0)
    req = RoutingRequest(np.arange(64, dtype=np.uint32), key=12345)
    d = picker.pick(req, reps)
    assert sorted(d.ranked) == sorted(r.name for r in reps) and d.ranked[-1] == "r5"
    ties = dict(zip([r.name for r in reps], _tie_break(12345, [r.name for r in reps]).tolist(), strict=True))
    want = sorted(d.scores, key=lambda n: (n == "r5", -round(d.scores[n], 9), ties[n]))
    assert d.ranked == want
    # the candidate order does not change the ranking
    assert picker.pick(req, reps[::-1]).ranked == want


def test_ties_spread_over_a_thousand_idle_replicas() -> None:
    picker = build_picker("kvmesh", BlockIndex())
    reps = [ReplicaState(f"r{i}") for i in range(1000)]
    rng = np.random.default_rng(0)
    winners = set()
    for _ in range(2000):
        toks = rng.integers(0, 50_000, 64).astype(np.uint32)
        winners.add(picker.pick(RoutingRequest(toks, key=prompt_key(toks)), reps).replica)
    # 2,000 uniform draws over 1,000 replicas reach ~865 of them; a positional favourite would not.
    assert len(winners) > 750


def test_a_prefix_holder_wins_in_a_large_fleet() -> None:
    idx = BlockIndex()
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 50_000, 512).astype(np.uint32)
    for i in range(1000):
        idx.add_replica(f"r{i}")
    idx.add_speculative("r777", toks, ttl_s=60.0)
    picker = build_picker("kvmesh", idx)
    assert (
        picker.pick(
            RoutingRequest(toks, key=prompt_key(toks)), [ReplicaState(f"r{i}") for i in range(1000)]
        ).replica
        == "r777"
    )
