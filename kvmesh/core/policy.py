"""Eviction policies: small strategy objects that only order keys.

A policy never decides *whether* something may go (pins and references do); it answers
"which keys, in what order, should be tried first". The tier walks :meth:`candidates`
and skips what it must keep, doing bounded work per allocation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Protocol

from kvmesh.errors import ConfigError


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


class PinCounts:
    """Counted pins by key text, kept apart from what a tier holds.

    A pin counts whether or not its key is present (it applies when the chunk arrives), so
    every ``pin`` is undone by exactly one ``unpin``: an unpin can never drop a pin somebody
    else took, and an unpin without a pin is a no-op. ``pin``/``unpin`` return whether the
    key changed between pinned and unpinned, so a tier can move it out of (or back into) its
    eviction policy. Not thread-safe: the owning tier holds its lock around every call.
    """

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def pin(self, key: str) -> bool:
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        return n == 0

    def unpin(self, key: str) -> bool:
        n = self._counts.get(key, 0)
        if n > 1:
            self._counts[key] = n - 1
            return False
        return self._counts.pop(key, None) is not None

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    def count(self, key: str) -> int:
        return self._counts.get(key, 0)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._counts))


def make_policy(name: str) -> EvictionPolicy:
    """The eviction policy named ``name`` (config ``eviction_policy``)."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ConfigError(f"eviction_policy {name!r} is unknown; valid values: {', '.join(sorted(POLICIES))}")
    return factory()
