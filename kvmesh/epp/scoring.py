"""The EPP's side of the routing core: endpoints, body checks, the gateway's accounting.

``kvmesh router`` and ``kvmesh epp`` are two front ends of one routing core
(:class:`kvmesh.routing.core.RoutingCore`: index fed by the endpoints' KV events, pool,
tokenizer, picker, and the dispatcher that owns a request's lifecycle). What the router
does around its proxy call, the EPP does around the gateway's: decide, count the request
when the routing reply is sent (:meth:`Ticket.sent`), move it if another endpoint served it,
settle its prefill at the first response byte, release it when the response or the stream
ends. Token ids come from the core's :class:`kvmesh.routing.prompts.Prompts` (local
tokenizing; ``tokenizer: remote`` is not offered here).

Endpoints are named ``ip:port`` (the protocol's format), which is also their name in the
index, the metrics and the subset hint.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import msgspec

from kvmesh.admin.schema import TOKEN_ENV
from kvmesh.core.fleetkey import FleetKey
from kvmesh.errors import BodyError, ConfigError, ProcessError
from kvmesh.events.sink import BoundEventSink
from kvmesh.index import BlockIndex
from kvmesh.routing.body import drop_transfer_params
from kvmesh.routing.config import ReplicaConfig
from kvmesh.routing.core import RoutingCore
from kvmesh.routing.dispatcher import NO_REPLICA, Refusal, Ticket
from kvmesh.routing.scorers import ReplicaState
from kvmesh.routing.tokenize import PromptTokenizer

from .config import EppConfig
from .metrics import EppMetrics

# routing.tokenize_timeout_s unset: a pod's /tokenize (tokenizer: remote) within this, inside
# Envoy's default ext_proc message_timeout of 200 ms; past it the request goes by load and session.
EPP_TOKENIZE_TIMEOUT_S = 0.15


def _host_of(name: str) -> str:
    """``10.0.0.5:8000`` -> ``10.0.0.5``; ``[fd00::5]:8000`` -> ``fd00::5``."""
    return name.rsplit(":", 1)[0].strip("[]")


def endpoint_name(url: str) -> str:
    """``http://10.0.0.5:8000`` -> ``10.0.0.5:8000`` (the protocol's ``ip:port``)."""
    return url.split("://", 1)[-1].rstrip("/")


def endpoint_config(spec: str) -> ReplicaConfig:
    """An endpoint from ``IP:PORT[,events=EP][,replay=EP]`` or the router's ``URL[,...]`` form."""
    if "://" not in spec.split(",", 1)[0]:
        spec = "http://" + spec
    cfg = ReplicaConfig.parse(spec)
    if cfg.name is not None and cfg.name != endpoint_name(cfg.url):
        raise ConfigError(f"endpoint {spec!r}: an EPP endpoint is named by its ip:port; drop name=")
    return cfg.model_copy(update={"name": endpoint_name(cfg.url)})


