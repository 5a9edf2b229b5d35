"""The dispatcher: one request's routing lifecycle, written once for every front end.

``kvmesh router`` (a proxy), ``kvmesh epp`` (Envoy's ext_proc) and ``kvmesh sim`` drive the
same steps; only the transport around them differs::

    req = await dispatcher.prepare(body, raw, chat=..., session=...)   # or Refusal
    ticket = dispatcher.route(req, candidates)                         # match, pick
    ticket.sent(name)         # counted on name: in flight + its prefill work; speculative entry
    ticket.failed()           # (connect failure: uncounted; the front end may send it on)
    ticket.served(name, 200)  # the answer's headers: session, decision metrics
    ticket.first_byte()       # the prefill is done: work settled, TTFT observed
    ticket.finished()         # released (idempotent; also after failed/served without first byte)

What the three copies of this used to get wrong is right here by construction: a prompt's
``cache_salt`` goes into its block keys (a salted request matches only blocks of its salt),
a request for a LoRA adapter (``model`` names one: vLLM's ``/v1/models`` lists it with a
``parent``) matches only that adapter's blocks (vLLM's KV events name it in ``lora_name``),
and a base-model request never matches an adapter's,
and every speculative index entry has a timer that removes it when it expires (the next
match would, on its request's critical path: ~1 ms at 32k tokens).

A policy that keeps its own books per request (``policy: cost``: its ledger of predicted
prefill work, and the TTFT it learns from) rides on the same hooks through ``track``:
``track(decision, name)`` is called when a ticket is counted on ``name`` and may return a
:class:`Tracked`; that one is told the first byte of a streamed answer (a whole answer's
time is no time to first token) and the request's end.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from kvmesh.errors import BodyError
from kvmesh.index import BlockIndex, PromptKeys
from kvmesh.routing.config import RoutingConfig
from kvmesh.routing.labels import LabelCache
from kvmesh.routing.picker import Decision, Picker
from kvmesh.routing.prompts import NO_TOKENS, Prompts
from kvmesh.routing.scorers import ReplicaState, RoutingRequest, prefill_cost, prompt_key
from kvmesh.routing.sessions import SessionTable
from kvmesh.routing.table import ReplicaTable
from kvmesh.routing.tokenize import TokenArray

log = logging.getLogger(__name__)

NO_REPLICA = "no healthy replica is available; retry later"
# After a speculative entry's ttl: the loop's timers fire a little late, never early.
_EXPIRY_SLACK_S = 0.001
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """OpenAI's error shape with vLLM's type names (as the replicas answer)."""
    err = {"message": message, "type": ERROR_TYPES.get(status, "InternalServerError"), "param": param}
    return json.dumps({"error": {**err, "code": status}}).encode()


@dataclass(slots=True)
class Refusal:
    """An immediate answer instead of a route."""

    status: int
    message: str
    param: str | None = None

    @property
    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


class Tracked(Protocol):
    """What ``track`` returns: a policy's own ticket for one request on one replica."""

    def first_byte(self) -> object: ...
    def finished(self) -> None: ...


class DispatchMetrics(Protocol):
    """The four series the dispatcher keeps (``RouterMetrics`` and ``EppMetrics`` have them):
    ``decisions{policy, replica}``, ``prompt_tokens``, ``hit_tokens{medium}``, ``in_flight{replica}``."""

    decisions: Any
    prompt_tokens: Any
    hit_tokens: Any
    in_flight: Any


class Ledger(Protocol):
    """Where requests are counted: the pool (:class:`kvmesh.routing.pool.Pool`) or the
    simulator's table (:class:`kvmesh.routing.pool.TableLedger`)."""

    def acquire(self, name: str, prefill_tokens: float = 0.0) -> None: ...
    def settle_prefill(self, name: str, tokens: float) -> None: ...
    def release(self, name: str) -> None: ...
    def load_of(self, name: str) -> tuple[float, float, float, float] | None: ...


class Timers(Protocol):
    def soon(self, fn: Callable[..., None], *args: Any) -> None: ...
    def later(self, delay_s: float, fn: Callable[[], None]) -> None: ...


