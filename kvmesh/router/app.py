"""The router's HTTP face: an OpenAI-compatible proxy that picks a replica per request.

Per request: read the body once, decode it once (msgspec), then the routing core's
dispatcher (:mod:`kvmesh.routing.dispatcher`) tokenizes it (cached), matches it in the
index once and picks; the *original bytes* are forwarded (no re-encoding) over a pooled
keep-alive connection. Streams are relayed chunk by chunk as they arrive. A connect
failure before anything was sent to the client goes to the next replica in the ranking.
The speculative index entry is written while the upstream call is in flight, off the
request's critical path, so that a burst sharing a prefix still lands on one replica.

Errors use OpenAI's shape (see :mod:`kvmesh.router.proxy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvmesh.core.fleetkey import FleetKey
from kvmesh.errors import BodyError, ClosedError, ReplicaDownError, UpstreamBrokenError, UpstreamError
from kvmesh.index import BlockIndex
from kvmesh.router.config import RouterConfig
from kvmesh.router.controller import Controller
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.pd import PDRouter
from kvmesh.router.proxy import RETRYABLE, end_to_end, error_response, opening, relay
from kvmesh.router.rebuild import Rebuilder
from kvmesh.router.upstream import Hold, Upstream
from kvmesh.routing.body import drop_transfer_params
from kvmesh.routing.core import RoutingCore
from kvmesh.routing.dispatcher import ERROR_TYPES, NO_REPLICA, Refusal, Ticket
from kvmesh.routing.labels import LabelCache
from kvmesh.routing.pool import Replica
from kvmesh.routing.replies import MODELS_BYTES, ReplyError, read_capped
from kvmesh.routing.tokenize import PromptTokenizer

log = logging.getLogger(__name__)


async def read_parts(request: web.Request, limit: int) -> list[bytes]:
    """The request's body in the pieces it arrived in, at most ``limit`` bytes (else
    ``HTTPRequestEntityTooLarge``). Not ``request.read()``: with ``client_max_size`` set it lets
    the whole body pile up in the stream's buffer and then copies it three times in one go
    (:mod:`kvmesh.bodyworker` says why that matters)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise web.HTTPRequestEntityTooLarge(limit, declared)
    parts: list[bytes] = []
    size = 0
    async for part in request.content.iter_any():
        size += len(part)
        if size > limit:
            raise web.HTTPRequestEntityTooLarge(limit, size)
        parts.append(part)
    return parts


