"""Eviction policies: small strategy objects that only order keys.

A policy never decides *whether* something may go (pins and references do); it answers
"which keys, in what order, should be tried first". The tier walks :meth:`candidates`
and skips what it must keep, doing bounded work per allocation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from itertools import islice
from typing import Protocol


class EvictionPolicy(Protocol):
    def insert(self, key: str) -> None: ...

    def touch(self, key: str) -> None: ...

    def remove(self, key: str) -> None: ...

    def candidates(self, limit: int) -> list[str]:
        """Up to ``limit`` keys, in the order they should be evicted."""
        ...

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first; ``touch`` on every hit."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def insert(self, key: str) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def candidates(self, limit: int) -> list[str]:
        return list(islice(self._order, limit))

    def __len__(self) -> int:
        return len(self._order)


class FIFOPolicy(LRUPolicy):
    """First stored, first evicted; hits do not refresh."""

    def touch(self, key: str) -> None:
        pass


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "fifo": FIFOPolicy}