class EndpointPicker:
    """The routing core plus what only the EPP does; the protocol handler asks it per request."""

    def __init__(
        self,
        config: EppConfig,
        *,
        index: BlockIndex | None = None,
        tokenizer: PromptTokenizer | None = None,
        metrics: EppMetrics | None = None,
    ) -> None:
        self.config = config
        rc = self.routing = config.routing
        self.metrics = metrics if metrics is not None else EppMetrics()
        # On Envoy's path a /tokenize must answer inside the ext_proc message timeout.
        budget = rc.tokenize_timeout_s or EPP_TOKENIZE_TIMEOUT_S
        self.core = RoutingCore(
            rc.model_copy(update={"replicas": (), "tokenize_timeout_s": budget}),
            self.metrics,
            index=index,
            tokenizer=tokenizer,
            client=lambda: self._session,  # tokenizer: remote asks an endpoint's /tokenize
            admin_token=os.environ.get(TOKEN_ENV),  # the replicas' admin APIs (policy cost)
        )
        self.index, self.pool, self.tokenizer = self.core.index, self.core.pool, self.core.tokenizer
        self.sessions, self.picker, self.dispatcher = (
            self.core.sessions,
            self.core.picker,
            self.core.dispatcher,
        )
        self.costs = self.core.costs
        # Loaded now so that a bad key file stops the start.
        self.fleet_key = FleetKey.from_config(config.fleet_key_file or rc.fleet_key_file)
        # routed requests by ticket id, while their routing stream is open (the first-byte
        # observer's stream names them: kvmesh.epp.protocol)
        self.tickets: dict[str, Ticket] = {}
        self._ids = itertools.count(1)
        self._session: aiohttp.ClientSession | None = None
        self.synced = False  # discovery has listed the endpoints once (readiness)
        # Endpoint names by pod address, for the bound event sink's topics (kv@<pod>@<model>).
        self._by_host: dict[str, tuple[str, ...]] = {}
        self.sink: BoundEventSink | None = None
        for cfg in rc.replicas:
            # named by ip:port, keeping its event sockets
            self.add_endpoint(cfg if cfg.name else cfg.model_copy(update={"name": endpoint_name(cfg.url)}))

    # -- lifecycle and membership --------------------------------------------------------------------

    async def start(self) -> None:
        bind = self.config.events_bind
        if bind:  # first: a port in use stops the start with nothing running
            try:
                cfg = self.config
                self.sink = BoundEventSink(bind, self.core.apply_events, self.index.clear_replica,
                                           self._at_pod, cfg.events_topic)  # fmt: skip
            except ValueError as exc:
                raise ProcessError(f"kvmesh epp: {exc}") from exc
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        await self.core.start(self._session)

    async def stop(self) -> None:
        if self.sink is not None:
            await asyncio.to_thread(self.sink.close)
        await self.core.stop()
        if self._session is not None:
            await self._session.close()

    def add_endpoint(self, cfg: ReplicaConfig) -> None:
        """Start routing to ``cfg`` (once its health check passes); idempotent per name."""
        self.core.add_replica(cfg)
        host = _host_of(cfg.key)
        self._by_host[host] = tuple(sorted({*self._by_host.get(host, ()), cfg.key}))

    def remove_endpoint(self, name: str) -> None:
        host = _host_of(name)
        rest = tuple(n for n in self._by_host.get(host, ()) if n != name)
        if rest:
            self._by_host[host] = rest
        else:
            self._by_host.pop(host, None)
        # A batch the sink applies after this finds the replica unregistered and is dropped
        # (apply_events does not register), as a subscriber's late batch is.
        self.core.remove_replica(name)

    # -- the bound event sink (events_bind: pods publish to the EPP; kvmesh.events.sink) ------------

    def _at_pod(self, pod: str) -> tuple[str, ...]:
        """The endpoints a topic's pod names, on the sink's thread: ``ip:port`` exactly (llm-d's
        form; an IPv6 one unbracketed, ``fd00::5:8000``, too), else every endpoint at the IP."""
        at = self._by_host  # the loop thread sets its keys one at a time: each get is atomic
        host, _, port = pod.rpartition(":")
        if port.isdigit() and host:
            name = f"[{host.strip('[]')}]:{port}" if ":" in host.strip("[]") else pod
            if name in at.get(host.strip("[]"), ()):
                return (name,)
        return at.get(pod.strip("[]"), ())

    def endpoints(self) -> list[str]:
        return list(self.pool.replicas)

    def ready(self) -> bool:
        return self.synced and bool(self.pool.healthy())

    # -- decisions ------------------------------------------------------------------------------------

    async def decide(
        self,
        raw: bytes,
        *,
        path: str = "/v1/completions",
        headers: Mapping[str, str] | None = None,
        subset: Sequence[str] | None = None,
    ) -> Ticket | Refusal:
        """Where a request with body ``raw`` goes, or why it does not go anywhere."""
        headers = headers or {}
        candidates = self.pool.candidates()
        if subset is not None:
            allowed = set(subset)
            candidates = [c for c in candidates if c.name in allowed]
            if not candidates:
                return self.refuse(503, "no endpoint of the subset hint is eligible", "subset")
        if not candidates:
            return self.refuse(503, NO_REPLICA)
        body: dict[str, Any] | None = None
        forward: bytes | None = None
        chat = path.endswith("/chat/completions")
        if raw:
            if len(raw) > self.config.max_body_bytes:
                return self.refuse(413, f"request body is larger than {self.config.max_body_bytes} bytes")
            try:
                body = await self.core.bodies.decode(raw, chat)
            except BodyError as exc:
                return self.refuse(exc.status, exc.message, exc.field)
            if drop_transfer_params(body):
                forward = msgspec.json.encode(body)  # only kvmesh's PD code may set them
        if self._shed(candidates, headers):
            return self.refuse(429, "every eligible endpoint is saturated; sheddable request dropped")
        got = await self.dispatcher.decide(
            body,
            raw,
            candidates,
            chat=chat,
            session=headers.get(self.routing.session_header),
            limit=1 + self.config.fallbacks,
        )
        if isinstance(got, Refusal):
            self.metrics.refusals.labels(str(got.status)).inc()
        else:
            got.body = forward
        return got

    def _shed(self, candidates: Sequence[ReplicaState], headers: Mapping[str, str]) -> bool:
        limit = self.config.shed_load
        if limit <= 0 or min(c.load for c in candidates) < limit:
            return False
        try:
            return int(headers.get(self.config.priority_header, "0")) < 0
        except ValueError:
            return False

    def refuse(self, status: int, message: str, param: str | None = None) -> Refusal:
        self.metrics.refusals.labels(str(status)).inc()
        return Refusal(status, message, param)

    # -- the gateway's accounting -------------------------------------------------------------------------

    def register(self, ticket: Ticket) -> str:
        """An id for ``ticket`` (the routing stream removes it when it ends)."""
        tid = f"{next(self._ids):x}"
        self.tickets[tid] = ticket
        return tid

    def served(self, ticket: Ticket, endpoint: str | None, status: int) -> None:
        """The response began, from ``endpoint`` (None: the gateway did not say; the primary)."""
        name = endpoint or ticket.endpoint or ticket.ranked[0]
        if name != ticket.endpoint and name in self.pool.replicas:
            self.metrics.served_elsewhere.inc()
        ticket.served(name, status)
        self.metrics.served.labels(name, str(status)).inc()
        if not ticket.stream:
            ticket.first_byte()  # a whole answer: its headers come after its prefill

    def describe(self) -> dict[str, Any]:
        core = self.core.describe()
        return {
            "policy": core["policy"],
            "endpoints": core["replicas"],
            "index": core["index"],
            "ready": self.ready(),
            "gc": core["gc"],
            **({"cost": core["cost"]} if "cost" in core else {}),
            **({"event_sink": self.sink.stats()} if self.sink is not None else {}),
        }
