"""Prefill/decode disaggregation in the router (``kvmesh router --pd``).

Replicas carry a role (``prefill``: a kv_producer, ``decode``: a kv_consumer, ``both``:
kv_both, either half). Per request:

1. The decode replica is picked first, among ``decode|both``, by the ordinary picker
   (prefix hits, load, session, queued prefill work): it holds the request for its whole
   generation, so that choice matters most.
2. Its uncached prompt tokens are the prompt's tokens less the prefix the index says it
   holds (any medium: kvmesh's connector loads CPU, disk and shared-tier hits itself).
   At most ``pd_threshold_tokens`` of them (llm-d's non-cached-tokens rule): the decode
   replica computes them itself; a second hop would cost more than it saves.
3. Else a prefill replica is picked among ``prefill|both`` (not the decode replica) by the
   same picker: prefix hits, and the prefill work this router already queued there. It is
   sent the client's body with ``max_tokens`` 1, no stream and ``kv_transfer_params:
   {"do_remote_decode": true}``; its answer's top-level ``kv_transfer_params`` (opaque
   here: where the consumer fetches the KV) goes into the decode request, which is
   otherwise the client's own body and is relayed (streamed or not) as in the colocated path.
4. A prefill that fails (connect failure on every prefill replica tried, an error status,
   a broken answer, ``prefill_timeout_s`` passed, or no ``kv_transfer_params`` in its
   answer) is not the client's problem: the decode request goes without transfer
   parameters and the decode replica computes the prompt (path ``fallback``, reason counted).

Metrics: ``kvmesh_router_pd_requests_total{path=pd|decode_only|fallback}``,
``kvmesh_router_pd_fallbacks_total{reason}``, ``kvmesh_router_pd_prefill_seconds``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from kvmesh.errors import UpstreamBrokenError, UpstreamError
from kvmesh.router.proxy import RETRYABLE, end_to_end
from kvmesh.routing.dispatcher import Ticket
from kvmesh.routing.scorers import ReplicaState, RoutingRequest

if TYPE_CHECKING:
    from kvmesh.router.app import RouterService

log = logging.getLogger(__name__)

PATHS = ("pd", "decode_only", "fallback")
# Why a prefill did not give transfer parameters (kvmesh_router_pd_fallbacks_total{reason}).
FALLBACK_REASONS = ("no_prefill_replica", "unreachable", "timeout", "error", "no_params")
PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True}


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill request's body: the client's, one token, no stream, producer parameters.

    Everything else (prompt or messages, sampling, cache_salt, chat template arguments) is
    kept: the producer must compute exactly the KV the consumer's prompt will ask for.
    """
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:  # chat's newer name wins over max_tokens in vLLM
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)  # vLLM refuses stream_options without stream
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return out


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The decode request's body: the client's, plus the prefill's transfer parameters as
    returned (None: the fallback, with any client-sent ``kv_transfer_params`` dropped, since
    the router owns that field in pd mode)."""
    out = dict(body)
    if params is None:
        out.pop("kv_transfer_params", None)
    else:
        out["kv_transfer_params"] = dict(params)
    return out


def matched_tokens(req: RoutingRequest, replica: str) -> int:
    """Prompt tokens the index believes ``replica`` holds (its ranges run from token 0)."""
    match = req.matches.get(replica) if req.matches else None
    if match is None or not match.ranges:
        return 0
    return int(match.ranges[-1][1])


@dataclass(frozen=True, slots=True)
class _Match:
    ranges: Sequence[tuple[int, int, Any]]


def transferred(req: RoutingRequest, replica: str) -> RoutingRequest:
    """``req`` as the decode replica sees it after a prefill: its whole prompt arrives as a
    load (medium ``PD``), so the prefill work counted there is a load's
    (``prefill_load_cost`` per token), not a recompute's, and the hit-token metric says
    how many tokens came by transfer."""
    n = len(req.tokens)
    matches = {**(req.matches or {}), replica: _Match(((0, n, "PD"),))}
    return replace(req, matches=matches)


class PDRouter:
    """The pd path of a :class:`~kvmesh.router.app.RouterService` (its pool, picker,
    upstream client and bookkeeping; nothing of its own but the counters' meaning)."""

    def __init__(self, service: RouterService) -> None:
        self.service = service
        self.config = service.config.pd
        self._roles = {r.key: r.role for r in service.config.replicas}
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder()

    def role(self, name: str) -> str:
        return self._roles.get(name, "both")

    def _candidates(self, exclude: str | None, *roles: str) -> list[ReplicaState]:
        return [c for c in self.service.pool.candidates() if c.name != exclude and self.role(c.name) in roles]

    async def route(
        self,
        request: web.Request,
        path: str,
        raw: bytes,
        body: dict[str, Any],
        req: RoutingRequest,
        t0: float,
    ) -> web.StreamResponse:
        s = self.service
        stream = bool(body.get("stream"))
        decode = self._candidates(None, "decode", "both")
        if not decode:
            return s._unavailable(path, "no healthy decode replica (role=decode or both); retry later")
        ticket = s.dispatcher.route(req, decode, stream=stream)
        ranked = ticket.ranked
        uncached = len(req.tokens) - matched_tokens(req, ranked[0])
        # The router owns kv_transfer_params in pd mode: a client's own would point the
        # consumer's pull at a host of the client's choosing.
        own = raw if "kv_transfer_params" not in body else self._encoder.encode(decode_body(body, None))
        if not len(req.tokens) or uncached <= self.config.pd_threshold_tokens:
            # Unknown length (no tokenizer) counts as short: never a second hop on a guess.
            s._labels.get(s.metrics.pd_requests, "decode_only").inc()
            return await s._forward(request, path, own, ticket, t0)
        prefill = self._candidates(ranked[0], "prefill", "both")
        params: dict[str, Any] | None = None
        if prefill:
            order = s.dispatcher.route(req, prefill)
            # The decode replica counts this request from now on: a burst of long prompts
            # must not all pick the same decode replica while their prefills run.
            s.pool.hold(ranked[0])
            try:
                params, outcome = await self._prefill(request, path, body, order)
            finally:
                s.pool.release(ranked[0])
        else:
            outcome = "no_prefill_replica"
        if params is None:
            s._labels.get(s.metrics.pd_requests, "fallback").inc()
            s._labels.get(s.metrics.pd_fallbacks, outcome).inc()
            log.info(
                "prefill of %d uncached tokens failed (%s): %s decodes alone", uncached, outcome, ranked[0]
            )
            return await s._forward(request, path, own, ticket, t0)
        s._labels.get(s.metrics.pd_requests, "pd").inc()
        log.debug("prefilled %d uncached tokens on %s; decode on %s", uncached, outcome, ranked[0])
        out = self._encoder.encode(decode_body(body, params))
        decode_ticket = s.dispatcher.ticket(transferred(req, ranked[0]), ranked, stream=stream)
        return await s._forward(request, path, out, decode_ticket, t0)

    async def _prefill(
        self, request: web.Request, path: str, body: Mapping[str, Any], ticket: Ticket
    ) -> tuple[dict[str, Any] | None, str]:
        """POST the prefill to the first reachable of the ticket's ranking; returns (the answer's
        ``kv_transfer_params``, the replica's name) or (None, a reason of FALLBACK_REASONS)."""
        try:
            return await self._prefill_on(request, path, body, ticket)
        finally:
            ticket.finished()

    async def _prefill_on(
        self, request: web.Request, path: str, body: Mapping[str, Any], ticket: Ticket
    ) -> tuple[dict[str, Any] | None, str]:
        s = self.service
        raw = self._encoder.encode(prefill_body(body))
        headers = end_to_end(request.headers).items()
        attempts = 0
        for name in ticket.ranked:
            replica = s.pool.replicas.get(name)
            if replica is None or not replica.healthy:
                continue
            if attempts == s.config.max_attempts:
                break
            attempts += 1
            # Counted on the prefill replica as queued prefill work until its answer is read,
            # so concurrent long prompts spread over the prefill replicas by the work they bring.
            ticket.sent(name)
            sent = time.perf_counter()
            try:
                async with asyncio.timeout(self.config.prefill_timeout_s):
                    resp = await s._upstream.post(replica.url, path, raw, headers)
                    try:
                        status, data = resp.status, await resp.read()
                    finally:
                        resp.release()  # an unread answer closes the connection: vLLM aborts it
            except RETRYABLE as exc:
                ticket.failed()
                s.pool.mark_failed(name, f"POST {path} (prefill) failed: {exc!r}")
                s.metrics.errors.labels("upstream_connect").inc()
                continue
            except TimeoutError:
                return None, "timeout"
            except UpstreamBrokenError as exc:  # it died mid-answer: the next prefill replica may take it
                ticket.failed()
                s.pool.mark_failed(name, f"POST {path} (prefill): the answer broke off: {exc}")
                s._broken()
                continue
            except UpstreamError as exc:  # malformed or too large
                log.warning("prefill on %s failed: %s", name, exc)
                return None, "error"
            if status >= 400:
                log.warning("prefill on %s answered %d: %s", name, status, data[:200])
                return None, "error"
            ticket.first_byte()  # one token, not streamed: the answer is the prefill's end
            try:
                answer = self._decoder.decode(data)
            except msgspec.DecodeError:
                return None, "error"
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if not isinstance(params, dict) or not params:
                return None, "no_params"
            s.metrics.pd_prefill_latency.observe(time.perf_counter() - sent)
            s._labels.get(s.metrics.decisions, f"{s.picker.policy}:prefill", name).inc()
            return params, name
        return None, "unreachable"
