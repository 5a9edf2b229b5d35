"""Random put/get/delete/restart sequences against a dict model of an LRU disk tier.

The model knows the byte budget (every chunk occupies the same number of bytes), so it
predicts exactly which chunk each put evicts; recency must survive restarts, because the
tier stamps every write and read hit into the file's mtime.
"""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core import serde
from kvmesh.core.keys import KeyBuilder, KVLayout
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import ChunkData, TierOptions
from kvmesh.tiers.disk import DiskTier

LAYOUT = KVLayout(2, 2, 8, "float32")
N_KEYS = 6
CAPACITY_CHUNKS = 3


def _chunks() -> list[ChunkData]:
    tokens = np.arange(N_KEYS * 16, dtype=np.uint32)
    keys = KeyBuilder("prop", LAYOUT, chunk_size=16).keys(tokens)
    return [
        ChunkData(k, LAYOUT, tokens[i * 16 : (i + 1) * 16], np.random.default_rng(i).bytes(16 * 256))
        for i, k in enumerate(keys)
    ]


CHUNKS = _chunks()
_head, _body = serde.encode(CHUNKS[0].key, LAYOUT, CHUNKS[0].tokens, CHUNKS[0].data)
SIZE = len(_head) + memoryview(_body).nbytes
OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "put", "get", "get", "delete", "restart"]), st.integers(0, N_KEYS - 1)
    ),
    min_size=10,
    max_size=60,
)


def _open(path: str, budget: bool) -> DiskTier:
    cap = CAPACITY_CHUNKS * SIZE + SIZE // 2 if budget else None
    return DiskTier(path, TierOptions(capacity_bytes=cap, metrics=TierMetrics("disk")))


def _check_restart(tier: DiskTier, path: str, model: OrderedDict[int, None]) -> None:
    assert set(tier.keys()) == {CHUNKS[i].key.text for i in model}
    assert tier.metrics.counters["corrupt"] == 0
    assert tier.size_bytes() == len(model) * SIZE
    # Contents are read straight from the files: reading through the tier would refresh
    # recency and hide a restart that lost the LRU order.
    by_key = {c.key.text: c for c in CHUNKS}
    for f in Path(path).rglob("*.kvc"):
        header, raw = serde.decode(f.read_bytes(), expected_key=f.name.removesuffix(".kvc"))
        assert bytes(raw) == by_key[header.key].data


@settings(max_examples=100, deadline=None)
@given(ops=OPS, budget=st.sampled_from([True, True, True, False]))
def test_disk_index_matches_model(ops: list[tuple[str, int]], budget: bool) -> None:
    with tempfile.TemporaryDirectory() as path:
        tier = _open(path, budget)
        model: OrderedDict[int, None] = OrderedDict()  # least recently used first
        evictions = 0
        for op, i in ops:
            key = CHUNKS[i].key
            if op == "put":
                if i not in model and budget and len(model) == CAPACITY_CHUNKS:
                    model.popitem(last=False)
                    evictions += 1
                model[i] = None
                model.move_to_end(i)
                assert tier.put([key], [CHUNKS[i]]) == [True]
            elif op == "get":
                got = tier.get([key])[0]
                if i in model:
                    model.move_to_end(i)
                    assert got is not None and bytes(got.data) == CHUNKS[i].data
                else:
                    assert got is None
            elif op == "delete":
                present = i in model
                model.pop(i, None)
                assert tier.delete([key]) == int(present)
            else:
                assert tier.metrics.counters["evictions"] == evictions
                tier.close()
                tier = _open(path, budget)
                evictions = 0
                _check_restart(tier, path, model)
            assert tier.contains([c.key for c in CHUNKS]) == [j in model for j in range(N_KEYS)]
        tier.close()
        _check_restart(_open(path, budget), path, model)
