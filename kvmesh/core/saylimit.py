"""Say a recurring condition once, then at most every few minutes.

A full Redis refuses every store and a full filesystem every write: a WARNING per refusal
would bury the log, one ever would leave an operator who starts reading later none. So a
condition is said at once, then at most every ``every_s`` per reason, and the line says how
many were held back since the last one. Thread-safe; the clock is injectable for tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

SAY_EVERY_S = 300.0  # a recurring condition's warning: once, then at most every 5 minutes


class SayLimit:
    """Whether a warning for ``reason`` is due now, and how many were held back before it."""

    def __init__(self, every_s: float = SAY_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._said: dict[str, tuple[float, int]] = {}  # reason -> (last said, held back since)

    def due(self, reason: str = "") -> int | None:
        """``None`` to hold this one back (counted); otherwise say it now, with the count of
        those held back since the last time (0 the first time)."""
        now = self._clock()
        with self._lock:
            said = self._said.get(reason)
            if said is not None and now - said[0] < self.every_s:
                self._said[reason] = (said[0], said[1] + 1)
                return None
            self._said[reason] = (now, 0)
            return said[1] if said is not None else 0


def held_back(count: int) -> str:
    """`` (N more since the last warning)`` for a message, or nothing."""
    return f" ({count} more since the last warning)" if count else ""


def gib(n: float) -> str:
    """Bytes in GiB, as kvmesh's size settings count them (``max_local_disk_size: 5`` is
    5 GiB, LMCache's meaning): ``"1.0 GiB"``."""
    return f"{n / (1 << 30):.1f} GiB"
