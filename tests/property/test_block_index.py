"""Random event streams: the BlockIndex must answer exactly like a naive reference model.

The model keys blocks by (block size, full token prefix) — no hashing, no bit masks, no LRU —
and answers a query by walking the prompt block by block for every replica and size. Media
without an alias are kept by name (at most four; a fifth is not indexed), ranked below the
replica's own disk: local ones above those on another host, then in the order met.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvmesh.index import BlockIndex
from kvmesh.index.table import key_words

REPLICAS = ("a", "b", "c")
SIZES = (2, 4)
MEDIUMS = (None, "GPU", "CPU", "DISK", "REMOTE", "STORAGE", "cpu", "x1", "STORAGE:REMOTE", "x2", "x3", "x4")
Prefix = tuple[int, ...]
# the model's own ranking: REMOTE, named media on another host, local named media, DISK, CPU, GPU
_ALIAS = {"GPU": "GPU", "CPU": "CPU", "DISK": "DISK", "STORAGE": "DISK", "REMOTE": "REMOTE"}
_RANK = {"REMOTE": 0, "DISK": 50, "CPU": 60, "GPU": 70}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Model:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.replicas: set[str] = set()
        # replica -> block size -> engine hash -> prefix (dict order mirrors the index's)
        self.emap: dict[str, dict[int, dict[Any, Prefix]]] = {}
        self.held: dict[str, dict[tuple[int, Prefix], set[str]]] = {}
        self.spec: list[tuple[str, int, Prefix, float]] = []
        self.seen: set[Prefix] = set()  # every prefix ever stored: queries come from here
        self.ever: set[Any] = set()  # every engine hash ever stored: parents come from here
        self.named: list[str] = []  # media without an alias, in the order met

    def medium(self, name: str | None, register: bool) -> str | None:
        if name is None:
            return "GPU"
        name = name.upper()  # the medium's part of a name is case-blind
        if name in _ALIAS:
            return _ALIAS[name]
        if name not in self.named and register and len(self.named) < 4:
            self.named.append(name)
        return name if name in self.named else None

    def rank(self, medium: str) -> int:
        if medium in _RANK:
            return _RANK[medium]
        return (10 if ":REMOTE" in medium else 20) + self.named.index(medium)

    def register(self, r: str) -> None:
        if r not in self.replicas:
            self.replicas.add(r)
            self.emap[r] = {}
            self.held[r] = {}

    def _drop(self, r: str, bs: int, prefix: Prefix) -> None:
        self.held[r].pop((bs, prefix), None)
        maps = self.emap[r][bs]
        for eh in [eh for eh, p in maps.items() if p == prefix]:
            del maps[eh]

    def store(self, r: str, ev: BlockStored) -> None:
        self.register(r)
        med = self.medium(ev.medium, register=True)
        if med is None:
            return  # a fifth medium without an alias
        bs = ev.block_size
        maps = self.emap[r].setdefault(bs, {})
        if ev.parent_block_hash is None:
            prev: Prefix = ()
        elif ev.parent_block_hash in maps:
            prev = maps[ev.parent_block_hash]
        else:
            return  # orphan
        for i, eh in enumerate(ev.block_hashes):
            prefix = prev + ev.token_ids[i * bs : (i + 1) * bs]
            old = maps.get(eh)
            if old is not None and old != prefix:
                self._drop(r, bs, old)
            self.held[r].setdefault((bs, prefix), set()).add(med)
            self.seen.add(prefix)
            maps[eh] = prefix
            self.ever.add(eh)
            prev = prefix

    def remove(self, r: str, hashes: tuple[Any, ...], medium: str | None) -> None:
        if r not in self.replicas:
            return
        med = self.medium(medium, register=False)
        for eh in hashes:
            for bs, maps in self.emap[r].items():
                prefix = maps.get(eh)
                if prefix is None or med not in self.held[r].get((bs, prefix), set()):
                    continue
                meds = self.held[r][(bs, prefix)]
                meds.discard(med)  # type: ignore[arg-type]
                if not meds:
                    self._drop(r, bs, prefix)
                break

    def clear(self, r: str) -> None:
        if r in self.replicas:
            self.held[r] = {}
            for maps in self.emap[r].values():
                maps.clear()
            self.spec = [s for s in self.spec if s[0] != r]

    def remove_replica(self, r: str) -> None:
        if r in self.replicas:
            self.clear(r)
            self.replicas.discard(r)
            del self.emap[r], self.held[r]

    def add_spec(self, r: str, tokens: Prefix, bs: int, ttl: float) -> None:
        self.register(r)
        for i in range(1, len(tokens) // bs + 1):
            self.spec.append((r, bs, tokens[: i * bs], self.clock.t + ttl))
        self.seen.add(tokens)

    def mediums(self, r: str, bs: int, prefix: Prefix) -> set[str]:
        out = set(self.held[r].get((bs, prefix), set()))
        if any("REMOTE" in self.held[o].get((bs, prefix), set()) for o in self.replicas):
            out.add("REMOTE")
        if any(s[:3] == (r, bs, prefix) and s[3] > self.clock.t for s in self.spec):
            out.add("GPU")
        return out

    def match(self, tokens: Prefix) -> dict[str, tuple[tuple[int, int, str], ...]]:
        out = {}
        for r in self.replicas:
            best: list[str] = []  # best medium per token position
            for bs in SIZES:
                for i in range(len(tokens) // bs):
                    meds = self.mediums(r, bs, tokens[: (i + 1) * bs])
                    if not meds:
                        break
                    top = max(meds, key=self.rank)
                    for t in range(i * bs, (i + 1) * bs):
                        if t == len(best):
                            best.append(top)
                        else:
                            best[t] = max(best[t], top, key=self.rank)
            ranges: list[tuple[int, int, str]] = []
            for t, med in enumerate(best):
                if ranges and ranges[-1][2] == med:
                    ranges[-1] = (ranges[-1][0], t + 1, med)
                else:
                    ranges.append((t, t + 1, med))
            if ranges:
                out[r] = tuple(ranges)
        return out


def check_internal_links(index: BlockIndex) -> None:
    """Rows, holder records and masks agree, and nothing dangles.

    Every live row is found by its key, has a mask shifted down to its lowest holder (so its
    lowest byte is never empty) whose non-empty bytes are exactly its records' replicas, and
    each record is found again by ``(rid, block size, engine hash)``. Freed rows have no
    mask, and the per-size counts are the live rows'.
    """
    table = index._table
    entries = index._entries()
    assert len(entries) == len(table) == sum(p is not None for p in index._masks)
    keys = [key for key, _ in entries]
    rows = table.find(key_words(keys)) if keys else []
    assert sorted(rows) == sorted(table.lru()) and -1 not in rows
    records = 0
    sizes: dict[int, int] = {}
    for row, (key, entry) in zip(rows, entries, strict=True):
        m, shift, bs = entry[0], entry[1], entry[2]
        assert table.key(row) == key
        assert m & 0xFF and shift % 8 == 0, "mask not shifted down to its lowest holder"
        mask = m << shift
        pairs = list(zip(entry[3::2], entry[4::2], strict=True))
        assert {rid for rid, _ in pairs} == {rid for rid in index._rid_sizes if (mask >> (8 * rid)) & 0xFF}
        for rid, eh in pairs:
            assert table.held(rid, bs, eh) == row, "a holder record not found by its engine hash"
        records += len(pairs)
        sizes[bs] = sizes.get(bs, 0) + 1
    assert records == table.records
    assert {bs: n for bs, n in index._size_blocks.items() if n} == sizes


tokens_st = st.lists(st.integers(0, 1), max_size=12).map(tuple)


def _known_prefix(data: st.DataObject, model: Model) -> Prefix:
    prefixes = sorted(model.seen)
    base: Prefix = data.draw(st.sampled_from(prefixes)) if prefixes else ()
    return base + data.draw(tokens_st)


@pytest.mark.parametrize("gap", [0, 40])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_index_matches_reference_model(gap: int, data: st.DataObject) -> None:
    """``gap``: idle replicas registered between a, b and c, so that their ids lie far apart:
    the entries' masks are kept shifted down to their lowest holder, and a holder below it,
    or the lowest one leaving, moves the shift by whole multi-byte steps."""
    clock = Clock()
    index = BlockIndex(max_blocks=10_000, clock=clock)
    model = Model(clock)
    for name in REPLICAS if gap else ():
        for r in (name, *(f"{name}-idle{i}" for i in range(gap))):
            index.add_replica(r)
            model.register(r)
    history: list[BlockStored] = []
    for _ in range(data.draw(st.integers(1, 30))):
        op = data.draw(
            st.sampled_from(["store"] * 4 + ["copy"] * 2 + ["remove"] * 3 + ["clear", "drop", "spec", "tick"])
        )
        r = data.draw(st.sampled_from(REPLICAS))
        if op == "store":
            bs = data.draw(st.sampled_from(SIZES))
            n = data.draw(st.integers(1, 3))
            # Parents the replica holds now, held once (removed or evicted since), or never held.
            known = sorted(model.emap.get(r, {}).get(bs, {}))
            parent = data.draw(st.sampled_from([None, 99, *known, *known, *sorted(model.ever)]))
            toks = tuple(data.draw(st.lists(st.integers(0, 1), min_size=n * bs, max_size=n * bs)))
            if data.draw(st.booleans()):
                hashes = tuple(data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)))
            else:
                # Like a real engine: the same prefix always gets the same hash, so stores in
                # several media and removals of one of them meet on the same block.
                start = model.emap.get(r, {}).get(bs, {}).get(parent, ()) if parent is not None else ()
                hashes = tuple(hash((bs, start + toks[: (i + 1) * bs])) % 1000 + 100 for i in range(n))
            ev = BlockStored(hashes, parent, toks, bs, medium=data.draw(st.sampled_from(MEDIUMS)))
            index.apply(r, EventBatch(0.0, (ev,)))
            model.store(r, ev)
            history.append(ev)
        elif op == "copy":
            # The same blocks again in another medium (an offload) or on another replica.
            if not history:
                continue
            ev = msgspec.structs.replace(
                data.draw(st.sampled_from(history)), medium=data.draw(st.sampled_from(MEDIUMS))
            )
            index.apply(r, EventBatch(0.0, (ev,)))
            model.store(r, ev)
        elif op == "remove":
            pool = sorted({eh for maps in model.emap.get(r, {}).values() for eh in maps}) or [0]
            hashes = tuple(data.draw(st.lists(st.sampled_from(pool), max_size=3)))
            medium = data.draw(st.sampled_from(MEDIUMS))
            index.apply(r, EventBatch(0.0, (BlockRemoved(hashes, medium),)))
            model.remove(r, hashes, medium)
        elif op == "clear":
            index.apply(r, EventBatch(0.0, (AllBlocksCleared(),)))
            model.clear(r)
        elif op == "drop":
            index.remove_replica(r)
            model.remove_replica(r)
        elif op == "spec":
            bs = data.draw(st.sampled_from(SIZES))
            toks = _known_prefix(data, model)
            ttl = data.draw(st.sampled_from([0.5, 1.0, 2.0]))
            index.add_speculative(r, toks, ttl_s=ttl, block_size=bs)
            model.add_spec(r, toks, bs, ttl)
        else:
            clock.t += data.draw(st.sampled_from([0.25, 0.5, 1.0]))
        query = _known_prefix(data, model)
        got = {name: tuple((a, b, m.name) for a, b, m in m.ranges) for name, m in index.match(query).items()}
        assert got == model.match(query), f"query {query}"
        assert set(index.replicas()) == model.replicas
        check_internal_links(index)
    # Every block still indexed is held by someone, and nothing leaks after everyone leaves.
    for r in REPLICAS:
        index.remove_replica(r)
    assert len(index) == 0 and index.match((0, 1, 0, 1)) == {}
