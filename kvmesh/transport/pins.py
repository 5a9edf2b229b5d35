"""Pins held for a request id until it is confirmed or a timeout passes.

A producer pins a prefill's chunks when vLLM finishes the request, so nothing evicts them
before the decode replica has pulled them; the consumer's confirm releases them, and a
decode that never comes (router died, client gone) costs them only ``timeout_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.core.engine import CacheEngine
from kvmesh.core.keys import ChunkKey
from kvmesh.errors import ClosedError, ConfigError


class PinLedger:
    """``request id -> pinned keys, deadline`` over one engine. Thread-safe."""

    def __init__(self, engine: CacheEngine, timeout_s: float = 60.0, tick_s: float | None = None) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"pd_pin_timeout_s must be positive, got {timeout_s}")
        self.engine = engine
        self.timeout_s = timeout_s
        self._tick = tick_s if tick_s is not None else min(1.0, timeout_s / 4)
        self._lock = threading.Lock()
        self._held: dict[str, tuple[list[ChunkKey], float]] = {}
        self.counters = {"pd_pins": 0, "pd_pins_confirmed": 0, "pd_pins_expired": 0}
        self._stop = threading.Event()
        # Called with the keys of every hold that ends (confirm, expiry, replacement, close).
        self.on_release: list[Callable[[list[ChunkKey]], None]] = []
        self._reaper = threading.Thread(target=self._reap_loop, name="kvmesh-pd-pins", daemon=True)
        self._reaper.start()

    def hold(self, req: str, keys: Sequence[ChunkKey]) -> None:
        """Pin ``keys`` for ``req`` until :meth:`release` or the timeout. A request held
        again replaces its earlier pins."""
        if self._stop.is_set():
            raise ClosedError("PinLedger.hold after close")
        self.release(req, confirmed=False)
        keys = list(keys)
        if not keys:
            return
        self.engine.pin_keys(keys)
        with self._lock:
            self._held[req] = (keys, time.monotonic() + self.timeout_s)
            self.counters["pd_pins"] += 1

    def release(self, req: str, confirmed: bool = True) -> bool:
        with self._lock:
            entry = self._held.pop(req, None)
            if entry is not None and confirmed:
                self.counters["pd_pins_confirmed"] += 1
        if entry is None:
            return False
        self._unpin(entry[0])
        return True

    def _unpin(self, keys: list[ChunkKey]) -> None:
        self.engine.unpin_keys(keys)
        for hook in self.on_release:
            hook(keys)

    def expire(self, now: float | None = None) -> int:
        """Release every hold past its deadline; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [r for r, (_, deadline) in self._held.items() if deadline <= now]
            entries = [self._held.pop(r) for r in gone]
            self.counters["pd_pins_expired"] += len(gone)
        for keys, _ in entries:
            self._unpin(keys)
        return len(gone)

    def _reap_loop(self) -> None:
        while not self._stop.wait(self._tick):
            self.expire()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self.counters,
                "pd_pinned_requests": len(self._held),
                "pd_pinned_chunks": sum(len(k) for k, _ in self._held.values()),
            }

    def close(self) -> None:
        """Stop the reaper and drop every hold (the engine is going away)."""
        self._stop.set()
        self._reaper.join(timeout=2.0)
        with self._lock:
            entries, self._held = list(self._held.values()), {}
        for keys, _ in entries:
            self._unpin(keys)
