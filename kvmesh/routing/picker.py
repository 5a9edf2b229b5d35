"""The picker: weighted sum of scorer outputs, an overload filter, a deterministic tie-break.

Policies by name (see :func:`build_picker`):

========================  =================================================================
``kvmesh`` (default)      prefix + queue + KV utilisation + session + prefill work, weighted;
                          overload filter
``cost``                  the lowest predicted time to first token, from rates measured
                          online (:mod:`kvmesh.routing.cost`, a Picker of its own)
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
from itertools import repeat

import numpy as np

from kvmesh.routing.config import POLICIES, RoutingConfig
from kvmesh.routing.scorers import (
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
    as_table,
)
from kvmesh.routing.sessions import SessionTable
from kvmesh.routing.table import ReplicaTable


class Decision:
    """The ranking of one request's candidates, best first, with the scores behind it.

    Built from the picker's arrays; the full ranking and the per-name dicts are made the
    first time they are read (the simulator reads only the winner, the router the ranking).
    """

    __slots__ = (
        "_hashes",
        "_key",
        "_names",
        "_over",
        "_parts",
        "_ranked",
        "_rounded",
        "_totals",
        "index",
        "policy",
    )

    def __init__(
        self,
        policy: str,
        table: ReplicaTable,
        totals: np.ndarray,
        parts: dict[str, np.ndarray],
        over: np.ndarray,
        key: int,
    ) -> None:
        self.policy = policy
        self._names = table.names
        self._hashes = table.name_hashes()
        self._key = key
        self._totals = totals
        self._parts = parts
        self._over = over
        self._ranked: list[str] | None = None
        # Rounded so that float noise (1e-17) cannot beat the deterministic tie-break.
        self._rounded = rounded = totals.round(9)
        # The ranking's first, without ranking: not overloaded, the best score, then the
        # lowest tie-break among the few that share that score.
        if np.count_nonzero(over):
            pool = ~over
            best = (pool & (rounded == np.maximum.reduce(rounded[pool]))).nonzero()[0]
        else:
            best = (rounded == np.maximum.reduce(rounded)).nonzero()[0]
        if len(best) > 1:
            best = best[_mix(self._hashes[best], key).argmin()]
        self.index = int(best if best.ndim == 0 else best[0])

    @property
    def replica(self) -> str:
        return self._names[self.index]

    @property
    def ranked(self) -> list[str]:
        if self._ranked is None:
            order = np.lexsort((_mix(self._hashes, self._key), -self._rounded, self._over))
            self._ranked = list(map(self._names.__getitem__, order.tolist()))
        return self._ranked

    @property
    def scores(self) -> dict[str, float]:
        return dict(zip(self._names, self._totals.tolist(), strict=True))

    @property
    def parts(self) -> dict[str, dict[str, float]]:
        """Scorer name → replica → its raw score."""
        names = self._names
        return {k: dict(zip(names, v.tolist(), strict=True)) for k, v in self._parts.items()}

    @property
    def overloaded(self) -> list[str]:
        return sorted(map(self._names.__getitem__, np.flatnonzero(self._over).tolist()))


class Picker:
    """Sums ``weight * scorer.score_array`` per replica and ranks the replicas.

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

    def pick(self, request: RoutingRequest, replicas: Sequence[ReplicaState] | ReplicaTable) -> Decision:
        """Rank ``replicas``: the pool's snapshots, or a :class:`ReplicaTable` kept up to date."""
        table = as_table(replicas)
        n = len(table)
        if not n:
            raise ValueError("no candidate replicas")
        # Every scorer scores every candidate in one array: at 1,000 replicas a Python loop
        # per replica per scorer was most of a decision's time (and of the simulator's).
        totals = np.zeros(n)
        parts: dict[str, np.ndarray] = {}
        for scorer, weight in self.scorers:
            score_array = getattr(scorer, "score_array", None)
            if score_array is not None:
                got = score_array(request, table)
            else:  # a scorer of the dict kind: by name
                states = replicas if not isinstance(replicas, ReplicaTable) else table.states()
                d = scorer.score(request, states)
                got = np.fromiter(map(d.get, table.names, repeat(0.0, n)), float, count=n)
            parts[scorer.name] = got
            totals += weight * got
        return Decision(self.policy, table, totals, parts, self._overloaded(table), request.key)

    def _overloaded(self, table: ReplicaTable) -> np.ndarray:
        return _overloaded(self.overload, table)


def _overloaded(overload: tuple[float, float] | None, table: ReplicaTable) -> np.ndarray:
    if overload is None or len(table) < 2:
        return np.zeros(len(table), bool)
    margin, ratio = overload
    loads = table.load
    low = float(loads.min())
    return loads > max(low + margin, low * ratio)


_M64 = (1 << 64) - 1


def _tie_break(key: int, names: Sequence[str] | ReplicaTable) -> np.ndarray:
    """Rendezvous hash of the request key with each name (splitmix64 of key ^ xxh3(name)).

    No replica is favoured by its place in the list, equal keys order alike, and it costs one
    vectorised mix per decision (names are hashed once per candidate list, not per request).
    """
    table = names if isinstance(names, ReplicaTable) else ReplicaTable(names)
    return _mix(table.name_hashes(), key)


def _mix(hashes: np.ndarray, key: int) -> np.ndarray:
    """splitmix64 over ``hashes`` (1-d: integer array arithmetic wraps without a warning,
    where numpy scalars' would warn)."""
    x = hashes.reshape(-1) ^ np.uint64(key & _M64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def build_picker(
    policy: str,
    prefix_source: PrefixSource | None = None,
    sessions: SessionTable | None = None,
    config: RoutingConfig | None = None,
) -> Picker:
    """A picker for a policy name, with weights and knobs from ``config``.

    ``prefix_source`` is needed by ``kvmesh`` and ``prefix``; ``sessions`` is created when
    not given (pass one to share it with whoever records the decisions).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; valid: {', '.join(POLICIES)}")
    cfg = config or RoutingConfig()
    if policy == "cost":  # the TTFT cost model (kvmesh.routing.cost)
        from kvmesh.routing.cost import build_cost_picker

        return build_cost_picker(prefix_source, cfg)
    if policy in ("kvmesh", "prefix"):
        if prefix_source is None:
            raise ValueError(f"policy {policy!r} needs a prefix source (the block index)")
        prefix = PrefixScorer(prefix_source, cfg.medium_weights.by_name())
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
