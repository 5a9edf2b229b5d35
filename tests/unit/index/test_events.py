"""Batch-level token preparation: same holdings as one event at a time, bad events isolated."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.events import BlockStored, EventBatch
from kvmesh.index import BlockIndex
from kvmesh.index.events import batch_tokens


def chain_events(
    tokens: np.ndarray, n: int, bad: int | None = None, bad_id: object = -1
) -> list[BlockStored]:
    evs = []
    parent = None
    for i in range(n):
        toks = tuple(int(t) for t in tokens[i * 32 : (i + 1) * 32])
        if i == bad:
            toks = (bad_id, *toks[1:])  # type: ignore[assignment]  # this event is invalid
        evs.append(BlockStored((10 * i, 10 * i + 1), parent, toks, 16))
        parent = 10 * i + 1
    return evs


def test_a_batch_indexes_exactly_like_its_events_one_by_one() -> None:
    tokens = np.random.default_rng(0).integers(0, 50_000, 256).astype(np.uint32)
    evs = chain_events(tokens, 8)
    assert len(batch_tokens(evs)) == 8
    one, many = BlockIndex(), BlockIndex()
    one.apply("a", EventBatch(0.0, tuple(evs)))
    for ev in evs:
        many.apply("a", EventBatch(0.0, (ev,)))
    assert one.match(tokens) == many.match(tokens) and one.match(tokens)["a"].tokens == 256
    assert one.stats() == many.stats()


@pytest.mark.parametrize("bad_id", [-1, 2**32, 2**70, 1.5, "7", None])
def test_one_bad_event_leaves_its_neighbours_indexed(bad_id: object) -> None:
    tokens = np.random.default_rng(1).integers(0, 50_000, 256).astype(np.uint32)
    evs = chain_events(tokens, 8, bad=5, bad_id=bad_id)
    assert batch_tokens(evs) == {}  # falls back to one event at a time
    idx = BlockIndex()
    idx.apply("a", EventBatch(0.0, tuple(evs)))
    s = idx.stats()
    assert s["invalid"] == 1 and s["orphans"] == 2  # events 6 and 7 chain onto the bad one
    assert idx.match(tokens)["a"].tokens == 5 * 32
