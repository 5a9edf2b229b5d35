"""Routing policies of the simulator.

``kvmesh``, ``round-robin``, ``least-loaded``, ``prefix``: the routing core's pickers
(:func:`kvmesh.routing.picker.build_picker`) and its dispatcher
(:class:`kvmesh.routing.dispatcher.Dispatcher`: match, pick, the request counted in flight
with its prefill work until its first token, speculative entries, sessions), the same code
``kvmesh router`` and ``kvmesh epp`` run per request, over a :class:`~kvmesh.index.BlockIndex`
fed with the fleet's KV and tier events. Only the transport differs: events arrive in the
index the instant they happen, block keys are the trace's chained ids
(:meth:`BlockIndex.store_keys`, :meth:`PromptKeys.precomputed`) instead of token hashes, and
the requests are counted on the fleet's table (:class:`kvmesh.routing.pool.TableLedger`).

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

``infinite-cache``: an infinite cache shared by every replica, placement on the shortest
queue. A reference point, not a ceiling: a policy that queues a request behind the one
computing its prefix can hit more, and wait less than it recomputes. The ceiling of the hit
ratio and the floors of TTFT are :mod:`kvmesh.sim.bound`, computed, not simulated.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import xxhash

from kvmesh.index import BlockIndex, PromptKeys
from kvmesh.routing.config import RoutingConfig
from kvmesh.routing.dispatcher import Dispatcher, InlineTimers, Ticket
from kvmesh.routing.picker import Picker, build_picker
from kvmesh.routing.pool import TableLedger
from kvmesh.routing.scorers import KVUtilScorer, PrefixScorer, QueueScorer, RoutingRequest
from kvmesh.routing.sessions import SessionTable
from kvmesh.sim.workload import SimRequest

if TYPE_CHECKING:
    from kvmesh.sim.fleet import Fleet

POLICIES = (
    "kvmesh",
    "cost",
    "llm-d",
    "cache-aware",
    "least-loaded",
    "round-robin",
    "prefix",
    "infinite-cache",
)
_M128 = (1 << 128) - 1


def _key(block: int) -> bytes:
    return (block & _M128).to_bytes(16, "little")


def _blockless(req: SimRequest) -> bytes:
    """What keys a prompt shorter than a block (its ties' rendezvous hash): its session, else
    its arrival and length, as the router keys a prompt it cannot tokenize by its body. Not
    ``hash()``: a str's changes with PYTHONHASHSEED and None's with the process's addresses
    (Python 3.11), so a trace with such prompts gave other figures in every run."""
    if req.session is not None:
        return req.session.encode()
    return f"{req.arrival_s!r}|{req.tokens}".encode()


class SimClock:
    """The fleet's simulated time, for the index's speculative-entry expiry."""

    fleet: Fleet | None = None

    def __call__(self) -> float:
        return self.fleet.now if self.fleet is not None else 0.0


class RouterPolicy:
    """The routing core's dispatcher over the fleet (see the module docstring)."""

    def __init__(
        self,
        name: str,
        picker: Picker,
        index: BlockIndex | None,
        speculative: bool,
        config: RoutingConfig,
        clock: SimClock | None = None,
        sessions: SessionTable | None = None,
    ) -> None:
        self.name = name
        self.picker = picker
        self.index = index
        self.speculative = speculative and index is not None
        self.config = config
        self.sessions = sessions
        self.clock = clock or SimClock()
        self._tickets: dict[int, Ticket] = {}

    def bind(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.clock.fleet = fleet
        self.bt = fleet.block_tokens
        self.states = fleet.states
        if self.index is not None:
            for n in self.states.names:
                self.index.add_replica(n)
        self.dispatcher = Dispatcher(
            self.config,
            TableLedger(self.states),
            self.picker,
            index=self.index,
            sessions=self.sessions,
            timers=InlineTimers(),
            speculative=self.speculative,
            speculative_block_size=self.bt,
        )

    def route(self, req: SimRequest, now: float) -> int:
        prompt = PromptKeys.precomputed(req.tokens, {self.bt: tuple(map(_key, req.blocks))})
        key = xxhash.xxh3_64_intdigest(_key(req.blocks[0]) if req.blocks else _blockless(req))
        rr = RoutingRequest(prompt.tokens, session_id=req.session, key=key, prompt=prompt)
        ticket = self.dispatcher.route(rr, self.states, stream=True, limit=1)  # first token: TTFT
        name = ticket.ranked[0]
        ticket.sent(name)
        ticket.served(name, 200)  # a simulated replica always answers
        self._tickets[id(req)] = ticket
        d = ticket.decision
        return d.index if d is not None else self.states.names.index(name)

    def stored(self, replica: int, medium: str, blocks: list[int]) -> None:
        if self.index is not None:
            self.index.store_keys(self.states.names[replica], medium, self.bt, [(b, _key(b)) for b in blocks])

    def removed(self, replica: int, medium: str, blocks: list[int]) -> None:
        if self.index is not None:
            self.index.remove(self.states.names[replica], blocks, medium)

    def first_token(self, replica: int, req: SimRequest) -> None:
        ticket = self._tickets.get(id(req))
        if ticket is not None:
            ticket.first_byte()

    def finished(self, replica: int, req: SimRequest) -> None:
        ticket = self._tickets.pop(id(req), None)
        if ticket is not None:
            ticket.finished()


class CacheAware:
    """SGLang router's cache_aware policy (see the module docstring)."""

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


class InfiniteCache:
    """Infinite shared cache (the fleet counts every block prefilled before as a GPU hit) and
    placement on the shortest queue. Not a ceiling (see the module docstring)."""

    infinite_cache = True
    name = "infinite-cache"

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
    name: str, tree_blocks: int, config: RoutingConfig | None = None
) -> RouterPolicy | CacheAware | InfiniteCache:
    """A fresh policy by name (see :data:`POLICIES`)."""
    cfg = config or RoutingConfig()
    if name == "infinite-cache":
        return InfiniteCache()
    if name == "cache-aware":
        return CacheAware(tree_blocks)
    clock = SimClock()
    if name == "llm-d":
        index = BlockIndex(max_blocks=50_000_000, clock=clock)
        weights = {"GPU": 1.0, "CPU": 1.0, "DISK": 1.0, "REMOTE": 1.0, "OTHER": 1.0}
        lld = Picker(name, [(PrefixScorer(index, weights), 2.0), (KVUtilScorer(), 1.0), (QueueScorer(), 1.0)])
        return RouterPolicy(name, lld, index, speculative=False, config=cfg, clock=clock)
    if name == "cost":  # the router's cost picker, on the fleet's clock (costpolicy.py)
        from kvmesh.routing.cost import build_cost_picker
        from kvmesh.sim.costpolicy import CostPolicy

        index = BlockIndex(max_blocks=50_000_000, clock=clock)
        cost = build_cost_picker(index, cfg, clock)
        sessions = SessionTable(cfg.session_capacity)
        return CostPolicy(name, cost, index, speculative=True, config=cfg, clock=clock, sessions=sessions)
    if name in ("kvmesh", "prefix"):
        index = BlockIndex(max_blocks=50_000_000, clock=clock)
        sessions = SessionTable(cfg.session_capacity)
        picker = build_picker(name, index, sessions, cfg)
        return RouterPolicy(name, picker, index, speculative=True, config=cfg, clock=clock, sessions=sessions)
    if name in ("round-robin", "least-loaded"):
        return RouterPolicy(name, build_picker(name, config=cfg), None, speculative=False, config=cfg)
    raise ValueError(f"unknown sim policy {name!r}; valid: {', '.join(POLICIES)}")
