"""The replica pool's state: who is healthy, what load each carries, what this router sent.

Health and load come from outside (:mod:`kvmesh.routing.health` checks and scrapes the
replicas over HTTP; a connect failure seen by a front end takes a replica out at once with
:meth:`Pool.mark_failed`); what this router itself sent is counted here by the dispatcher
(:meth:`Pool.acquire` / :meth:`Pool.settle_prefill` / :meth:`Pool.release`).

Load shared by several routers (active-active) is read from the replicas' gauges, not from
one router's memory: the scraped ``waiting`` + ``running`` counts everyone's requests, and
:meth:`Pool.scraped` turns the waiting requests that are not this router's into queued
prefill work at this router's mean cost per request (see :attr:`ReplicaState.external_prefill`).
Everything here runs on one event loop (or the simulator's thread); nothing needs a lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.routing.config import ReplicaConfig
from kvmesh.routing.scorers import ReplicaState
from kvmesh.routing.table import ReplicaTable

log = logging.getLogger(__name__)

_MEAN_ALPHA = 0.05  # weight of a new request's prefill cost in the running mean


class Replica:
    """One upstream and what the router knows about it."""

    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.name = config.key
        self.url = config.url
        self.state = ReplicaState(self.name, healthy=False)
        self.last_error: str | None = None
        self.models: tuple[str, ...] = ()
        # The LoRA adapters among them: vLLM lists each with ``parent`` = its base model.
        self.adapters: tuple[str, ...] = ()
        self.max_model_len: int | None = None  # the largest its /v1/models reports
        self.models_at = 0.0
        self.scraped_at: float | None = None
        self.empty_scrapes = 0  # /metrics pages in a row without any load gauge
        self.skip_scrapes = 0  # scrape rounds left to skip (see kvmesh.routing.health)
        self.late_checks = 0  # health checks in a row that timed out while it was healthy

    @property
    def healthy(self) -> bool:
        return self.state.healthy

    def describe(self) -> dict[str, Any]:
        s = self.state
        return {
            "name": self.name,
            "url": self.url,
            "healthy": s.healthy,
            "waiting": s.waiting,
            "running": s.running,
            "in_flight": s.in_flight,
            "pending": s.pending,
            "prefill_tokens": round(s.prefill_tokens, 1),
            "external_prefill_tokens": round(s.external_prefill, 1),
            "kv_usage": s.kv_usage,
            "models": list(self.models),
            "last_error": self.last_error,
        }


class Pool:
    """The replicas by name; see the module docstring."""

    def __init__(
        self,
        replicas: Sequence[ReplicaConfig] = (),
        *,
        on_health_change: Callable[[Replica], None] | None = None,
    ) -> None:
        self.replicas: dict[str, Replica] = {}
        self.mean_prefill = 0.0  # running mean of this router's requests' prefill costs (tokens)
        self._sent = 0
        self._on_change = on_health_change
        for cfg in replicas:
            self.add(cfg)

    def add(self, config: ReplicaConfig) -> Replica:
        if config.key in self.replicas:
            raise ValueError(f"replica {config.key!r} is already in the pool")
        replica = self.replicas[config.key] = Replica(config)
        return replica

    def remove(self, name: str) -> None:
        self.replicas.pop(name, None)

    def candidates(self) -> list[ReplicaState]:
        """Live states of the healthy replicas, in configuration order (not copies)."""
        return [r.state for r in self.replicas.values() if r.state.healthy]

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.state.healthy]

    def models(self) -> set[str]:
        """Model names the healthy replicas serve (empty before their first ``/v1/models``)."""
        return {m for r in self.replicas.values() if r.state.healthy for m in r.models}

    def adapters(self) -> set[str]:
        """The served names that are LoRA adapters (a request for one matches only that
        adapter's blocks, never the base model's: see :class:`kvmesh.routing.Dispatcher`)."""
        return {m for r in self.replicas.values() if r.state.healthy for m in r.adapters}

    def max_model_len(self) -> int | None:
        """The longest context a healthy replica reports (None before any ``/v1/models``)."""
        lens = [r.max_model_len for r in self.replicas.values() if r.state.healthy and r.max_model_len]
        return max(lens) if lens else None

    # -- what this router sent (the dispatcher's bookkeeping) ------------------------------------

    def acquire(self, name: str, prefill_tokens: float = 0.0) -> None:
        """A request sent to ``name``, bringing ``prefill_tokens`` of prompt work until its
        first byte (:meth:`settle_prefill`, once) and counted in flight until :meth:`release`."""
        replica = self.replicas.get(name)
        if replica is None:
            return  # not (or no longer) one of ours: nothing to count it on
        state = replica.state
        state.in_flight += 1
        state.pending += 1
        state.prefill_tokens += prefill_tokens
        # an exact mean for the first requests, then an exponential one (it follows the workload)
        self._sent += 1
        self.mean_prefill += max(_MEAN_ALPHA, 1.0 / self._sent) * (prefill_tokens - self.mean_prefill)

    def settle_prefill(self, name: str, tokens: float) -> None:
        """That work is done (its first byte came back) or gone (the request ended)."""
        replica = self.replicas.get(name)
        if replica is not None:
            s = replica.state
            s.pending = max(0, s.pending - 1)
            s.prefill_tokens = max(s.external_prefill, s.prefill_tokens - tokens)

    def load_of(self, name: str) -> tuple[float, float, float, float] | None:
        """``(queued prefill tokens, waiting, running, in flight)`` of ``name``; None if unknown."""
        replica = self.replicas.get(name)
        if replica is None:
            return None
        s = replica.state
        return s.prefill_tokens, s.waiting, s.running, float(s.in_flight)

    def hold(self, name: str) -> None:
        """Count a request in flight on ``name`` without prefill work there (until :meth:`release`)."""
        replica = self.replicas.get(name)
        if replica is not None:
            replica.state.in_flight += 1

    def release(self, name: str) -> None:
        replica = self.replicas.get(name)
        if replica is not None:
            replica.state.in_flight = max(0, replica.state.in_flight - 1)

    # -- what the replicas say -----------------------------------------------------------------------

    def scraped(self, replica: Replica, waiting: float, running: float, kv_usage: float | None) -> None:
        """The replica's load gauges. Its waiting requests beyond this router's own that have
        not seen a first byte are other routers' (or clients'): their prefill work is counted
        at this router's mean cost per request. A lower bound: own requests already
        prefilling are in ``running``, not ``waiting``."""
        s = replica.state
        external = max(0.0, waiting - s.pending) * self.mean_prefill
        s.prefill_tokens = max(0.0, s.prefill_tokens - s.external_prefill) + external
        s.external_prefill = external
        s.waiting = waiting
        s.running = running
        s.kv_usage = kv_usage

    def mark_failed(self, name: str, reason: str) -> None:
        replica = self.replicas.get(name)
        if replica is not None:
            replica.last_error = reason
            self.set_health(replica, False)

    def set_health(self, replica: Replica, ok: bool) -> None:
        if replica.state.healthy == ok:
            return
        replica.state.healthy = ok
        if ok:
            replica.last_error = None
        log.info("replica %s is %s", replica.name, "healthy" if ok else f"down ({replica.last_error})")
        if self._on_change is not None:
            self._on_change(replica)


class TableLedger:
    """The dispatcher's bookkeeping on a :class:`ReplicaTable` kept in place (the simulator's
    fleet: no pool, no health, its own clock), by name as :class:`Pool` does it."""

    def __init__(self, table: ReplicaTable) -> None:
        self.table = table

    def acquire(self, name: str, prefill_tokens: float = 0.0) -> None:
        i = self.table.position(name)
        if i is not None:
            self.table.in_flight[i] += 1
            self.table.prefill_tokens[i] += prefill_tokens

    def settle_prefill(self, name: str, tokens: float) -> None:
        i = self.table.position(name)
        if i is not None:
            p = self.table.prefill_tokens
            p[i] = max(0.0, p[i] - tokens)

    def release(self, name: str) -> None:
        i = self.table.position(name)
        if i is not None:
            f = self.table.in_flight
            f[i] = max(0.0, f[i] - 1)

    def load_of(self, name: str) -> tuple[float, float, float, float] | None:
        i = self.table.position(name)
        if i is None:
            return None
        t = self.table
        return float(t.prefill_tokens[i]), float(t.waiting[i]), float(t.running[i]), float(t.in_flight[i])
