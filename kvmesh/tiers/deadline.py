"""One deadline for a whole remote operation.

``remote_timeout_s`` is the budget of an operation as the caller sees it (an engine
``lookup`` or ``retrieve``, one write-behind batch), retries included: not a per-try socket
timeout that a retry loop multiplies. The engine opens a :func:`deadline` around each
operation; a remote tier opens its own around each call (nested deadlines keep the earlier
end) and caps every socket wait at :func:`time_left`. When the budget is spent the tier
answers a miss (or ``False`` for a store) instead of waiting: vLLM recomputes those tokens.

The deadline lives in a :class:`~contextvars.ContextVar`, so it follows the calling thread
(and asyncio task) down into client libraries without changing any signature, and one
thread's deadline never leaks into another's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_END: ContextVar[float | None] = ContextVar("kvmesh_deadline", default=None)


@contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Bound everything inside the block to ``seconds`` from now (``None``: no bound of its
    own). Nested blocks keep the earliest end."""
    outer = _END.get()
    end = outer
    if seconds is not None:
        mine = time.monotonic() + seconds
        end = mine if outer is None else min(outer, mine)
    token = _END.set(end)
    try:
        yield
    finally:
        _END.reset(token)


def time_left() -> float | None:
    """Seconds left before the current deadline (may be <= 0); ``None`` without one."""
    end = _END.get()
    return None if end is None else end - time.monotonic()


def expired() -> bool:
    left = time_left()
    return left is not None and left <= 0