class LoopTimers:
    """On the running asyncio loop: ``soon`` runs once the caller awaits (off its critical path)."""

    def soon(self, fn: Callable[..., None], *args: Any) -> None:
        asyncio.get_running_loop().call_soon(fn, *args)

    def later(self, delay_s: float, fn: Callable[[], None]) -> None:
        asyncio.get_running_loop().call_later(delay_s, fn)


class InlineTimers:
    """At once, and no timers (the simulator: every match expires the index's entries first)."""

    def soon(self, fn: Callable[..., None], *args: Any) -> None:
        fn(*args)

    def later(self, delay_s: float, fn: Callable[[], None]) -> None:
        pass


class Ticket:
    """One routed request, from its decision to its end; see the module docstring."""

    __slots__ = (
        "_cost",
        "_d",
        "_done",
        "_tracked",
        "body",
        "decision",
        "endpoint",
        "ranked",
        "request",
        "stream",
    )

    def __init__(
        self,
        dispatcher: Dispatcher,
        ranked: list[str],
        request: RoutingRequest,
        stream: bool,
        decision: Decision | None,
    ) -> None:
        self._d = dispatcher
        self.ranked = ranked  # best first
        self.request = request
        self.stream = stream
        self.decision = decision
        self.endpoint: str | None = None  # where it is counted now
        self.body: bytes | None = None  # the body to send on, when it is not the client's
        self._cost = 0.0  # prefill tokens still counted on ``endpoint``
        self._tracked: Tracked | None = None  # the policy's own ticket (see ``track``)
        self._done = False

    @property
    def scores(self) -> dict[str, float]:
        return self.decision.scores if self.decision is not None else {}

    def sent(self, endpoint: str | None = None) -> None:
        """It went (or is about to go) to ``endpoint`` (default: the first of the ranking)."""
        self._d._count(self, endpoint or self.ranked[0])

    def failed(self) -> None:
        """The send failed before any answer: uncounted; it may be :meth:`sent` elsewhere."""
        self._d._uncount(self)

    def served(self, endpoint: str | None, status: int) -> None:
        """The answer's headers, from ``endpoint`` (None: where it was sent)."""
        self._d._served(self, endpoint, status)

    def first_byte(self) -> None:
        """The replica answered: its prefill is done (once; later calls do nothing)."""
        self._d._first_byte(self)

    def finished(self) -> None:
        """The request is over, whichever way (idempotent)."""
        if not self._done:
            self._d._uncount(self)
            self._done = True


