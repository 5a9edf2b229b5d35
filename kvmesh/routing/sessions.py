"""Session affinity: which replica served a session last (``x-session-id`` by default).

Each router keeps its own table: with several routers (active-active) a session's previous
turn may have gone through another one, and its prefix in the index (fed by every
replica's events, the same in every router) carries the affinity instead.
"""

from __future__ import annotations

from collections import OrderedDict


class SessionTable:
    """Session id → the replica that served it last; LRU-bounded."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._d: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str) -> str | None:
        return self._d.get(session)

    def record(self, session: str, replica: str) -> None:
        self._d[session] = replica
        self._d.move_to_end(session)
        if len(self._d) > self.capacity:
            self._d.popitem(last=False)

    def forget_replica(self, replica: str) -> None:
        for s in [s for s, r in self._d.items() if r == replica]:
            del self._d[s]

    def __len__(self) -> int:
        return len(self._d)
