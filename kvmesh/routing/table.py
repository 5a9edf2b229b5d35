"""The candidates of one routing decision as arrays: what the vectorised scorers read.

Kept apart from :mod:`kvmesh.routing.scorers` so that both the scorers and their callers
(the picker, the simulator's fleet) import it without a cycle.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np
import xxhash

if TYPE_CHECKING:
    from kvmesh.routing.scorers import ReplicaState


class _Names:
    """What a candidate list's names imply, computed once per list (it rarely changes)."""

    __slots__ = ("aligned", "hashes", "names", "position")

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.position = {n: i for i, n in enumerate(names)}
        self.hashes: np.ndarray | None = None  # xxh3 per name (the picker's tie-break)
        self.aligned: tuple[object, np.ndarray | None] | None = None  # (index rid_names, rid → position)


_NAMES: dict[tuple[str, ...], _Names] = {}
_STATE_FIELDS = ("waiting", "running", "in_flight", "prefill_tokens")


def _names_of(names: tuple[str, ...]) -> _Names:
    got = _NAMES.get(names)
    if got is None:
        if len(_NAMES) >= 64:  # bounded under replica churn
            _NAMES.clear()
        got = _NAMES[names] = _Names(names)
    return got


class ReplicaTable:
    """The candidates' :class:`ReplicaState` fields as arrays, one position per replica.

    Built per request from the pool's snapshots (:meth:`of`), or kept and updated in place
    by the simulator (write ``table.in_flight[i] += 1``; ``kv_usage`` NaN = not scraped).
    """

    __slots__ = ("_names", "in_flight", "kv_usage", "prefill_tokens", "running", "waiting")

    def __init__(self, names: Sequence[str]) -> None:
        self._names = _names_of(tuple(names))
        n = len(names)
        self.waiting = np.zeros(n)
        self.running = np.zeros(n)
        self.in_flight = np.zeros(n)
        self.prefill_tokens = np.zeros(n)
        self.kv_usage = np.full(n, np.nan)

    @classmethod
    def of(cls, replicas: Sequence[ReplicaState]) -> ReplicaTable:
        self = cls.__new__(cls)
        n = len(replicas)
        self._names = _names_of(tuple(map(attrgetter("name"), replicas)))
        for f in _STATE_FIELDS:
            setattr(self, f, np.fromiter(map(attrgetter(f), replicas), float, count=n))
        # None (not scraped yet) becomes NaN
        self.kv_usage = np.array(list(map(attrgetter("kv_usage"), replicas)), dtype=float).reshape(n)
        return self

    @property
    def names(self) -> tuple[str, ...]:
        return self._names.names

    def __len__(self) -> int:
        return len(self._names.names)

    def position(self, name: str | None) -> int | None:
        return self._names.position.get(name) if name is not None else None

    @property
    def load(self) -> np.ndarray:
        """:attr:`ReplicaState.load` of each: the scraped queue, or our own count if higher."""
        return np.maximum(self.waiting + self.running, self.in_flight)

    def name_hashes(self) -> np.ndarray:
        names = self._names
        if names.hashes is None:
            names.hashes = np.array([xxhash.xxh3_64_intdigest(n.encode()) for n in names.names], np.uint64)
        return names.hashes

    def align(self, rid_names: tuple[str | None, ...]) -> np.ndarray | None:
        """Position here of each of an index's replica ids (-1: not a candidate), or None
        when every id is its own position; cached while the index hands out the same
        ``rid_names`` tuple."""
        names = self._names
        got = names.aligned
        if got is None or got[0] is not rid_names:
            pos = names.position
            arr = np.array([pos.get(n, -1) if n is not None else -1 for n in rid_names], np.int64)
            same = len(arr) <= len(names.names) and bool((arr == np.arange(len(arr))).all())
            got = names.aligned = (rid_names, None if same else arr)
        return got[1]

    def states(self) -> list[ReplicaState]:
        """The table as :class:`ReplicaState` snapshots (for scorers without ``score_array``)."""
        from kvmesh.routing.scorers import ReplicaState

        kv = [None if u != u else u for u in self.kv_usage.tolist()]  # NaN: not scraped
        return [
            ReplicaState(n, waiting=w, running=r, in_flight=int(f), prefill_tokens=p, kv_usage=u)
            for n, w, r, f, p, u in zip(
                self.names,
                self.waiting.tolist(),
                self.running.tolist(),
                self.in_flight.tolist(),
                self.prefill_tokens.tolist(),
                kv,
                strict=True,
            )
        ]