class Dispatcher:
    """Decisions and their bookkeeping over one index, picker, session table and ledger."""

    def __init__(
        self,
        config: RoutingConfig,
        ledger: Ledger,
        picker: Picker,
        *,
        index: BlockIndex | None = None,
        sessions: SessionTable | None = None,
        prompts: Prompts | None = None,
        known_models: Callable[[], Collection[str]] = tuple,
        adapters: Callable[[], Collection[str]] = tuple,
        check_tokens: Callable[[int, bool], None] | None = None,
        metrics: DispatchMetrics | None = None,
        timers: Timers | None = None,
        speculative: bool = True,
        speculative_block_size: int | None = None,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.picker = picker
        self.index = index
        self.sessions = sessions if sessions is not None else SessionTable(config.session_capacity)
        self.prompts = prompts
        self.metrics = metrics
        self.timers: Timers = timers if timers is not None else LoopTimers()
        self._known = known_models
        self._adapters = adapters  # served names that are LoRA adapters
        self._check_tokens = check_tokens  # raises BodyError: a prompt too long for the model
        self._served_names = frozenset(config.served_model_names)
        self._ttl = config.speculative_ttl_s if speculative and index is not None else 0.0
        self._spec_bs = speculative_block_size
        self._load_cost = config.prefill_load_cost
        self._labels = LabelCache()
        # (decision, replica) -> a policy's own ticket, or None: the cost picker's by default;
        # a front end may wrap it (kvmesh.routing.costhooks records what it observes)
        self.track: Callable[[Decision | None, str], Tracked | None] | None = getattr(picker, "sent", None)

    @property
    def policy(self) -> str:
        return self.picker.policy

    # -- decisions ------------------------------------------------------------------------------------

    async def prepare(
        self, body: dict[str, Any] | None, raw: bytes, *, chat: bool, session: str | None = None
    ) -> RoutingRequest | Refusal:
        """A decoded request body (None: none) as a :class:`RoutingRequest`, or why not."""
        model = body.get("model") if body is not None else None
        if model is not None:
            if not isinstance(model, str):
                return Refusal(400, f"'model' must be a string, got {type(model).__name__}", "model")
            known = self._served_names or self._known()
            if known and model not in known:
                return Refusal(404, f"The model `{model}` does not exist.", "model")
        tokens: TokenArray = NO_TOKENS
        if body is not None and self.prompts is not None:
            tokens = await self.prompts.tokens(body, chat, len(raw))
        if self._check_tokens is not None:
            try:
                self._check_tokens(len(tokens), chat)
            except BodyError as exc:
                return Refusal(exc.status, exc.message, exc.field)
        salt = body.get("cache_salt") if body is not None else None
        lora = model if model is not None and model in self._adapters() else None
        return self.request(
            tokens, raw, salt=salt if isinstance(salt, str) else None, session=session, lora_name=lora
        )

    def request(
        self,
        tokens: TokenArray,
        raw: bytes = b"",
        *,
        salt: str | None = None,
        session: str | None = None,
        lora_name: str | None = None,
    ) -> RoutingRequest:
        """The routing request for a prompt's token ids (none: routed by load and session);
        ``lora_name``: the LoRA adapter it asks for (None: the base model)."""
        if len(tokens):
            # The block keys are hashed once, for the match and the speculative entry both. A
            # salted request matches only blocks of its salt (vLLM keys its first block by it);
            # an adapter's only its adapter's blocks (the index roots their chains apart).
            prompt = PromptKeys(tokens, lora_name=lora_name, cache_salt=salt or None)
            return RoutingRequest(
                tokens, session_id=session, key=prompt_key(tokens), lora_name=lora_name, prompt=prompt
            )
        return RoutingRequest(
            tokens, session_id=session, key=xxhash.xxh3_64_intdigest(raw), lora_name=lora_name
        )

    def match(self, req: RoutingRequest) -> None:
        """The index match, once per request (the scorers and the bookkeeping read it)."""
        if req.matches is None and self.index is not None and len(req.tokens):
            req.matches = self.index.match(req.prompt if req.prompt is not None else req.tokens)

    def route(
        self,
        req: RoutingRequest,
        candidates: Sequence[ReplicaState] | ReplicaTable,
        *,
        stream: bool = False,
        limit: int | None = None,
    ) -> Ticket:
        """Match and pick among ``candidates`` (not empty); the ranking keeps ``limit`` names."""
        self.match(req)
        decision = self.picker.pick(req, candidates)
        ranked = decision.ranked if limit != 1 else [decision.replica]
        return Ticket(self, ranked[:limit] if limit else ranked, req, stream, decision)

    async def decide(
        self,
        body: dict[str, Any] | None,
        raw: bytes,
        candidates: Sequence[ReplicaState],
        *,
        chat: bool,
        session: str | None = None,
        limit: int | None = None,
    ) -> Ticket | Refusal:
        """:meth:`prepare` then :meth:`route`, for a front end without a detour (the EPP)."""
        if not candidates:
            return Refusal(503, NO_REPLICA)
        req = await self.prepare(body, raw, chat=chat, session=session)
        if isinstance(req, Refusal):
            return req
        stream = bool(body.get("stream")) if body is not None else False
        return self.route(req, candidates, stream=stream, limit=limit)

    def ticket(self, req: RoutingRequest, ranked: list[str], *, stream: bool = False) -> Ticket:
        """A ticket over a ranking made elsewhere (pd: the decode request after its prefill)."""
        return Ticket(self, ranked, req, stream, None)

    # -- the ticket's hooks -----------------------------------------------------------------------------

    def _count(self, t: Ticket, name: str) -> None:
        if t.endpoint is not None:
            self._uncount(t)
        req = t.request
        t.endpoint = name
        t._cost = cost = prefill_cost(req, name, self._load_cost)
        self.ledger.acquire(name, cost)
        if self.track is not None:
            t._tracked = self.track(t.decision, name)
        if self.metrics is not None:
            self._labels.get(self.metrics.in_flight, name).inc()
        if self._ttl > 0 and len(req.tokens) and not self._on_gpu(req, name):
            prompt = req.prompt if req.prompt is not None else req.tokens
            self.timers.soon(self._speculate, name, prompt)

    def _uncount(self, t: Ticket) -> None:
        name = t.endpoint
        if name is None:
            return
        if t._cost >= 0:  # not settled yet (settled: -1)
            self.ledger.settle_prefill(name, t._cost)
        t._cost = -1.0
        self.ledger.release(name)
        if t._tracked is not None:
            t._tracked.finished()
            t._tracked = None
        if self.metrics is not None:
            self._labels.get(self.metrics.in_flight, name).dec()
        t.endpoint = None

    def _first_byte(self, t: Ticket) -> None:
        name = t.endpoint
        if name is None or t._cost < 0:
            return
        self.ledger.settle_prefill(name, t._cost)
        t._cost = -1.0
        if t._tracked is not None and t.stream:  # a whole answer's time is no TTFT
            t._tracked.first_byte()
        # The answer has begun: nothing goes elsewhere now. A decision's per-candidate arrays
        # (and the request's candidates-by-media table) are a few hundred KB at 1,000 replicas,
        # and a ticket lives as long as its answer streams: a decoding request keeps neither.
        t.decision = None
        t.request.aligned = None

    def _served(self, t: Ticket, endpoint: str | None, status: int) -> None:
        if t._done:
            return
        name = endpoint or t.endpoint
        if name is None:
            return
        if name != t.endpoint and self.ledger.load_of(name) is not None:
            # Served elsewhere (the gateway fell back): the work is counted where it is.
            self._count(t, name)
        if status >= 400:
            return
        req = t.request
        if req.session_id:
            self.sessions.record(req.session_id, name)
        m = self.metrics
        if m is not None:
            self._labels.get(m.decisions, self.picker.policy, name).inc()
            m.prompt_tokens.inc(len(req.tokens))
            match = req.matches.get(name) if req.matches else None
            for start, end, medium in match.ranges if match is not None else ():
                self._labels.get(m.hit_tokens, _medium_name(medium)).inc(end - start)

    # -- speculative index entries --------------------------------------------------------------------

    def _on_gpu(self, req: RoutingRequest, name: str) -> bool:
        """Whether the index already has every whole block of the prompt on ``name``'s GPU:
        then a speculative entry would add nothing, and skipping it saves hashing again."""
        match = req.matches.get(name) if req.matches else None
        if match is None or not match.ranges:
            return False
        bs = self._spec_bs or self.config.block_size
        whole = len(req.tokens) // bs * bs
        return match.ranges[-1][1] >= whole and all(_medium_name(m) == "GPU" for _, _, m in match.ranges)

    def _speculate(self, name: str, prompt: PromptKeys | TokenArray) -> None:
        index = self.index
        if index is None:
            return
        try:
            index.add_speculative(name, prompt, ttl_s=self._ttl, block_size=self._spec_bs)
        except Exception:  # an index bug must not fail requests; it is logged
            log.exception("speculative index entry for %s failed", name)
            return
        # Removing an expired entry costs about as much as adding it (~1 ms at 32k tokens).
        # The next match would do it, on its request's critical path: do it when it expires.
        # Matches still expire first, so what they see (and every decision) is unchanged.
        self.timers.later(self._ttl + _EXPIRY_SLACK_S, self._expire)

    def _expire(self) -> None:
        if self.index is None:
            return
        try:
            self.index.expire_speculative()
        except Exception:  # an index bug must not fail requests; it is logged
            log.exception("expiring speculative index entries failed")

    def describe(self) -> dict[str, Any]:
        return {"policy": self.picker.policy, "sessions": len(self.sessions)}


def _medium_name(medium: Any) -> str:
    return str(getattr(medium, "name", medium))