class RouterService:
    """The routing core (:class:`kvmesh.routing.core.RoutingCore`) behind an aiohttp
    application (see :meth:`make_app`)."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        index: BlockIndex | None = None,
        tokenizer: PromptTokenizer | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self._client: aiohttp.ClientSession | None = None
        self.core = RoutingCore(
            config,
            self.metrics,
            index=index,
            tokenizer=tokenizer,
            client=lambda: self._client,
            on_tokenize_error=self._tokenize_failed,
            admin_token=config.controller.with_env().token,
        )
        self.index, self.pool, self.tokenizer = self.core.index, self.core.pool, self.core.tokenizer
        self.sessions, self.picker, self.prompts = self.core.sessions, self.core.picker, self.core.prompts
        self.dispatcher, self.costs = self.core.dispatcher, self.core.costs
        # Loaded now so that a bad key file stops the start; the router signs nothing yet.
        self.fleet_key = FleetKey.from_config(config.fleet_key_file)
        self._labels = LabelCache()
        self._owed: dict[str, set[Hold]] = {}  # replica -> holds on the answers it owes
        self.core.on_down.append(self._cut_owed)
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=config.connect_timeout_s,
            sock_connect=config.connect_timeout_s,
            sock_read=config.read_timeout_s,
        )
        # For the router's own small calls (/v1/models, /tokenize): never the generation timeout.
        self._short_timeout = aiohttp.ClientTimeout(total=config.connect_timeout_s + config.health_timeout_s)
        # The proxied POSTs: a lean HTTP/1.1 client of its own (see kvmesh.router.upstream).
        self._upstream = Upstream(
            config.connect_timeout_s, config.read_timeout_s, max_answer_bytes=config.max_answer_bytes
        )
        if self.tokenizer is None and config.tokenizer == "local":
            log.warning("no --model given: requests are routed by load and session only, not by prefix")
        # The cache controller under /kvmesh/v1/: its section of the config, plus the environment.
        self.controller = Controller(
            config.controller.with_env(),
            host=config.host,
            tokenizer=self.tokenizer,
            remote_tokens=self.prompts.lookup_tokens if config.tokenizer == "remote" else None,
            on_register=self._engine_registered,
        )
        self.rebuilder = Rebuilder(self.core.apply_events, self.controller.config)
        self.pd = PDRouter(self) if config.pd.enabled else None  # kvmesh.router.pd

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/kvmesh/state", self._state)
        if self.costs is not None:
            self.costs.mount(app)
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
        await self.core.start(self._client)
        for replica in self.pool.replicas.values():
            if replica.config.admin:
                self.rebuilder.start(self._client, replica.name, replica.config.admin)

    def _engine_registered(self, name: str, url: str) -> None:
        """An engine registered with the controller for the first time since this router
        started: when it is one of the replicas (same name), refill the index from it."""
        replica = self.pool.replicas.get(name)
        if replica is not None and not replica.config.admin and self._client is not None:
            self.rebuilder.start(self._client, name, url)
        if replica is not None and self.costs is not None:
            self.costs.admin_registered(name, url)

    def _tokenize_failed(self) -> None:
        self.metrics.errors.labels("tokenize").inc()

    async def _cleanup(self, app: web.Application) -> None:
        await self.core.stop()
        if self._client is not None:
            await self._client.close()
        await self._upstream.close()
        self.rebuilder.cancel()

    # -- OpenAI endpoints ---------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "/v1/completions", chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "/v1/chat/completions", chat=True)

    async def _route(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        t0 = time.perf_counter()
        try:
            parts = await asyncio.wait_for(
                read_parts(request, self.config.max_body_bytes), self.config.body_timeout_s
            )
        except TimeoutError:
            resp = self._refuse(path, 408, f"request body not received within {self.config.body_timeout_s} s")
            resp.headers["Retry-After"] = str(self.config.retry_after_s)
            return resp
        except web.HTTPRequestEntityTooLarge:
            limit = self.config.max_body_bytes
            return self._refuse(path, 413, f"request body is larger than {limit} bytes", "body")
        try:
            body, raw = await self.core.bodies.decode_parts(parts, chat)
        except BodyError as exc:
            return self._refuse(path, exc.status, exc.message, exc.field)
        if drop_transfer_params(body):
            # Only the router's own PD code may tell a replica where to pull KV from.
            raw = msgspec.json.encode(body)
            log.debug("dropped a client's kv_transfer_params")
        req = await self.dispatcher.prepare(
            body, raw, chat=chat, session=request.headers.get(self.config.session_header)
        )
        if isinstance(req, Refusal):
            return self._refuse(path, req.status, req.message, req.param)
        if self.pd is not None:
            return await self.pd.route(request, path, raw, body, req, t0)
        candidates = self.pool.candidates()
        if not candidates:
            return self._unavailable(path)
        ticket = self.dispatcher.route(req, candidates, stream=bool(body.get("stream")))
        if log.isEnabledFor(logging.DEBUG):
            decision = ticket.decision
            log.debug(
                "route %d tokens (session %s) -> %s; scores %s; parts %s; states %s",
                len(req.tokens),
                req.session_id,
                ticket.ranked,
                ticket.scores,
                decision.parts if decision is not None else None,
                [(r.name, r.load, r.prefill_tokens, r.kv_usage) for r in candidates],
            )
        return await self._forward(request, path, raw, ticket, t0)

    async def _forward(
        self, request: web.Request, path: str, raw: bytes, ticket: Ticket, t0: float
    ) -> web.StreamResponse:
        if self._client is None:
            raise ClosedError("the router application was not started")
        headers = end_to_end(request.headers).items()
        attempts = 0
        broke: str | None = None  # the last answer that broke off before its opening
        for name in ticket.ranked:
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
            ticket.sent(name)
            sent = time.perf_counter()
            with self._owing(name) as hold:
                try:
                    resp = await self._upstream.post(replica.url, path, raw, headers, hold)
                    headed = time.perf_counter()
                    try:
                        first = await opening(resp, ticket.stream)
                    except BaseException:
                        resp.release()  # not read to its end: the connection is closed, not kept
                        raise
                except RETRYABLE as exc:
                    ticket.failed()
                    self.pool.mark_failed(name, f"POST {path} failed: {exc!r}")
                    self.metrics.errors.labels("upstream_connect").inc()
                    continue
                except ReplicaDownError as exc:
                    # Taken out while it owed the answer, none of which reached the client
                    # (it hangs: see _cut_owed): another replica may answer.
                    ticket.failed()
                    self.metrics.errors.labels("upstream_down").inc()
                    broke = f"replica {name} stopped answering: {exc}"
                    continue
                except UpstreamBrokenError as exc:
                    # It died mid-answer (its connection closed, in the head or before the
                    # opening) before anything of the answer reached the client: another
                    # replica may answer, as after a connect failure.
                    ticket.failed()
                    self._broken()
                    self.pool.mark_failed(name, f"POST {path}: the answer broke off: {exc}")
                    broke = f"replica {name} broke off its answer: {exc}"
                    continue
                except UpstreamError as exc:  # malformed or too large: the replica is up
                    ticket.finished()
                    return self._refuse(path, 502, f"replica {name} failed: {exc}")
                except TimeoutError:
                    ticket.finished()
                    return self._refuse(path, 504, f"replica {name} did not answer in time")
                except BaseException:  # cancelled (the client left)
                    ticket.finished()
                    raise
                try:
                    self._labels.get(self.metrics.upstream_latency, name).observe(headed - sent)
                    ticket.served(name, resp.status)
                    if not ticket.stream:
                        ticket.first_byte()  # a whole answer: its headers come after its prefill
                    self._labels.get(self.metrics.requests, path, str(resp.status)).inc()
                    shown = name if self.config.replica_header else None
                    return await relay(request, resp, first, ticket.stream, name, self._broken,
                                       ticket.first_byte, shown, self.config.write_timeout_s)  # fmt: skip
                finally:
                    resp.release()
                    ticket.finished()
        ticket.finished()
        if broke is not None:
            return self._refuse(path, 502, f"{broke} ({attempts} replica(s) tried)")
        if attempts:
            return self._unavailable(path, f"could not connect to {attempts} replica(s); retry later")
        return self._unavailable(path)

    @contextlib.contextmanager
    def _owing(self, name: str) -> Iterator[Hold]:
        """A hold on the connection of an answer ``name`` owes, for :meth:`_cut_owed`."""
        hold = Hold()
        owed = self._owed.setdefault(name, set())
        owed.add(hold)
        try:
            yield hold
        finally:
            owed.discard(hold)

    def _cut_owed(self, replica: Replica) -> None:
        """``replica`` was taken out: cut the answers it owes that have gone quiet. A replica
        that hangs (a stopped process, a wedged GPU) keeps its connections open and breaks
        nothing, and a whole answer's read timeout must cover the longest generation: without
        this its answers would wait that long. One cut before its opening goes to the next
        replica; a stream already relayed ends with an error event. Answers it sent a byte of
        within ``health_timeout_s`` are left: a replica taken out by late checks may only be
        busy (or this router may be)."""
        holds = self._owed.get(replica.name)
        if not holds:
            return
        why = f"replica {replica.name} was taken out ({replica.last_error or 'its health checks failed'})"
        cut = sum(hold.cut(why, self.config.health_timeout_s) for hold in list(holds))
        if cut:
            log.warning("%s: cut the %d answer(s) it owed that had gone quiet", why, cut)

    def _broken(self) -> None:
        self.metrics.errors.labels("upstream_broken").inc()

    def _refuse(self, path: str, status: int, message: str, param: str | None = None) -> web.Response:
        self.metrics.errors.labels(ERROR_TYPES.get(status, str(status))).inc()
        self.metrics.requests.labels(path, str(status)).inc()
        return error_response(status, message, param)

    def _unavailable(self, path: str, message: str = NO_REPLICA) -> web.Response:
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
                    body = await read_capped(resp, MODELS_BYTES)
                    ctype = resp.headers.get("Content-Type", "application/json")
                    return web.Response(status=resp.status, body=body, headers={"Content-Type": ctype})
            except ReplyError as exc:  # too large: the next replica may answer; it is up
                log.warning("replica %s: GET /v1/models: %s", replica.name, exc)
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
        return web.json_response(self.core.describe())


def _auth(request: web.Request) -> dict[str, str]:
    value = request.headers.get("Authorization")
    return {"Authorization": value} if value else {}
