"""The routing core as a live service: what ``kvmesh router`` and ``kvmesh epp`` both run.

An index fed by every replica's KV events, a pool kept current by health checks and
gauge scrapes, the tokenizer, the request-body checks (:mod:`kvmesh.routing.body`), the
session table, the picker of the configured policy (with ``policy: cost``, its hooks:
:mod:`kvmesh.routing.costhooks`), and the :class:`~kvmesh.routing.dispatcher.Dispatcher`
over them. Replicas come from the
config or are added and removed at run time (the EPP's discovery). Every replica's KV
events are read by one thread, an :class:`~kvmesh.events.hub.EventHub` (epoll over their
sockets, gap repairs on threads of their own), not by a thread per replica. The front ends keep
their transport (HTTP proxy, ext_proc) and their own metrics registry; the series the core
keeps are named by them (``kvmesh_router_*``, ``kvmesh_epp_*``).

Several routers over the same replicas (active-active) each consume every replica's
events, so their indexes agree; shared load comes from the replicas' gauges
(:meth:`kvmesh.routing.pool.Pool.scraped`); ties break by a hash of the prompt and the
replica's name, the same in every process. What stays per router: its sessions, its
speculative entries, its own requests' counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp

from kvmesh.events import EventSubscriber
from kvmesh.events.hub import EventHub
from kvmesh.index import BlockIndex
from kvmesh.routing.body import RequestBodies
from kvmesh.routing.config import ReplicaConfig, RoutingConfig
from kvmesh.routing.costhooks import CostHooks
from kvmesh.routing.dispatcher import Dispatcher
from kvmesh.routing.health import Monitor
from kvmesh.routing.loop import gc_state
from kvmesh.routing.picker import build_picker
from kvmesh.routing.pool import Pool, Replica
from kvmesh.routing.prompts import Prompts
from kvmesh.routing.sessions import SessionTable
from kvmesh.routing.tokenize import PromptTokenizer

log = logging.getLogger(__name__)


class CoreMetrics(Protocol):
    """The dispatcher's series (:class:`~kvmesh.routing.dispatcher.DispatchMetrics`) and
    ``healthy{replica}``."""

    decisions: Any
    prompt_tokens: Any
    hit_tokens: Any
    in_flight: Any
    healthy: Any
    registry: Any  # the front end's Prometheus registry (the cost model's series join it)


class RoutingCore:
    """See the module docstring. ``client()``: the front end's HTTP session, for a replica's
    ``/tokenize`` with ``tokenizer: remote`` (None: not started)."""

    def __init__(
        self,
        config: RoutingConfig,
        metrics: CoreMetrics,
        *,
        index: BlockIndex | None = None,
        tokenizer: PromptTokenizer | None = None,
        client: Callable[[], aiohttp.ClientSession | None] = lambda: None,
        on_tokenize_error: Callable[[], None] = lambda: None,
        admin_token: str | None = None,
    ) -> None:
        """``admin_token``: the bearer token of the replicas' admin APIs (the cost model asks
        them for their measured figures)."""
        self.config = config
        self.metrics = metrics
        self.index = index if index is not None else BlockIndex(default_block_size=config.block_size)
        if tokenizer is None and config.model and config.tokenizer == "local":
            tokenizer = PromptTokenizer.from_dir(config.model, int(config.tokenize_cache_mb * (1 << 20)))
        self.tokenizer = tokenizer
        self.sessions = SessionTable(config.session_capacity)
        self.picker = build_picker(config.policy, self.index, self.sessions, config)
        self.pool = Pool(on_health_change=self._health_changed)
        # Called with a replica taken out (its health checks, or a front end that found it
        # dead): the router cuts the answers it still owes that have gone quiet (a hung
        # replica breaks nothing).
        self.on_down: list[Callable[[Replica], None]] = []
        # policy cost: the TTFT model's bookkeeping, inputs and outputs (kvmesh.routing.costhooks)
        self.costs = CostHooks.of(self.picker, config, metrics.registry, self.pool.candidates, admin_token)
        self.monitor = Monitor(
            self.pool,
            health_interval_s=config.health_interval_s,
            health_timeout_s=config.health_timeout_s,
            health_failure_threshold=config.health_failure_threshold,
            metrics_interval_s=config.metrics_interval_s,
            on_scrape=self.costs.scraped if self.costs is not None else None,
        )
        self.prompts = Prompts(config, tokenizer, self.pool, client, on_tokenize_error)
        self.bodies = RequestBodies(config, tokenizer, self.pool)
        self.dispatcher = Dispatcher(
            config,
            self.pool,
            self.picker,
            index=self.index,
            sessions=self.sessions,
            prompts=self.prompts,
            known_models=self.pool.models,
            adapters=self.pool.adapters,
            check_tokens=self.bodies.check_tokens,
            metrics=metrics,
        )
        if self.costs is not None:
            self.dispatcher.track = self.costs.sent
        # What the replicas' own feeds (their KV events, a rebuild's held pages) apply: a batch
        # that lands after remove_replica (a subscription's close timed out while it was being
        # delivered, a rebuild page on its way) is dropped, not a replica registered again.
        self.apply_events = functools.partial(self.index.apply, register=False)
        self.subscribers: dict[str, EventSubscriber] = {}
        self._hub: EventHub | None = None  # started with the first subscriber
        self._started = False
        self._checks: set[asyncio.Task[None]] = set()
        for cfg in config.replicas:
            self.add_replica(cfg)

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Subscribe to every replica's events, check them all once, then keep checking."""
        self._started = True
        for replica in self.pool.replicas.values():
            self._subscribe(replica.config)
        await self.monitor.start(session)
        if self.costs is not None:
            self.costs.start(session)

    async def stop(self) -> None:
        await self.monitor.stop()
        if self.costs is not None:
            await self.costs.stop()
        for sub in list(self.subscribers.values()):
            await asyncio.to_thread(sub.close)
        self.subscribers.clear()
        if self._hub is not None:
            await asyncio.to_thread(self._hub.close)
            self._hub = None
        self.prompts.close()
        await self.bodies.close()
        self._started = False

    # -- membership ----------------------------------------------------------------------------------

    def add_replica(self, cfg: ReplicaConfig) -> None:
        """Start routing to ``cfg`` (once its health check passes); idempotent per name."""
        name = cfg.key
        if name in self.pool.replicas:
            if self.pool.replicas[name].config == cfg:
                return
            self.remove_replica(name)
        self.pool.add(cfg)
        # Registered now, so shared (REMOTE) blocks count for it before its first event.
        self.index.add_replica(name)
        self.metrics.healthy.labels(name).set(0.0)
        if self._started:
            self._subscribe(cfg)
            task = asyncio.get_running_loop().create_task(self.monitor.check_all())
            self._checks.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._checks.discard)

    def remove_replica(self, name: str) -> None:
        # Its events first: a batch applied after the index forgot the replica would register
        # it again, with entries nothing would ever remove.
        sub = self.subscribers.pop(name, None)
        if sub is not None:
            sub.close(timeout=0.5)
        self.pool.remove(name)
        self.index.remove_replica(name)
        self.sessions.forget_replica(name)
        with contextlib.suppress(KeyError):  # never reported
            self.metrics.healthy.remove(name)

    def _subscribe(self, cfg: ReplicaConfig) -> None:
        if cfg.events and cfg.key not in self.subscribers:
            if self._hub is None:
                self._hub = EventHub(name="kvmesh-events")
            self.subscribers[cfg.key] = EventSubscriber(
                cfg.events,
                self.apply_events,
                cfg.key,
                replay_endpoint=cfg.replay,
                on_gap_unrepaired=self.index.clear_replica,
                hub=self._hub,
            )

    def _health_changed(self, replica: Replica) -> None:
        self.metrics.healthy.labels(replica.name).set(1.0 if replica.healthy else 0.0)
        if not replica.healthy:
            # Its events have stopped with it, and a restarted vLLM comes back with an empty
            # cache but does not say so until its first event: entries kept now would route
            # follow-ups to blocks that are gone. An empty index only costs affinity until the
            # replica's next events. Shared (REMOTE) blocks stay; the replica stays registered.
            self.index.clear_replica(replica.name)
            self.sessions.forget_replica(replica.name)
            for hook in self.on_down:
                hook(replica)

    def describe(self) -> dict[str, Any]:
        out = {
            **self.dispatcher.describe(),
            "replicas": [r.describe() for r in self.pool.replicas.values()],
            "index": self.index.stats(),
            "tokenizer_cache": self.tokenizer.cache_stats() if self.tokenizer else None,
            "subscribers": {name: s.stats() for name, s in self.subscribers.items()},
            "gc": gc_state(),
        }
        if self.costs is not None:
            out["cost"] = self.costs.describe()
        return out
