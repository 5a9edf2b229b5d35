"""A batch applied at once leaves the index as its events applied one batch each.

:meth:`BlockIndex.apply` hands a batch's stores and removals to the table as one program
(parents resolved from earlier stores of the batch and checked when they run, removals of a
single-medium replica done in the table, evictions after each store). Random batches with a
small pool of engine hashes (so the engine "reuses" a hash for other tokens and a parent's
hash moves on before its child runs), parents drawn from earlier hashes, two media, removals,
clears and a tight ``max_blocks``: the index fed whole batches must end exactly as one fed
the same events one per batch: the same blocks in the same LRU order, masks, holders and
counters, and the same matches.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvmesh.index import BlockIndex

BS = 2
REPLICAS = ("a", "b")

event_st = st.one_of(
    st.tuples(
        st.just("store"),
        st.integers(0, 11),  # first engine hash of the event (a small pool: reuse happens)
        st.integers(1, 3),  # blocks
        st.one_of(st.none(), st.integers(0, 13)),  # parent engine hash
        st.lists(st.integers(0, 2), min_size=2 * 3, max_size=2 * 3),  # token ids
        st.sampled_from(["GPU", "GPU", "CPU"]),
    ),
    st.tuples(
        st.just("remove"),
        st.lists(st.integers(0, 13), min_size=1, max_size=4),
        st.sampled_from(["GPU", "CPU"]),
    ),
    st.tuples(st.just("clear")),
)


def _event(spec: tuple[Any, ...]) -> Any:
    if spec[0] == "store":
        _, first, n, parent, tokens, medium = spec
        return BlockStored(tuple(range(first, first + n)), parent, tuple(tokens[: n * BS]), BS, medium=medium)
    if spec[0] == "remove":
        return BlockRemoved(tuple(spec[1]), spec[2])
    return AllBlocksCleared()


def _state(index: BlockIndex) -> Any:
    entries = [
        (key, entry[:3], sorted(zip(entry[3::2], entry[4::2], strict=True)))
        for key, entry in index._entries()
    ]
    return entries, index.stats(), {bs: n for bs, n in index._size_blocks.items() if n}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.sampled_from(REPLICAS), st.lists(event_st, min_size=1, max_size=8)), max_size=10),
    st.sampled_from([6, 1000]),
)
def test_a_batch_applies_as_its_events_one_by_one(
    batches: list[tuple[str, list[Any]]], max_blocks: int
) -> None:
    whole, single = BlockIndex(max_blocks=max_blocks), BlockIndex(max_blocks=max_blocks)
    for replica, specs in batches:
        events = tuple(_event(s) for s in specs)
        whole.apply(replica, EventBatch(0.0, events))
        for ev in events:
            single.apply(replica, EventBatch(0.0, (ev,)))
        assert _state(whole) == _state(single)
    for tokens in ([0, 0, 0, 0, 0, 0], [1, 2, 0, 1, 2, 0], [2, 2, 1, 1, 0, 0]):
        got, want = whole.match(tokens), single.match(tokens)
        assert {k: v.ranges for k, v in got.items()} == {k: v.ranges for k, v in want.items()}
