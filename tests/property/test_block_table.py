"""The block index's columnar table against a dict model, through growth and deletion.

:class:`kvmesh.index.table.BlockTable` keeps rows and holder records in numpy columns with
two open-addressing hash tables (linear probing, backward-shift deletion) and an LRU list in
arrays. It starts tiny here so random holds, unholds, evictions and touches grow every
column and both slot tables many times over, and colliding keys (a few distinct low words)
make long probe runs for the deletions to repair. After every step each key is found or not
as the model says, the LRU order is the model's, and every record is found by its
``(rid, block size, engine hash)``.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.index.table import BlockTable, engine_hash, engine_hashes, key_words

SIZES = (2, 4)
# Keys decide their block size (as the index's chain roots do); few distinct words, so many
# keys share a home slot.
KEYS = [
    (i % 7).to_bytes(8, "little") + (i // 7 + 1000 * bs).to_bytes(8, "little")
    for bs in SIZES
    for i in range(24)
]
KEY_BS = {k: SIZES[i // 24] for i, k in enumerate(KEYS)}


class Model:
    def __init__(self) -> None:
        self.rows: OrderedDict[bytes, set[tuple[int, int]]] = OrderedDict()  # key → {(rid, eh)}, LRU order
        self.recs: dict[tuple[int, int, int], bytes] = {}  # (rid, bs, eh) → key

    def unhold(self, rid: int, key: bytes) -> bool:
        bs = KEY_BS[key]
        for r, eh in [h for h in self.rows[key] if h[0] == rid]:
            self.rows[key].discard((r, eh))
            del self.recs[(r, bs, eh)]
        if self.rows[key]:
            return False
        del self.rows[key]
        return True

    def hold(self, rid: int, key: bytes, eh: int) -> tuple[bool, bytes | None, bool]:
        bs = KEY_BS[key]
        moved, freed = None, False
        old = self.recs.get((rid, bs, eh))
        if old is not None and old != key:
            moved, freed = old, self.unhold(rid, old)
        new = key not in self.rows
        if new:
            self.rows[key] = set()
        self.rows.move_to_end(key)
        if (rid, bs, eh) not in self.recs:
            self.rows[key].add((rid, eh))
            self.recs[(rid, bs, eh)] = key
        return new, moved, freed


op_st = st.one_of(
    st.tuples(
        st.just("hold"),
        st.integers(0, 5),
        st.sampled_from(SIZES),
        st.lists(st.tuples(st.integers(0, 23), st.integers(0, 40)), min_size=1, max_size=12),
    ),
    st.tuples(st.just("unhold"), st.integers(0, 5), st.integers(0, len(KEYS) - 1)),
    st.tuples(st.just("evict"), st.integers(1, 6)),
    st.tuples(st.just("touch"), st.lists(st.integers(0, len(KEYS) - 1), max_size=8)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op_st, max_size=80))
def test_table_matches_the_model(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    table, model = BlockTable(rows=2), Model()
    for op in ops:
        if op[0] == "hold":
            _, rid, bs, blocks = op
            keys = [KEYS[SIZES.index(bs) * 24 + i] for i, _ in blocks]
            ehs = [eh * 1_000_003 - 17 for _, eh in blocks]  # negative ones too
            got = table.hold(rid, bs, keys, list(ehs))
            assert got is not None
            for (row, new, moved, freed), key, eh in zip(got, keys, ehs, strict=True):
                want_new, want_moved, want_freed = model.hold(rid, key, eh)
                assert (bool(new), moved >= 0, bool(freed)) == (want_new, want_moved is not None, want_freed)
                # a row freed later in the same call (its hash moved on) may hold another key now
                if not any(f for *_, f in got):
                    assert table.key(row) == key
        elif op[0] == "unhold":
            _, rid, k = op
            key = KEYS[k]
            if key in model.rows:
                (row,) = table.find(key_words([key]))
                assert bool(table.unhold(rid, [row])[0][0]) == model.unhold(rid, key)
        elif op[0] == "evict":
            got = table.evict(op[1])
            want = list(model.rows)[: op[1]]
            for key in want:
                for rid, eh in model.rows[key]:
                    del model.recs[(rid, KEY_BS[key], eh)]
                del model.rows[key]
            assert [table.key(row) for row, _ in got] == want
            assert [bs for _, bs in got] == [KEY_BS[k] for k in want]
        else:
            keys = [KEYS[k] for k in op[1]]
            table.touch(table.find(key_words(keys)) if keys else [])
            for key in keys:
                if key in model.rows:
                    model.rows.move_to_end(key)
        _check(table, model)


def _check(table: BlockTable, model: Model) -> None:
    assert len(table) == len(model.rows) and table.records == len(model.recs)
    rows = table.find(key_words(KEYS))
    assert {k for k, r in zip(KEYS, rows, strict=True) if r >= 0} == set(model.rows)
    assert [table.key(r) for r in table.lru()] == list(model.rows)
    for key, row in zip(KEYS, rows, strict=True):
        if row >= 0:
            assert set(table.holders(row)) == model.rows[key]
            assert table.block_size(row) == KEY_BS[key]
    for (rid, bs, eh), key in model.recs.items():
        assert table.key(table.held(rid, bs, eh)) == key


def test_engine_hashes_are_64_bit_ints_whatever_the_engine_sends() -> None:
    """vLLM sends 32-byte hashes by default, 64-bit ints with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES."""
    big = (1 << 64) - 1
    got = engine_hashes([5, big, 1 << 63])
    assert got.dtype == np.int64 and got.tolist() == [5, -1, -(1 << 63)]
    assert engine_hashes([-3, 7]).tolist() == [-3, 7]  # vLLM's legacy builtin hash can be negative
    digest = bytes(range(32))
    mixed = engine_hashes([1, digest, 1 << 70])
    assert mixed.tolist() == [1, engine_hash(digest), engine_hash(1 << 70)]
    assert engine_hash(digest) != engine_hash(bytes(range(1, 33)))
    # a digest that happens to be ASCII digits is still hashed, never parsed as a number
    assert engine_hashes([1, b"12"]).tolist() == [1, engine_hash(b"12")]
    assert engine_hash(b"12") != 12
