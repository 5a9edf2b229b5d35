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
        totals = dict.fromkeys((r.name for r in replicas), 0.0)
        parts: dict[str, dict[str, float]] = {}
        for scorer, weight in self.scorers:
            got = scorer.score(request, replicas)
            parts[scorer.name] = got
            for name, value in got.items():
                if name in totals:
                    totals[name] += weight * value
        over = self._overloaded(replicas)
        key = request.key.to_bytes(8, "little")

        def order(name: str) -> tuple[bool, float, int]:
            # Rounded so that float noise (1e-17) cannot beat the deterministic tie-break.
            return (name in over, -round(totals[name], 9), xxhash.xxh3_64_intdigest(key + name.encode()))

        ranked = sorted(totals, key=order)
        return Decision(self.policy, ranked, totals, parts, sorted(over))

    def _overloaded(self, replicas: Sequence[ReplicaState]) -> set[str]:
        if self.overload is None or len(replicas) < 2:
            return set()
        margin, ratio = self.overload
        low = min(r.load for r in replicas)
        return {r.name for r in replicas if r.load > low + margin and r.load > low * ratio}


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
