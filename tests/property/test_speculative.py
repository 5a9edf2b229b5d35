"""The speculative table against a model: random adds (renewing, shorter-lived, shared between
replicas), expiries and drops; after each step every key's holder bits, each replica's
holders and the count of (key, replica) pairs are exactly the model's."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.index.media import BITS, GPU_BIT
from kvmesh.index.speculative import SpeculativeTable

KEYS = [bytes([i]) * 16 for i in range(5)]  # few: adds overlap often

_add = st.tuples(
    st.just("add"),
    st.integers(0, 2),  # rid
    st.lists(st.sampled_from(KEYS), min_size=0, max_size=5),  # keys (repeats allowed)
    st.sampled_from([0.5, 1.0, 2.0, 3.0]),  # ttl: a shorter one after a longer one too
)
_tick = st.tuples(st.just("tick"), st.sampled_from([0.25, 0.5, 1.0]))
_drop = st.tuples(st.just("drop"), st.integers(0, 2))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_add, _add, _tick, _drop), max_size=40))
def test_speculative_table_matches_a_model(ops: list[tuple[object, ...]]) -> None:
    table = SpeculativeTable()
    model: dict[tuple[bytes, int], float] = {}  # (key, rid) → expiry
    now = 0.0
    for op in ops:
        if op[0] == "add":
            _, rid, keys, ttl = op
            assert isinstance(rid, int) and isinstance(keys, list) and isinstance(ttl, float)
            table.expire(now)
            table.add(rid, 16, tuple(keys), now + ttl)
            for key in keys:
                model[key, rid] = max(model.get((key, rid), 0.0), now + ttl)
        elif op[0] == "tick":
            assert isinstance(op[1], float)
            now += op[1]
            table.expire(now)
        else:
            rid = op[1]
            table.drop(rid)  # type: ignore[arg-type]
            model = {k: e for k, e in model.items() if k[1] != rid}
        model = {k: e for k, e in model.items() if e > now}
        want: dict[bytes, int] = {}
        for key, rid in model:
            want[key] = want.get(key, 0) | 1 << (BITS * rid + GPU_BIT)
        assert table.keys == want
        assert len(table) == len(model)
        for key in KEYS:
            assert table.holders(key, now) == sorted(r for k, r in model if k == key)
