"""The index's array lookup (one block size) equals the per-holder range walk it replaced.

:meth:`BlockIndex.match` with one block size builds every replica's medium counts from the
holder masks in numpy (:func:`kvmesh.index.matching.medium_counts`) and each match's ranges
only on demand; :func:`kvmesh.index.matching.match_chain` is the per-holder walk it used
before. Random stores, removals, REMOTE copies and speculative entries over enough replicas
that masks span many bytes, odd and even ids: both must give the same ranges per replica,
and the counts must be the ranges' tokens per medium.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.events import BlockStored
from kvmesh.index import BlockIndex, PromptKeys
from kvmesh.index.matching import match_chain
from kvmesh.index.media import COLUMNS, column
from kvmesh.routing.scorers import PrefillScorer, PrefixScorer, RoutingRequest, medium_columns, medium_tokens
from kvmesh.routing.table import ReplicaTable

BS = 2
REPLICAS = [f"r{i}" for i in range(37)]
MEDIA = ("GPU", "CPU", "DISK", "REMOTE", "STORAGE/fs", "STORAGE:REMOTE")  # and two kept by name
PROMPT = tuple(range(100, 100 + 8 * BS))  # 8 blocks; stores hold prefixes of it (or of others)


def _reference(index: BlockIndex, prompt: PromptKeys) -> dict[str, tuple[tuple[int, int, object], ...]]:
    with index._lock:
        got = match_chain(
            index._table, index._masks, index._low, index._spec.keys, BS, prompt.chain(BS), index._low,
            index._clock(),
            index.media.view,
        )  # fmt: skip
        return {index._names[rid]: tuple(ranges) for rid, ranges in got.items()}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["store", "remove", "spec"]),
            st.integers(0, len(REPLICAS) - 1),
            st.integers(1, 8),  # blocks of the prompt's prefix
            st.sampled_from(MEDIA),
            st.booleans(),  # store: other tokens after the first block (a diverging prefix)
        ),
        max_size=60,
    )
)
def test_array_match_equals_range_walk(ops: list[tuple[str, int, int, str, bool]]) -> None:
    index = BlockIndex(clock=lambda: 50.0)
    hashes = itertools.count(1)
    stored: dict[int, list[tuple[int, ...]]] = {}
    for name in REPLICAS[::3]:
        index.add_replica(name)
    for op, r, n, medium, diverge in ops:
        name = REPLICAS[r]
        if op == "store":
            tokens = PROMPT[: n * BS] if not diverge else PROMPT[:BS] + tuple(range(7, 7 + (n - 1) * BS))
            hs = tuple(next(hashes) for _ in range(n))
            index.store(name, BlockStored(hs, None, tokens, BS, medium=medium))
            stored.setdefault(r, []).append(hs)
        elif op == "remove" and stored.get(r):
            index.remove(name, stored[r].pop(0)[n // 2 :], medium)
        elif op == "spec":
            index.add_speculative(name, PROMPT[: n * BS], ttl_s=1.0 if diverge else -1.0, block_size=BS)
    prompt = PromptKeys(PROMPT)
    got = index.match(prompt)
    want = _reference(index, prompt)
    assert {k: v.ranges for k, v in got.items()} == want
    assert bool(got) == bool(want) and len(got) == len(want) and set(got) == set(want)
    # counts per medium = the ranges' tokens per medium, for every replica
    table = ReplicaTable(REPLICAS)
    req = RoutingRequest(prompt.tokens, prompt=prompt, matches=got)
    tokens = medium_tokens(req, table)
    for i, name in enumerate(REPLICAS):
        row = np.zeros(COLUMNS) if tokens is None else tokens[i]
        by = dict.fromkeys(range(COLUMNS), 0)
        for start, end, med in want.get(name, ()):
            by[column(med)] += end - start
        assert row.tolist() == [float(by[c]) for c in range(COLUMNS)], name
    if tokens is not None:  # the columns are named as the index names the media
        names = medium_columns(req)
        assert names[:4] == ("REMOTE", "DISK", "CPU", "GPU")
        assert set(names[4:]) - {""} == set(index.media.named)
    # and the scorers agree with the dict path over the same matches
    plain = RoutingRequest(prompt.tokens, prompt=prompt, matches={k: v for k, v in got.items()})
    for scorer in (PrefixScorer(index), PrefillScorer()):
        a = scorer.score_array(req, table)
        b = scorer.score_array(plain, table)
        assert np.allclose(a, b, rtol=0, atol=1e-12)
