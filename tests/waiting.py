"""Waiting in a test for what another thread or process does: poll a condition until it
holds or a deadline passes (see docs/guides/testing.md, "Waiting on another thread").

``wait_for`` fails the test with what it waited for; ``eventually`` answers whether the
condition came true, for an ``assert`` with its own message.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(cond: Callable[[], object], timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    """Whether ``cond()`` came true within ``timeout_s`` (asked once more at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval_s)
    return bool(cond())


def wait_for(
    cond: Callable[[], object],
    timeout_s: float = 5.0,
    what: str = "condition",
    detail: Callable[[], str] | None = None,
    interval_s: float = 0.02,
) -> float:
    """Poll ``cond()`` until it holds; the seconds that took. Past ``timeout_s`` the test
    fails naming ``what``, with ``detail()`` (state worth seeing) where given."""
    t0 = time.monotonic()
    if eventually(cond, timeout_s, interval_s):
        return time.monotonic() - t0
    extra = f"\n{detail()}" if detail is not None else ""
    raise AssertionError(f"not within {timeout_s:g} s: {what}{extra}")
