"""The discrete-event fleet: replicas with a GPU prefix cache, kvmesh tiers, queues, a router.

Each replica has vLLM's GPU prefix cache (LRU over blocks, ``gpu_blocks``) and, when
enabled, kvmesh's per-replica CPU and disk tiers (LRU) and one shared tier for the fleet.
kvmesh saves every block a prefill computed or loaded to its tiers (write-through), so a
tier holds the most recently *used* blocks. A prefill takes the prompt's longest cached
prefix, each block from the best place that holds it (GPU, then CPU, disk, shared), and
computes the rest. Prefills run one at a time per replica, in arrival order; decodes run
beside them (see :mod:`kvmesh.sim.cost` for the time model and its batch effects).

Every cache change is reported to the policy as the replica would report it: GPU changes
as vLLM's KV events, tier changes as kvmesh's tier events (medium CPU, DISK, REMOTE).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmesh.routing.table import ReplicaTable
from kvmesh.sim.cost import CostProfile
from kvmesh.sim.workload import SimRequest, Workload


class Policy(Protocol):
    """A routing policy. One with ``infinite_cache = True`` (optional attribute) has every
    block prefilled before as a GPU hit on any replica, instead of the fleet's caches."""

    name: str

    def bind(self, fleet: Fleet) -> None: ...
    def route(self, req: SimRequest, now: float) -> int: ...
    def stored(self, replica: int, medium: str, blocks: list[int]) -> None: ...
    def removed(self, replica: int, medium: str, blocks: list[int]) -> None: ...
    def first_token(self, replica: int, req: SimRequest) -> None: ...
    def finished(self, replica: int, req: SimRequest) -> None: ...


@dataclass(frozen=True, slots=True)
class FleetConfig:
    replicas: int
    gpu_blocks: int
    cpu_blocks: int = 0  # kvmesh CPU tier per replica; 0 = none
    disk_blocks: int = 0  # kvmesh disk tier per replica; 0 = none
    shared_blocks: int = 0  # kvmesh shared tier (Redis / fs) for the fleet; 0 = none
    # A mixed fleet: each replica's prefill time multiplier, cycled over the replicas ((1, 2):
    # every other replica prefills at half the rate); () = every replica the profile's.
    slowdowns: tuple[float, ...] = ()

    def slowdown(self, i: int) -> float:
        """Replica ``i``'s prefill time multiplier."""
        return self.slowdowns[i % len(self.slowdowns)] if self.slowdowns else 1.0

    def capacity(self) -> float:
        """The fleet's prefill capacity in replicas of the profile's rate."""
        return sum(1.0 / self.slowdown(i) for i in range(self.replicas))


class _LRU:
    """Blocks in recency order; ``touch`` returns (new blocks, evicted blocks)."""

    __slots__ = ("cap", "d")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.d: OrderedDict[int, Any] = OrderedDict()

    def touch(self, blocks: tuple[int, ...], value: Any = None) -> tuple[list[int], list[tuple[int, Any]]]:
        d = self.d
        new = []
        for b in blocks:
            if b in d:
                d.move_to_end(b)
            else:
                d[b] = value
                new.append(b)
        evicted = []
        while len(d) > self.cap:
            evicted.append(d.popitem(last=False))
        return new, evicted


@dataclass(slots=True)
class _Replica:
    gpu: _LRU
    cpu: _LRU | None
    disk: _LRU | None
    queue: deque[tuple[SimRequest, float]] = field(default_factory=deque)
    busy: bool = False
    decoding: int = 0
    active_blocks: int = 0
    served: int = 0
    busy_s: float = 0.0


@dataclass(slots=True)
class Record:
    replica: int
    arrival_s: float
    ttft_s: float
    done_s: float
    tokens: int
    hit: tuple[int, int, int, int]  # tokens from GPU, CPU, disk, shared


_ARRIVE, _PREFILLED, _DONE = 0, 1, 2


