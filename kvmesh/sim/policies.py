"""Routing policies of the simulator.

``kvmesh``, ``round-robin``, ``least-loaded``, ``prefix``: the router's own pickers
(:func:`kvmesh.router.build_picker`), its :class:`~kvmesh.index.BlockIndex` fed with the
fleet's KV and tier events, its speculative entries, session table and prefill accounting,
as ``kvmesh/router/app.py`` does them per request. Only the transport differs: events
arrive in the index the instant they happen, and block keys are the trace's chained ids
(:meth:`BlockIndex.store_keys`, :meth:`PromptKeys.precomputed`) instead of token hashes.

``llm-d``: llm-d's precise prefix-cache scorer shape over the same index and events: the
fraction of the prompt's blocks held (any medium the events report, no speculative entries),
weight 2, with a KV-cache-utilisation scorer (weight 1) and a queue scorer (weight 1), as in
llm-d's ``guides/precise-prefix-cache-aware`` scheduler config (llm-d/llm-d, EndpointPickerConfig
``precise-prefix-cache-scorer`` 2.0, ``kv-cache-utilization-scorer`` 1.0, ``queue-scorer``
1.0); the router's scorer classes stand in for llm-d's (its queue scorer normalises by the
min-max range, ours by the busiest replica). Picked by the router's own :class:`Picker`.

``cache-aware``: SGLang router's ``cache_aware`` policy: an approximate radix tree per
replica of the prompts *routed* there (not what the replica holds), LRU-bounded; when the
load is balanced, the replica with the longest match if it covers more than
``cache_threshold`` of the prompt, else the one with the smallest tree; when unbalanced
(max - min > 64 requests and max > 1.5 x min), the least loaded. Blocks, not characters.

``oracle``: an infinite cache shared by every replica, placement on the shortest queue.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import xxhash

from kvmesh.index import BlockIndex, PromptKeys
from kvmesh.router import Picker, RouterConfig, build_picker
from kvmesh.router.scorers import (
    KVUtilScorer,
    PrefixScorer,
    QueueScorer,
    RoutingRequest,
    SessionTable,
    prefill_cost,
)
from kvmesh.sim.workload import SimRequest

if TYPE_CHECKING:
    from kvmesh.sim.fleet import Fleet

POLICIES = ("kvmesh", "llm-d", "cache-aware", "least-loaded", "round-robin", "prefix", "oracle")
_M128 = (1 << 128) - 1


def _key(block: int) -> bytes:
    return (block & _M128).to_bytes(16, "little")


class SimClock:
    """The fleet's simulated time, for the index's speculative-entry expiry."""

    fleet: Fleet | None = None

    def __call__(self) -> float:
        return self.fleet.now if self.fleet is not None else 0.0


class RouterPolicy:
    """A router picker over the fleet, with the router's own bookkeeping around it."""

    oracle = False

    def __init__(
        self,
        name: str,
        picker: Picker,
        index: BlockIndex | None,
        speculative: bool,
        config: RouterConfig,
        clock: SimClock | None = None,
    ) -> None:
        self.name = name
        self.picker = picker
        self.index = index
        self.speculative = speculative and index is not None
        self.config = config
        self.sessions: SessionTable | None = None
        self.clock = clock or SimClock()
        self._cost: dict[int, float] = {}

    def bind(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.clock.fleet = fleet
        self.bt = fleet.block_tokens
        self.states = fleet.states
        self.names = list(self.states.names)
        if self.index is not None:
            for n in self.names:
                self.index.add_replica(n)

    def route(self, req: SimRequest, now: float) -> int:
        prompt = PromptKeys.precomputed(req.tokens, {self.bt: tuple(map(_key, req.blocks))})
        head = req.blocks[0] if req.blocks else hash(req.session) & 0xFFFF_FFFF
        key = xxhash.xxh3_64_intdigest((head & _M128).to_bytes(16, "little"))
        rr = RoutingRequest(prompt.tokens, session_id=req.session, key=key, prompt=prompt)
        d = self.picker.pick(rr, self.states)
        i = d.index
        name = self.names[i]
        states = self.states
        # As the router's _acquire: count it in flight, queue its prefill work, speculate.
        cost = (
            prefill_cost(rr, name, self.config.prefill_load_cost)
            if rr.matches is not None
            else float(req.tokens)
        )
        states.in_flight[i] += 1
        states.prefill_tokens[i] += cost
        self._cost[id(req)] = cost
        if self.speculative and self.index is not None:
            self.index.add_speculative(name, prompt, ttl_s=self.config.speculative_ttl_s, block_size=self.bt)
        if self.sessions is not None and req.session:
            self.sessions.record(req.session, name)
        return i

    def stored(self, replica: int, medium: str, blocks: list[int]) -> None:
        if self.index is not None:
            self.index.store_keys(self.names[replica], medium, self.bt, [(b, _key(b)) for b in blocks])

    def removed(self, replica: int, medium: str, blocks: list[int]) -> None:
        if self.index is not None:
            self.index.remove(self.names[replica], blocks, medium)

    def first_token(self, replica: int, req: SimRequest) -> None:
        s = self.states.prefill_tokens
        s[replica] = max(0.0, s[replica] - self._cost.pop(id(req), 0.0))

    def finished(self, replica: int, req: SimRequest) -> None:
        s = self.states.in_flight
        s[replica] = max(0.0, s[replica] - 1)


class CacheAware:
    """SGLang router's cache_aware policy (see the module docstring)."""

    oracle = False

    def __init__(
        self, tree_blocks: int, cache_threshold: float = 0.5, balance_abs: int = 64, balance_rel: float = 1.5
    ):
        self.name = "cache-aware"
        self.cap = tree_blocks
        self.threshold = cache_threshold
        self.abs, self.rel = balance_abs, balance_rel
        self.holders: dict[int, set[int]] = {}  # block → replicas whose tree has it

    def bind(self, fleet: Fleet) -> None:
        self.bt = fleet.block_tokens
        self.trees: list[OrderedDict[int, None]] = [OrderedDict() for _ in fleet.replicas]
        self.load = [0] * len(fleet.replicas)

    def route(self, req: SimRequest, now: float) -> int:
        load = self.load
        lo, hi = min(load), max(load)
        if hi - lo > self.abs and hi > self.rel * lo:
            i = load.index(lo)
        else:
            best: set[int] = set()
            best_n = 0
            alive: set[int] | None = None
            for n, b in enumerate(req.blocks):
                held = self.holders.get(b)
                if not held:
                    break
                alive = set(held) if alive is None else alive & held
                if not alive:
                    break
                best, best_n = alive, n + 1
            if best and best_n * self.bt / max(1, req.tokens) > self.threshold:
                i = min(best, key=lambda r: (load[r], r))
            else:
                sizes = [len(t) for t in self.trees]
                i = sizes.index(min(sizes))
        self._insert(i, req.blocks)
        load[i] += 1
        return i

    def _insert(self, i: int, blocks: tuple[int, ...]) -> None:
        tree = self.trees[i]
        for b in blocks:
            if b in tree:
                tree.move_to_end(b)
            else:
                tree[b] = None
                self.holders.setdefault(b, set()).add(i)
        while len(tree) > self.cap:
            b, _ = tree.popitem(last=False)
            held = self.holders[b]
            held.discard(i)
            if not held:
                del self.holders[b]

    def stored(self, replica: int, medium: str, blocks: list[int]) -> None:
        pass

    def removed(self, replica: int, medium: str, blocks: list[int]) -> None:
        pass

    def first_token(self, replica: int, req: SimRequest) -> None:
        pass

    def finished(self, replica: int, req: SimRequest) -> None:
        self.load[replica] -= 1


class Oracle:
    """Infinite shared cache (the fleet counts every block seen before as a GPU hit) and
    placement on the shortest queue: no policy on real replicas can beat its hit ratio."""

    oracle = True
    name = "oracle"

    def bind(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def route(self, req: SimRequest, now: float) -> int:
        n = len(self.fleet.replicas)
        backlog = [self.fleet.backlog(i) * 1000 + self.fleet.replicas[i].decoding for i in range(n)]
        return backlog.index(min(backlog))

    def stored(self, replica: int, medium: str, blocks: list[int]) -> None:
        pass

    def removed(self, replica: int, medium: str, blocks: list[int]) -> None:
        pass

    def first_token(self, replica: int, req: SimRequest) -> None:
        pass

    def finished(self, replica: int, req: SimRequest) -> None:
        pass


def make(
    name: str, tree_blocks: int, config: RouterConfig | None = None
) -> RouterPolicy | CacheAware | Oracle:
    """A fresh policy by name (see :data:`POLICIES`)."""
    cfg = config or RouterConfig()
    if name == "oracle":
        return Oracle()
    if name == "cache-aware":
        return CacheAware(tree_blocks)
    clock = SimClock()
    if name == "llm-d":
        index = BlockIndex(max_blocks=50_000_000, clock=clock)
        weights = {"GPU": 1.0, "CPU": 1.0, "DISK": 1.0, "REMOTE": 1.0}
        picker = Picker(
            name, [(PrefixScorer(index, weights), 2.0), (KVUtilScorer(), 1.0), (QueueScorer(), 1.0)]
        )
        return RouterPolicy(name, picker, index, speculative=False, config=cfg, clock=clock)
    if name in ("kvmesh", "prefix"):
        index = BlockIndex(max_blocks=50_000_000, clock=clock)
        sessions = SessionTable(cfg.session_capacity)
        picker = build_picker(name, index, sessions, cfg)
        policy = RouterPolicy(name, picker, index, speculative=True, config=cfg, clock=clock)
        policy.sessions = sessions
        return policy
    if name in ("round-robin", "least-loaded"):
        return RouterPolicy(name, build_picker(name, config=cfg), None, speculative=False, config=cfg)
    raise ValueError(f"unknown sim policy {name!r}; valid: {', '.join(POLICIES)}")
