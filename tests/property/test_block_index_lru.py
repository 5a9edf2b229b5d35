"""The block index's LRU bound against a model: which blocks stay, in which order.

The model is an ``OrderedDict`` of prefixes (block size 2, one replica): a store touches each
stored block in turn, a match touches the prompt's blocks from the first until the first one
not held, and a store that leaves more than ``max_blocks`` drops the oldest down to
``max_blocks``. A child whose parent was dropped is an orphan: not stored.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.events import BlockStored, EventBatch
from kvmesh.index import BlockIndex
from kvmesh.index.prefix import query_chain

BS = 2
Prefix = tuple[int, ...]


def _key(prefix: Prefix) -> bytes:
    return query_chain(np.asarray(prefix, dtype=np.uint32), BS, None, None)[-1]


class Model:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.lru: OrderedDict[Prefix, None] = OrderedDict()
        self.evictions = 0

    def touch(self, prefix: Prefix) -> None:
        self.lru.pop(prefix, None)
        self.lru[prefix] = None

    def store(self, parent: Prefix | None, tokens: Prefix) -> None:
        if parent is not None and parent not in self.lru:
            return  # orphan
        prev = parent or ()
        for i in range(len(tokens) // BS):
            prev = prev + tokens[i * BS : (i + 1) * BS]
            self.touch(prev)
        if len(self.lru) > self.max_blocks:
            for _ in range(len(self.lru) - self.max_blocks):
                self.lru.popitem(last=False)
                self.evictions += 1

    def match(self, tokens: Prefix) -> int:
        n = 0
        for i in range(len(tokens) // BS):
            prefix = tokens[: (i + 1) * BS]
            if prefix not in self.lru:
                break
            self.touch(prefix)
            n += BS
        return n


@settings(max_examples=150, deadline=None)
@given(st.integers(4, 200), st.data())
def test_lru_order_and_bound_match_the_model(max_blocks: int, data: st.DataObject) -> None:
    index = BlockIndex(max_blocks=max_blocks)
    model = Model(max_blocks)
    stored: list[Prefix] = []  # prefixes ever stored: parents and prompts come from here
    for _ in range(data.draw(st.integers(1, 60))):
        if data.draw(st.booleans()) if stored else False:
            prompt = data.draw(st.sampled_from(stored)) + tuple(
                data.draw(st.lists(st.integers(0, 1), max_size=4))
            )
            got = index.match(prompt)
            assert (got["a"].tokens if "a" in got else 0) == model.match(prompt)
        else:
            parent = data.draw(st.sampled_from([None, *stored])) if stored else None
            n = data.draw(st.integers(1, 12))
            tokens = tuple(data.draw(st.lists(st.integers(0, 3), min_size=n * BS, max_size=n * BS)))
            start = parent or ()
            hashes = tuple(hash(start + tokens[: (i + 1) * BS]) for i in range(n))  # an engine's: per prefix
            index.apply(
                "a", EventBatch(0.0, (BlockStored(hashes, hash(parent) if parent else None, tokens, BS),))
            )
            model.store(parent, tokens)
            stored.append(start + tokens)
        assert [key for key, _ in index._entries()] == [_key(p) for p in model.lru], "LRU order"
        assert len(index) <= max_blocks
        assert index.stats()["evictions"] == model.evictions
