"""The router's HTTP face: an OpenAI-compatible proxy that picks a replica per request.

Per request: read the body once, decode it once (msgspec), tokenize once (cached), ask the
index once, score, and forward the *original bytes* (no re-encoding) over a pooled
keep-alive connection. Streams are relayed chunk by chunk as they arrive. A connect
failure before anything was sent to the client goes to the next replica in the ranking.
The speculative index entry is written while the upstream call is in flight, off the
request's critical path, so that a burst sharing a prefix still lands on one replica.

Errors use OpenAI's shape (see :mod:`kvmesh.router.proxy`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
import xxhash
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvmesh.errors import ClosedError, UpstreamError
from kvmesh.events import EventSubscriber
from kvmesh.index import BlockIndex, PromptKeys
from kvmesh.router.config import RouterConfig
from kvmesh.router.controller import Controller
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.pd import PDRouter
from kvmesh.router.picker import build_picker
from kvmesh.router.pool import Pool, Replica
from kvmesh.router.prompts import Prompts
from kvmesh.router.proxy import ERROR_TYPES, RETRYABLE, end_to_end, error_response, relay
from kvmesh.router.rebuild import Rebuilder
from kvmesh.router.scorers import RoutingRequest, SessionTable, prefill_cost, prompt_key
from kvmesh.router.tokenize import PromptTokenizer, TokenArray
from kvmesh.router.upstream import Upstream

log = logging.getLogger(__name__)

_NO_REPLICA = "no healthy replica is available; retry later"
# After a speculative entry's ttl: the loop's timers fire a little late, never early.
_EXPIRY_SLACK_S = 0.001


class RouterService:
    """Pool + index + picker + tokenizer behind an aiohttp application (see :meth:`make_app`)."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        index: BlockIndex | None = None,
        tokenizer: PromptTokenizer | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.config = config
        self.index = index if index is not None else BlockIndex(default_block_size=config.block_size)
        if tokenizer is None and config.model and config.tokenizer == "local":
            tokenizer = PromptTokenizer.from_dir(config.model, int(config.tokenize_cache_mb * (1 << 20)))
        self.tokenizer = tokenizer
        self.sessions = SessionTable(config.session_capacity)
        self.picker = build_picker(config.policy, self.index, self.sessions, config)
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self._children: dict[tuple[object, ...], Any] = {}  # see _child
        self.pool = Pool(
            config.replicas,
            health_interval_s=config.health_interval_s,
            health_timeout_s=config.health_timeout_s,
            metrics_interval_s=config.metrics_interval_s,
            on_health_change=self._health_changed,
        )
        for name in self.pool.replicas:
            self.index.add_replica(name)  # so REMOTE blocks count for it before its first event
        self._decoder = msgspec.json.Decoder()
        self._client: aiohttp.ClientSession | None = None
        self._subscribers: list[EventSubscriber] = []
        self.prompts = Prompts(config, self.tokenizer, self.pool, lambda: self._client, self._tokenize_failed)
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=config.connect_timeout_s,
            sock_connect=config.connect_timeout_s,
            sock_read=config.read_timeout_s,
        )
        # For the router's own small calls (/v1/models, /tokenize): never the generation timeout.
        self._short_timeout = aiohttp.ClientTimeout(total=config.connect_timeout_s + config.health_timeout_s)
        # The proxied POSTs: a lean HTTP/1.1 client of its own (see kvmesh.router.upstream).
        self._upstream = Upstream(config.connect_timeout_s, config.read_timeout_s)
        if self.tokenizer is None and config.tokenizer == "local":
            log.warning("no --model given: requests are routed by load and session only, not by prefix")
        # The cache controller under /kvmesh/v1/: its section of the config, plus the environment.
        self.controller = Controller(
            config.controller.with_env(),
            host=config.host,
            tokenizer=self.tokenizer,
            remote_tokens=self.prompts.remote if config.tokenizer == "remote" else None,
            on_register=self._engine_registered,
        )
        self.rebuilder = Rebuilder(self.index.apply, self.controller.config)
        self.pd = PDRouter(self) if config.pd.enabled else None  # kvmesh.router.pd

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/kvmesh/state", self._state)
        self.controller.mount(app)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    # -- lifecycle ------------------------------------------------------------------------------

    async def _startup(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=300)
        # auto_decompress off and no Accept-Encoding of our own: bodies pass through byte for byte.
        self._client = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding",),
        )
        await self.pool.start(self._client)
        for replica in self.pool.replicas.values():
            cfg = replica.config
            if cfg.events:
                self._subscribers.append(
                    EventSubscriber(
                        cfg.events,
                        self.index.apply,
                        replica.name,
                        replay_endpoint=cfg.replay,
                        on_gap_unrepaired=self.index.clear_replica,
                    )
                )

        for replica in self.pool.replicas.values():
            if replica.config.admin:
                self.rebuilder.start(self._client, replica.name, replica.config.admin)

    def _engine_registered(self, name: str, url: str) -> None:
        """An engine registered with the controller for the first time since this router
        started: when it is one of the replicas (same name), refill the index from it."""
        replica = self.pool.replicas.get(name)
        if replica is not None and not replica.config.admin and self._client is not None:
            self.rebuilder.start(self._client, name, url)

    def _tokenize_failed(self) -> None:
        self.metrics.errors.labels("tokenize").inc()

    async def _cleanup(self, app: web.Application) -> None:
        await self.pool.stop()
        for sub in self._subscribers:
            await asyncio.to_thread(sub.close)
        self._subscribers = []
        if self._client is not None:
            await self._client.close()
        await self._upstream.close()
        self.rebuilder.cancel()
        self.prompts.close()

    def _health_changed(self, replica: Replica) -> None:
        self.metrics.healthy.labels(replica.name).set(1.0 if replica.healthy else 0.0)
        if not replica.healthy:
            # Its events have stopped with it, and a restarted vLLM comes back with an empty
            # cache but does not say so until its first event: entries kept now would route
            # follow-ups to blocks that are gone. An empty index only costs affinity until the
            # replica's next events. Shared (REMOTE) blocks stay; the replica stays registered.
            self.index.clear_replica(replica.name)
            self.sessions.forget_replica(replica.name)

    # -- OpenAI endpoints ---------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "/v1/completions", chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "/v1/chat/completions", chat=True)

    async def _route(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        t0 = time.perf_counter()
        try:
            raw = await asyncio.wait_for(request.read(), self.config.body_timeout_s)
        except TimeoutError:
            resp = self._refuse(path, 408, f"request body not received within {self.config.body_timeout_s} s")
            resp.headers["Retry-After"] = str(self.config.retry_after_s)
            return resp
        except web.HTTPRequestEntityTooLarge:
            limit = self.config.max_body_bytes
            return self._refuse(path, 413, f"request body is larger than {limit} bytes", "body")
        try:
            body = self._decoder.decode(raw)
        except msgspec.DecodeError as exc:
            return self._refuse(path, 400, f"request body is not valid JSON: {exc}", "body")
        if not isinstance(body, dict):
            return self._refuse(path, 400, "request body must be a JSON object", "body")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            return self._refuse(path, 400, f"'model' must be a string, got {type(model).__name__}", "model")
        known = set(self.config.served_model_names) or self.pool.models()
        if model is not None and known and model not in known:
            return self._refuse(path, 404, f"The model `{model}` does not exist.", "model")
        if not self.pool.candidates():
            return self._unavailable(path)
        tokens = await self.prompts.tokens(body, chat, len(raw))
        if len(tokens):
            # The block keys are hashed once, for the match and the speculative entry both. A
            # salted request matches only blocks of its salt (vLLM keys its first block by it).
            salt = body.get("cache_salt")
            key = prompt_key(tokens)
            prompt = PromptKeys(tokens, cache_salt=salt if isinstance(salt, str) and salt else None)
        else:
            key, prompt = xxhash.xxh3_64_intdigest(raw), None
        session = request.headers.get(self.config.session_header)
        req = RoutingRequest(tokens, session_id=session, key=key, prompt=prompt)
        if self.pd is not None:
            return await self.pd.route(request, path, raw, body, req, t0)
        candidates = self.pool.candidates()
        if not candidates:
            return self._unavailable(path)
        decision = self.picker.pick(req, candidates)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "route %d tokens (session %s) -> %s; scores %s; parts %s; states %s",
                len(tokens),
                session,
                decision.ranked,
                decision.scores,
                decision.parts,
                [(r.name, r.load, r.prefill_tokens, r.kv_usage) for r in candidates],
            )
        return await self._forward(request, path, raw, bool(body.get("stream")), decision.ranked, req, t0)

    async def _forward(
        self,
        request: web.Request,
        path: str,
        raw: bytes,
        stream: bool,
        ranked: list[str],
        req: RoutingRequest,
        t0: float,
    ) -> web.StreamResponse:
        if self._client is None:
            raise ClosedError("the router application was not started")
        headers = end_to_end(request.headers).items()
        attempts = 0
        for name in ranked:
            replica = self.pool.replicas.get(name)
            if replica is None or not replica.healthy:
                continue  # another request found it dead since the ranking was made
            if attempts == self.config.max_attempts:
                break
            attempts += 1
            if attempts == 1:
                self.metrics.overhead.observe(time.perf_counter() - t0)
            else:
                self.metrics.retries.inc()
            settle = self._acquire(name, req)
            sent = time.perf_counter()
            try:
                resp = await self._upstream.post(replica.url, path, raw, headers)
            except RETRYABLE as exc:
                self._release(name, settle)
                self.pool.mark_failed(name, f"POST {path} failed: {exc!r}")
                self.metrics.errors.labels("upstream_connect").inc()
                continue
            except TimeoutError:
                self._release(name, settle)
                return self._refuse(path, 504, f"replica {name} did not answer in time")
            except UpstreamError as exc:
                self._release(name, settle)
                return self._refuse(path, 502, f"replica {name} failed: {exc}")
            try:
                self._child(self.metrics.upstream_latency, name).observe(time.perf_counter() - sent)
                if resp.status < 400:
                    self._record(name, req)
                self._child(self.metrics.requests, path, str(resp.status)).inc()
                return await relay(request, resp, stream, name, self._broken, settle)
            finally:
                resp.release()
                self._release(name, settle)
        if attempts:
            return self._unavailable(path, f"could not connect to {attempts} replica(s); retry later")
        return self._unavailable(path)

    # -- bookkeeping ---------------------------------------------------------------------------------

    def _acquire(self, name: str, req: RoutingRequest) -> Callable[[], None]:
        """Count the request on ``name``; returns what settles its prefill work (callable twice:
        at its first byte, and at its release)."""
        # Its prefill work queues on the replica until its first byte is back.
        cost = prefill_cost(req, name, self.config.prefill_load_cost)
        self.pool.acquire(name, cost)
        self._child(self.metrics.in_flight, name).inc()
        ttl = self.config.speculative_ttl_s
        if ttl > 0 and len(req.tokens) and not _on_gpu(req, name, self.config.block_size):
            # Runs as soon as the proxy awaits the upstream: off the critical path.
            prompt = req.prompt if req.prompt is not None else req.tokens
            asyncio.get_running_loop().call_soon(self._speculate, name, prompt, ttl)
        return functools.partial(self._settle_once, name, [cost])

    def _speculate(self, name: str, tokens: PromptKeys | TokenArray, ttl: float) -> None:
        try:
            self.index.add_speculative(name, tokens, ttl_s=ttl)
        except Exception:  # an index bug must not fail requests; it is logged
            log.exception("speculative index entry for %s failed", name)
            return
        # Removing an expired entry costs about as much as adding it (~1 ms at 32k tokens).
        # The next match would do it, on its request's critical path: do it when it expires.
        # Matches still expire first, so what they see (and every decision) is unchanged.
        asyncio.get_running_loop().call_later(ttl + _EXPIRY_SLACK_S, self._expire_speculative)

    def _expire_speculative(self) -> None:
        try:
            self.index.expire_speculative()
        except Exception:  # an index bug must not fail requests; it is logged
            log.exception("expiring speculative index entries failed")

    def _settle_once(self, name: str, cost: list[float]) -> None:
        if cost[0]:
            self.pool.settle_prefill(name, cost[0])
            cost[0] = 0.0

    def _release(self, name: str, settle: Callable[[], None]) -> None:
        settle()
        self.pool.release(name)
        self._child(self.metrics.in_flight, name).dec()

    def _record(self, name: str, req: RoutingRequest) -> None:
        if req.session_id:
            self.sessions.record(req.session_id, name)
        self._child(self.metrics.decisions, self.picker.policy, name).inc()
        n = len(req.tokens)
        self.metrics.prompt_tokens.inc(n)
        match = req.matches.get(name) if req.matches else None
        if match is not None:
            for start, end, medium in match.ranges:
                self._child(self.metrics.hit_tokens, getattr(medium, "name", str(medium))).inc(end - start)

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, kept: prometheus_client takes a lock and builds tuples per call."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _broken(self) -> None:
        self.metrics.errors.labels("upstream_broken").inc()

    def _refuse(self, path: str, status: int, message: str, param: str | None = None) -> web.Response:
        self.metrics.errors.labels(ERROR_TYPES.get(status, str(status))).inc()
        self.metrics.requests.labels(path, str(status)).inc()
        return error_response(status, message, param)

    def _unavailable(self, path: str, message: str = _NO_REPLICA) -> web.Response:
        resp = self._refuse(path, 503, message)
        resp.headers["Retry-After"] = str(self.config.retry_after_s)
        return resp

    # -- other endpoints -------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.StreamResponse:
        client = self._client
        for replica in self.pool.healthy():
            if client is None:
                break
            try:
                url, timeout = replica.url + "/v1/models", self._short_timeout
                async with client.get(url, headers=_auth(request), timeout=timeout) as resp:
                    body = await resp.read()
                    ctype = resp.headers.get("Content-Type", "application/json")
                    return web.Response(status=resp.status, body=body, headers={"Content-Type": ctype})
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.pool.mark_failed(replica.name, f"GET /v1/models failed: {exc!r}")
        return self._unavailable("/v1/models")

    async def _health(self, request: web.Request) -> web.StreamResponse:
        healthy = len(self.pool.healthy())
        data = {"status": "ok" if healthy else "unavailable", "healthy_replicas": healthy}
        return web.json_response(data, status=200 if healthy else 503)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _state(self, request: web.Request) -> web.StreamResponse:
        data = {
            "policy": self.picker.policy,
            "replicas": [r.describe() for r in self.pool.replicas.values()],
            "index": self.index.stats(),
            "sessions": len(self.sessions),
            "tokenizer_cache": self.tokenizer.cache_stats() if self.tokenizer else None,
            "subscribers": {s.replica: s.stats() for s in self._subscribers},
        }
        return web.json_response(data)


def _on_gpu(req: RoutingRequest, name: str, block_size: int) -> bool:
    """Whether the index already has every whole block of the prompt on ``name``'s GPU.

    Then a speculative entry would add nothing, and skipping it saves hashing the prompt again.
    """
    match = req.matches.get(name) if req.matches else None
    if match is None or not match.ranges:
        return False
    whole = len(req.tokens) // block_size * block_size
    return match.ranges[-1][1] >= whole and all(getattr(m, "name", m) == "GPU" for _, _, m in match.ranges)


def _auth(request: web.Request) -> dict[str, str]:
    value = request.headers.get("Authorization")
    return {"Authorization": value} if value else {}