class Fleet:
    def __init__(
        self, config: FleetConfig, cost: CostProfile, block_tokens: int, policy: Policy, seed: int = 0
    ) -> None:
        self.config = config
        self.cost = cost
        self.block_tokens = block_tokens
        self.policy = policy
        self.replicas = [
            _Replica(
                _LRU(config.gpu_blocks),
                _LRU(config.cpu_blocks) if config.cpu_blocks else None,
                _LRU(config.disk_blocks) if config.disk_blocks else None,
            )
            for i in range(config.replicas)
        ]
        # What the router's scorers see, as the pool would report it: updated in place.
        self.states = ReplicaTable([f"r{i}" for i in range(config.replicas)])
        self.shared = _LRU(config.shared_blocks) if config.shared_blocks else None
        self.infinite = bool(getattr(policy, "infinite_cache", False))
        self.seen: set[int] = set()  # the infinite cache of such a policy
        self.records: list[Record] = []
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self._rng = random.Random(seed)  # service-time jitter; seeded: a run replays exactly
        self._slow = [config.slowdown(i) for i in range(config.replicas)]
        self._rest: dict[int, tuple[SimRequest, ...]] = {}  # closed loop: a session's later turns
        policy.bind(self)

    def backlog(self, i: int) -> int:
        """Requests queued or prefilling on replica ``i`` (what infinite-cache places by)."""
        r = self.replicas[i]
        return len(r.queue) + r.busy

    def _push(self, t: float, kind: int, item: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, item))

    def run(self, work: Workload, on_done: Callable[[], None] | None = None) -> list[Record]:
        """Play ``work`` to the end; one :class:`Record` per request, in completion order."""
        sessions: Iterator[tuple[SimRequest, ...]] = iter(work.sessions)
        for req in work.requests:
            self._push(req.arrival_s, _ARRIVE, (req, None))
        for _ in range(work.concurrency):
            self._next_session(sessions, 0.0)
        while self._events:
            t, _, kind, item = heapq.heappop(self._events)
            self.now = t
            if kind == _ARRIVE:
                req, rest = item
                i = self.policy.route(req, t)
                r = self.replicas[i]
                r.queue.append((req, t))
                self.states.waiting[i] = len(r.queue)
                if rest is not None:
                    self._rest[id(req)] = rest
                if not r.busy:
                    self._start(i)
            elif kind == _PREFILLED:
                self._prefilled(item)
            else:
                i, req, rec = item
                r = self.replicas[i]
                r.decoding -= 1
                r.active_blocks -= len(req.blocks)
                self._sync(i)
                self.policy.finished(i, req)
                self.records.append(rec)
                if on_done is not None:
                    on_done()
                rest = self._rest.pop(id(req), None)
                if rest:
                    self._push(t, _ARRIVE, (rest[0], rest[1:]))
                elif rest is not None:
                    self._next_session(sessions, t)
        return self.records

    def _next_session(self, sessions: Iterator[tuple[SimRequest, ...]], t: float) -> None:
        turns = next(sessions, None)
        if turns:
            self._push(t, _ARRIVE, (turns[0], turns[1:]))

    def _noise(self) -> float:
        sigma = self.cost.jitter
        return self._rng.lognormvariate(-0.5 * sigma * sigma, sigma) if sigma > 0 else 1.0

    def _sync(self, i: int) -> None:
        r, s = self.replicas[i], self.states
        s.waiting[i] = len(r.queue)
        s.running[i] = r.decoding + r.busy
        s.kv_usage[i] = min(1.0, r.active_blocks / max(1, self.config.gpu_blocks))

    def _start(self, i: int) -> None:
        r = self.replicas[i]
        req, arrived = r.queue.popleft()
        bt = self.block_tokens
        g = c = dk = sh = 0
        if self.infinite:
            for b in req.blocks:
                if b not in self.seen:
                    break
                g += 1
        else:
            gpu, cpu, disk, shared = r.gpu.d, r.cpu, r.disk, self.shared
            for b in req.blocks:
                if b in gpu:
                    g += 1
                elif cpu is not None and b in cpu.d:
                    c += 1
                elif disk is not None and b in disk.d:
                    dk += 1
                elif shared is not None and b in shared.d:
                    sh += 1
                else:
                    break
        if c or dk or sh:  # the connector never loads what it computes sooner
            c, dk, sh = (n // bt for n in self.cost.worth_loading(c * bt, dk * bt, sh * bt))
        hit = g + c + dk + sh
        computed = max(0, req.tokens - hit * bt)
        dt = self.cost.prefill_s(computed, c * bt, dk * bt, sh * bt, r.decoding) * self._noise()
        dt *= self._slow[i]  # a mixed fleet's slower replica (1.0: the profile's rate, dt unchanged)
        r.busy = True
        r.busy_s += dt
        r.active_blocks += len(req.blocks)
        self._sync(i)
        self._push(self.now + dt, _PREFILLED, (i, req, arrived, (g * bt, c * bt, dk * bt, sh * bt)))

    def _prefilled(self, item: tuple[Any, ...]) -> None:
        i, req, arrived, hit = item
        r = self.replicas[i]
        blocks = req.blocks
        policy = self.policy
        if self.infinite:
            self.seen.update(blocks)
        else:
            # vLLM cannot evict the blocks of running requests: the other requests in flight
            # here shrink the room left for cached prefixes (4 in flight can fill 40 blocks).
            r.gpu.cap = max(len(blocks), self.config.gpu_blocks - (r.active_blocks - len(blocks)))
            new, gone = r.gpu.touch(blocks)
            if new:
                policy.stored(i, "GPU", new)
            if gone:
                policy.removed(i, "GPU", [b for b, _ in gone])
            for tier, medium in ((r.cpu, "CPU"), (r.disk, "DISK")):
                if tier is not None:
                    new, gone = tier.touch(blocks)
                    if new:
                        policy.stored(i, medium, new)
                    if gone:
                        policy.removed(i, medium, [b for b, _ in gone])
            if self.shared is not None:
                new, gone = self.shared.touch(blocks, i)
                if new:
                    policy.stored(i, "REMOTE", new)
                for b, saver in gone:
                    policy.removed(saver, "REMOTE", [b])
        r.busy = False
        r.served += 1
        ttft = self.now - arrived
        policy.first_token(i, req)
        dt = self.cost.decode_s(req.output, r.decoding + 1) * self._noise()
        r.decoding += 1
        rec = Record(i, arrived, ttft, self.now + dt, req.tokens, hit)
        self._push(self.now + dt, _DONE, (i, req, rec))
        if r.queue:
            self._start(i)
        else:
            self._sync(i)
