"""Pins held under a transfer id until it is confirmed or a timeout passes.

A producer pins a prefill's chunks when vLLM finishes the request, so nothing evicts them
before the decode replica has pulled them; the consumer's confirm releases them, and a
decode that never comes (router died, client gone) costs them only ``timeout_s``.

What the holds may keep is bounded, because any client that can reach a producer can ask
for a hold (``do_remote_decode``): at most ``max_requests`` holds and ``max_chunks`` chunks
(the connector sets ``pd_pin_max_fraction`` of its CPU pool). A new hold that would pass
either bound ends the oldest holds first (counted ``pd_pins_evicted``): a decode follows its
prefill within milliseconds, so the oldest hold is the one least likely still wanted. A hold
larger than ``max_chunks`` by itself keeps only its leading ``max_chunks`` chunks.

The transfer server serves a chunk only to a fetch that names a hold containing it
(:meth:`keys_of`), so the transfer id is a capability: make it unguessable.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.core.engine import CacheEngine
from kvmesh.core.keys import ChunkKey
from kvmesh.errors import ClosedError, ConfigError


class PinLedger:
    """``transfer id -> pinned keys, deadline`` over one engine, bounded. Thread-safe."""

    def __init__(
        self,
        engine: CacheEngine,
        timeout_s: float = 60.0,
        tick_s: float | None = None,
        max_requests: int = 1024,
        max_chunks: int | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"pd_pin_timeout_s must be positive, got {timeout_s}")
        if max_requests < 1 or (max_chunks is not None and max_chunks < 1):
            raise ConfigError(f"pin bounds must be positive: {max_requests} requests, {max_chunks} chunks")
        self.engine = engine
        self.timeout_s = timeout_s
        self.max_requests = max_requests
        self.max_chunks = max_chunks if max_chunks is not None else engine.cpu.pool.num_slots // 2
        self.max_chunks = max(1, self.max_chunks)
        self._tick = tick_s if tick_s is not None else min(1.0, timeout_s / 4)
        self._lock = threading.Lock()
        self._held: OrderedDict[str, tuple[list[ChunkKey], float]] = OrderedDict()  # oldest first
        self._chunks = 0
        self.counters = {
            "pd_pins": 0,
            "pd_pins_confirmed": 0,
            "pd_pins_expired": 0,
            "pd_pins_evicted": 0,
            "pd_pins_truncated": 0,
        }
        self._stop = threading.Event()
        # Called with the keys of every hold that ends (confirm, expiry, eviction, close).
        self.on_release: list[Callable[[list[ChunkKey]], None]] = []
        self._reaper = threading.Thread(target=self._reap_loop, name="kvmesh-pd-pins", daemon=True)
        self._reaper.start()

    def hold(self, req: str, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Pin ``keys`` for ``req`` until :meth:`release` or the timeout; returns the keys
        held (a prefix of ``keys`` when they alone pass ``max_chunks``). A request held again
        replaces its earlier pins."""
        if self._stop.is_set():
            raise ClosedError("PinLedger.hold after close")
        self.release(req, confirmed=False)
        keys = list(keys)
        if len(keys) > self.max_chunks:
            keys = keys[: self.max_chunks]
            with self._lock:
                self.counters["pd_pins_truncated"] += 1
        if not keys:
            return []
        ended: list[list[ChunkKey]] = []
        with self._lock:
            while self._held and (
                len(self._held) >= self.max_requests or self._chunks + len(keys) > self.max_chunks
            ):
                _, (old, _) = self._held.popitem(last=False)
                self._chunks -= len(old)
                self.counters["pd_pins_evicted"] += 1
                ended.append(old)
        for old in ended:
            self._unpin(old)
        self.engine.pin_keys(keys)
        with self._lock:
            self._held[req] = (keys, time.monotonic() + self.timeout_s)
            self._chunks += len(keys)
            self.counters["pd_pins"] += 1
        return keys

    def keys_of(self, req: str) -> list[ChunkKey] | None:
        """The keys held under ``req``, or ``None`` when nothing is (never was, confirmed,
        expired or evicted)."""
        with self._lock:
            entry = self._held.get(req)
        return None if entry is None else entry[0]

    def release(self, req: str, confirmed: bool = True) -> bool:
        with self._lock:
            entry = self._held.pop(req, None)
            if entry is not None:
                self._chunks -= len(entry[0])
                if confirmed:
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
            self._chunks -= sum(len(k) for k, _ in entries)
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
                "pd_pinned_chunks": self._chunks,
                "pd_pin_max_chunks": self.max_chunks,
            }

    def close(self) -> None:
        """Stop the reaper and drop every hold (the engine is going away)."""
        self._stop.set()
        self._reaper.join(timeout=2.0)
        with self._lock:
            entries, self._held = list(self._held.values()), OrderedDict()
            self._chunks = 0
        for keys, _ in entries:
            self._unpin(keys)
