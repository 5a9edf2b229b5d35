"""The EPP's routing core: the router's pool, index, picker and tokenizer without its proxy.

``kvmesh router`` and ``kvmesh epp`` are two front ends of one scoring code: both build a
:class:`kvmesh.router.pool.Pool`, a :class:`kvmesh.index.BlockIndex` fed by the replicas' KV
events, the picker of :func:`kvmesh.router.picker.build_picker` and the
:class:`kvmesh.router.tokenize.PromptTokenizer`. What the router does around its proxy call
(refuse, decide, count the request on a replica, settle its prefill at the first byte,
speculative index entry) is done here around the gateway's call instead. Token ids come
from the router's own :class:`kvmesh.router.prompts.Prompts` (local tokenizing; ``tokenizer:
remote`` is not offered here).

Endpoints are named ``ip:port`` (the protocol's format), which is also their name in the
index, the metrics and the subset hint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import numpy as np
import xxhash

from kvmesh.errors import ConfigError
from kvmesh.events import EventSubscriber
from kvmesh.index import BlockIndex, PromptKeys
from kvmesh.router.config import ReplicaConfig
from kvmesh.router.picker import build_picker
from kvmesh.router.pool import Pool, Replica
from kvmesh.router.prompts import Prompts
from kvmesh.router.proxy import ERROR_TYPES
from kvmesh.router.scorers import RoutingRequest, SessionTable, prefill_cost, prompt_key
from kvmesh.router.tokenize import PromptTokenizer, TokenArray

from .config import EppConfig
from .metrics import EppMetrics

log = logging.getLogger(__name__)

_NO_TOKENS = np.zeros(0, dtype=np.uint32)
_TYPES = {**ERROR_TYPES, 413: "RequestTooLargeError", 429: "RateLimitError"}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """OpenAI's error shape with vLLM's type names (as the router and the replicas answer)."""
    err = {"message": message, "type": _TYPES.get(status, "InternalServerError"), "param": param}
    return json.dumps({"error": {**err, "code": status}}).encode()


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


@dataclass(slots=True)
class Refusal:
    """An immediate response instead of a route."""

    status: int
    message: str
    param: str | None = None

    @property
    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


@dataclass(slots=True)
class Ticket:
    """One routed request: counted on ``endpoint`` until :meth:`EndpointPicker.finish`."""

    endpoints: list[str]  # primary first, then fallbacks
    request: RoutingRequest
    endpoint: str = ""  # where it is counted now (the primary until the served one is known)
    cost: float = 0.0  # prefill tokens still counted on ``endpoint``
    done: bool = False
    stream: bool = False
    scores: dict[str, float] = field(default_factory=dict)


class EndpointPicker:
    """Pool + index + picker + tokenizer; the protocol handler asks it per request."""

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
        if rc.tokenizer != "local":
            raise ConfigError("routing.tokenizer: kvmesh epp tokenizes locally; valid values: local")
        self.index = index if index is not None else BlockIndex(default_block_size=rc.block_size)
        if tokenizer is None and rc.model:
            tokenizer = PromptTokenizer.from_dir(rc.model, int(rc.tokenize_cache_mb * (1 << 20)))
        self.tokenizer = tokenizer
        self.sessions = SessionTable(rc.session_capacity)
        self.picker = build_picker(rc.policy, self.index, self.sessions, rc)
        self.metrics = metrics if metrics is not None else EppMetrics()
        self.pool = Pool(
            [],
            health_interval_s=rc.health_interval_s,
            health_timeout_s=rc.health_timeout_s,
            metrics_interval_s=rc.metrics_interval_s,
            on_health_change=self._health_changed,
        )
        self._subscribers: dict[str, EventSubscriber] = {}
        self._decoder = msgspec.json.Decoder()
        self.prompts = Prompts(rc, tokenizer, self.pool, lambda: None, lambda: None)
        self._session: aiohttp.ClientSession | None = None
        self._checks: set[asyncio.Task[None]] = set()
        self.synced = False  # discovery has listed the endpoints once (readiness)
        for cfg in rc.replicas:
            self.add_endpoint(endpoint_config(cfg.url) if cfg.name is None else cfg)

    # -- lifecycle and membership --------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        await self.pool.start(self._session)

    async def stop(self) -> None:
        await self.pool.stop()
        for sub in list(self._subscribers.values()):
            await asyncio.to_thread(sub.close)
        self._subscribers.clear()
        if self._session is not None:
            await self._session.close()
        self.prompts.close()

    def add_endpoint(self, cfg: ReplicaConfig) -> None:
        """Start routing to ``cfg`` (once its health check passes); idempotent per name."""
        name = cfg.key
        if name in self.pool.replicas:
            if self.pool.replicas[name].config == cfg:
                return
            self.remove_endpoint(name)
        self.pool.add(cfg)
        self.index.add_replica(name)
        self.metrics.healthy.labels(name).set(0.0)
        if cfg.events:
            self._subscribers[name] = EventSubscriber(
                cfg.events,
                self.index.apply,
                name,
                replay_endpoint=cfg.replay,
                on_gap_unrepaired=self.index.clear_replica,
            )
        if self._session is not None:  # running: check it now rather than at the next round
            task = asyncio.get_running_loop().create_task(self.pool.check_all())
            self._checks.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._checks.discard)

    def remove_endpoint(self, name: str) -> None:
        self.pool.remove(name)
        self.index.remove_replica(name)
        self.sessions.forget_replica(name)
        with contextlib.suppress(KeyError):  # never reported
            self.metrics.healthy.remove(name)
        sub = self._subscribers.pop(name, None)
        if sub is not None:
            sub.close(timeout=0.5)

    def endpoints(self) -> list[str]:
        return list(self.pool.replicas)

    def ready(self) -> bool:
        return self.synced and bool(self.pool.healthy())

    def _health_changed(self, replica: Replica) -> None:
        self.metrics.healthy.labels(replica.name).set(1.0 if replica.healthy else 0.0)
        if not replica.healthy:
            # As in the router: a restarted vLLM comes back empty, so its entries would lie.
            self.index.clear_replica(replica.name)
            self.sessions.forget_replica(replica.name)

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
            return self.refuse(503, "no healthy model server endpoint is available; retry later")
        body: Any = None
        if raw:
            if len(raw) > self.config.max_body_bytes:
                return self.refuse(413, f"request body is larger than {self.config.max_body_bytes} bytes")
            try:
                body = self._decoder.decode(raw)
            except msgspec.DecodeError as exc:
                return self.refuse(400, f"request body is not valid JSON: {exc}")
            if not isinstance(body, dict):
                return self.refuse(400, "request body must be a JSON object")
            model = body.get("model")
            known = set(self.routing.served_model_names) or self.pool.models()
            if model is not None and known and model not in known:
                return self.refuse(404, f"The model `{model}` does not exist.", "model")
        if self._shed(candidates, headers):
            return self.refuse(429, "every eligible endpoint is saturated; sheddable request dropped")
        tokens = (
            await self.prompts.tokens(body, path.endswith("/chat/completions"), len(raw))
            if body
            else _NO_TOKENS
        )
        if len(tokens):
            key, prompt = prompt_key(tokens), PromptKeys(tokens)
        else:
            key, prompt = xxhash.xxh3_64_intdigest(raw), None
        req = RoutingRequest(
            tokens, session_id=headers.get(self.routing.session_header), key=key, prompt=prompt
        )
        decision = self.picker.pick(req, candidates)
        ranked = decision.ranked[: 1 + self.config.fallbacks]
        stream = bool(body.get("stream")) if isinstance(body, dict) else False
        return Ticket(ranked, req, stream=stream, scores=decision.scores)

    def _shed(self, candidates: Sequence[Any], headers: Mapping[str, str]) -> bool:
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

    # -- accounting -------------------------------------------------------------------------------------

    def begin(self, ticket: Ticket) -> None:
        """The gateway was told: count the request on its primary, as the router does on send."""
        name = ticket.endpoints[0]
        self.metrics.decisions.labels(self.picker.policy, name).inc()
        req = ticket.request
        self.metrics.prompt_tokens.inc(len(req.tokens))
        match = req.matches.get(name) if req.matches else None
        for start, end, medium in match.ranges if match is not None else ():
            self.metrics.hit_tokens.labels(getattr(medium, "name", str(medium))).inc(end - start)
        self._count(ticket, name)
        ttl = self.routing.speculative_ttl_s
        if ttl > 0 and len(req.tokens):
            prompt = req.prompt if req.prompt is not None else req.tokens
            asyncio.get_running_loop().call_soon(self._speculate, name, prompt, ttl)

    def served(self, ticket: Ticket, endpoint: str | None, status: int) -> None:
        """The response began, from ``endpoint`` (None: the gateway did not say; the primary)."""
        if ticket.done:
            return
        name = endpoint or ticket.endpoint
        if name != ticket.endpoint and name in self.pool.replicas:
            # The gateway fell back: the work is on the endpoint that served it.
            self.metrics.served_elsewhere.inc()
            self._uncount(ticket)
            self._count(ticket, name)
        self.metrics.served.labels(name, str(status)).inc()
        if status < 400 and ticket.request.session_id:
            self.sessions.record(ticket.request.session_id, name)
        if not ticket.stream:
            self.first_byte(ticket)  # a whole answer: its headers come after its prefill

    def first_byte(self, ticket: Ticket) -> None:
        if ticket.cost:
            self.pool.settle_prefill(ticket.endpoint, ticket.cost)
            ticket.cost = 0.0

    def finish(self, ticket: Ticket) -> None:
        if not ticket.done:
            self._uncount(ticket)
            ticket.done = True

    def _count(self, ticket: Ticket, name: str) -> None:
        ticket.endpoint = name
        ticket.cost = prefill_cost(ticket.request, name, self.routing.prefill_load_cost)
        if name in self.pool.replicas:
            self.pool.acquire(name, ticket.cost)
        self.metrics.in_flight.labels(name).inc()

    def _uncount(self, ticket: Ticket) -> None:
        self.first_byte(ticket)
        self.pool.release(ticket.endpoint)
        self.metrics.in_flight.labels(ticket.endpoint).dec()

    def _speculate(self, name: str, prompt: PromptKeys | TokenArray, ttl: float) -> None:
        try:
            self.index.add_speculative(name, prompt, ttl_s=ttl)
        except Exception:  # an index bug must not fail requests; it is logged
            log.exception("speculative index entry for %s failed", name)

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.picker.policy,
            "endpoints": [r.describe() for r in self.pool.replicas.values()],
            "index": self.index.stats(),
            "ready": self.ready(),
        }
