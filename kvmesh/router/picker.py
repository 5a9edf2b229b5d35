"""The picker: weighted sum of scorer outputs, an overload filter, a deterministic tie-break.

Policies by name (see :func:`build_picker`):

========================  =================================================================
``kvmesh`` (default)      prefix + queue + KV utilisation + session + prefill work, weighted;
                          overload filter
``prefix``                prefix only (the naive baseline: it piles a hot prefix on one replica)
``least-loaded``          queue only
``round-robin``           in turn
``random``                uniform, seeded
========================  =================================================================

Ties are broken by rendezvous hashing of the request's stable key with each replica's name:
no replica is favoured by its position in the list, and equal prompts break ties alike.
The ranking (not just the winner) is returned so that a connect failure can go to the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np
import xxhash

from kvmesh.router.config import POLICIES, RouterConfig
from kvmesh.router.scorers import (
    KVUtilScorer,
    PrefillScorer,
    PrefixScorer,
    PrefixSource,
    QueueScorer,
    RandomScorer,
    ReplicaState,
    RoundRobinScorer,
    RoutingRequest,
    Scorer,
    SessionScorer,
    SessionTable,
)


@dataclass(slots=True)
class Decision:
    """The ranking of one request's candidates, best first, with the scores behind it."""

    policy: str
    ranked: list[str]
    scores: dict[str, float]
    parts: dict[str, dict[str, float]] = field(default_factory=dict)  # scorer name → replica → raw
    overloaded: list[str] = field(default_factory=list)

    @property
    def replica(self) -> str:
        return self.ranked[0]


class Picker:
    """Sums ``weight * scorer.score`` per replica and ranks the replicas.

    ``overload=(abs, rel)``: a replica whose load exceeds the lightest candidate's by more than
    ``abs`` requests *and* ``rel`` times is ranked after every other, whatever its prefix score:
    the load term must dominate when one queue is much longer.
    """

    def __init__(
        self,
        policy: str,
        scorers: Sequence[tuple[Scorer, float]],
        overload: tuple[float, float] | None = None,
    ) -> None:
        self.policy = policy
        self.scorers = [(s, w) for s, w in scorers if w > 0]
        if not self.scorers:
            raise ValueError(f"policy {policy!r} has no scorer with a positive weight")
        self.overload = overload

    def pick(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> Decision:
        if not replicas:
            raise ValueError("no candidate replicas")
        # Summed and ranked with numpy, and every per-replica step a C-level map: at 1,000
        # replicas a Python loop per replica per scorer was most of a decision's time.
        names = [r.name for r in replicas]
        n = len(names)
        totals = np.zeros(n)
        parts: dict[str, dict[str, float]] = {}
        for scorer, weight in self.scorers:
            got = scorer.score(request, replicas)
            parts[scorer.name] = got
            totals += weight * np.fromiter(map(got.get, names, repeat(0.0, n)), float, count=n)
        over = self._overloaded(replicas)
        overloaded = np.fromiter(map(over.__contains__, names), bool, count=n) if over else np.zeros(n, bool)
        # Rounded so that float noise (1e-17) cannot beat the deterministic tie-break.
        order = np.lexsort((_tie_break(request.key, names), -np.round(totals, 9), overloaded))
        ranked = list(map(names.__getitem__, order.tolist()))
        return Decision(
            self.policy, ranked, dict(zip(names, totals.tolist(), strict=True)), parts, sorted(over)
        )

    def _overloaded(self, replicas: Sequence[ReplicaState]) -> set[str]:
        if self.overload is None or len(replicas) < 2:
            return set()
        margin, ratio = self.overload
        loads = [r.load for r in replicas]
        low = min(loads)
        bar = max(low + margin, low * ratio)
        return {r.name for r, load in zip(replicas, loads, strict=True) if load > bar}


_NAME_HASHES: dict[tuple[str, ...], np.ndarray] = {}
_M64 = (1 << 64) - 1


def _name_hashes(names: Sequence[str]) -> np.ndarray:
    """xxh3 of each name, as one array cached per candidate list (it rarely changes)."""
    key = tuple(names)
    arr = _NAME_HASHES.get(key)
    if arr is None:
        if len(_NAME_HASHES) >= 64:  # bounded under replica churn
            _NAME_HASHES.clear()
        arr = np.array([xxhash.xxh3_64_intdigest(n.encode()) for n in names], dtype=np.uint64)
        _NAME_HASHES[key] = arr
    return arr


def _tie_break(key: int, names: Sequence[str]) -> np.ndarray:
    """Rendezvous hash of the request key with each name (splitmix64 of key ^ xxh3(name)).

    No replica is favoured by its place in the list, equal keys order alike, and it costs one
    vectorised mix per decision (names are hashed once per candidate list, not per request).
    """
    with np.errstate(over="ignore"):
        x = _name_hashes(names) ^ np.uint64(key & _M64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def build_picker(
    policy: str,
    prefix_source: PrefixSource | None = None,
    sessions: SessionTable | None = None,
    config: RouterConfig | None = None,
) -> Picker:
    """A :class:`Picker` for a policy name, with weights and knobs from ``config``.

    ``prefix_source`` is needed by ``kvmesh`` and ``prefix``; ``sessions`` is created when
    not given (pass one to share it with whoever records the decisions).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; valid: {', '.join(POLICIES)}")
    cfg = config or RouterConfig()
    if policy in ("kvmesh", "prefix"):
        if prefix_source is None:
            raise ValueError(f"policy {policy!r} needs a prefix source (the block index)")
        prefix = PrefixScorer(prefix_source, cfg.medium_weights.model_dump())
        if policy == "prefix":
            return Picker(policy, [(prefix, 1.0)])
        w = cfg.weights
        table = sessions if sessions is not None else SessionTable(cfg.session_capacity)
        return Picker(
            policy,
            [
                (prefix, w.prefix),
                (QueueScorer(cfg.queue_smoothing), w.queue),
                (KVUtilScorer(), w.kv_util),
                (SessionScorer(table), w.session),
                (PrefillScorer(cfg.prefill_load_cost, cfg.prefill_smoothing_tokens), w.prefill),
            ],
            overload=(cfg.overload_abs, cfg.overload_rel) if w.queue > 0 else None,
        )
    if policy == "least-loaded":
        return Picker(policy, [(QueueScorer(cfg.queue_smoothing), 1.0)])
    if policy == "round-robin":
        return Picker(policy, [(RoundRobinScorer(), 1.0)])
    return Picker(policy, [(RandomScorer(cfg.seed), 1.0)])
