"""The cluster-wide cache controller, served by the router under ``/kvmesh/v1/``.

Each operation (``lookup``, ``clear``, ``pin``, ``unpin``, ``move``, ``compress``,
``decompress``, ``health``, ``check_finish``, ``stats``) is ``POST /kvmesh/v1/<op>`` with a
JSON body (see :mod:`kvmesh.admin.schema`; the OpenAPI document is at
``/kvmesh/v1/openapi.json``). The controller fans the call out to the admin API of every
engine it knows (or those named in ``replicas``) and answers per replica::

    {"op": "lookup", "replicas": {"a": {"ok": true, "url": ..., "result": {...}},
                                  "b": {"ok": false, "url": ..., "error": "..."}}}

so one dead or slow engine is an error entry, never a failed call.

Engines are known two ways: given up front (``ControllerConfig.admins``: the router's
``--admin URL[,name=NAME]`` flags or ``KVMESH_ADMIN_URLS``), or registered at run time:
an engine with ``controller_url`` POSTs ``/kvmesh/v1/register`` every ``heartbeat_s``.
A registered engine whose heartbeats stop for ``heartbeat_misses`` periods, or that
unregistered on shutdown, is *down*: it gets an error entry without being called.

Auth: once a token is configured (``ControllerConfig.token`` or ``KVMESH_ADMIN_TOKEN``),
every call needs ``Authorization: Bearer <token>``, whatever the bind address: a sidecar
proxy makes loopback reachable from the network, and a lookup tells whether another
tenant's prompt is cached. With no token, mutating calls are refused and read-only ones are
answered on a loopback bind only. Bodies must arrive within ``body_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np
from aiohttp import web

from kvmesh.admin.schema import (
    CONTROLLER_OPS,
    CONTROLLER_PREFIX,
    ENGINE_PREFIX,
    TOKEN_ENV,
    allowed,
    error_body,
    is_loopback,
    openapi_document,
    parse_body,
)
from kvmesh.errors import BodyError, TokenizeError
from kvmesh.router.config import URLS_ENV, ControllerConfig, parse_admin
from kvmesh.routing.replies import json_capped
from kvmesh.routing.tokenize import PromptTokenizer, TokenArray

__all__ = ["URLS_ENV", "Controller", "ControllerConfig", "Endpoint", "parse_admin"]
log = logging.getLogger(__name__)
_TARGET_FIELDS = {"replicas", "prompt", "messages"}
RemoteTokens = Callable[[dict[str, Any], bool], Awaitable[TokenArray]]


@dataclass
class Endpoint:
    name: str
    url: str
    static: bool
    heartbeat_s: float | None = None
    last_seen: float | None = None  # monotonic
    last_seen_wall: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    stopped: bool = False  # unregistered: the engine shut down

    def down_reason(self, misses: float) -> str | None:
        """Why a registered engine counts as down (stopped, heartbeats missed), else ``None``."""
        if self.stopped:
            return "the engine stopped (it unregistered)"
        if self.static or self.last_seen is None or self.heartbeat_s is None:
            return None
        age = time.monotonic() - self.last_seen
        return f"no heartbeat for {age:.1f}s" if age > misses * self.heartbeat_s else None

    def describe(self) -> dict[str, Any]:
        age = None if self.last_seen is None else round(time.monotonic() - self.last_seen, 3)
        return {
            "url": self.url,
            "source": "static" if self.static else "registered",
            "last_heartbeat_s_ago": age,
            **self.info,
        }


class Controller:
    """Fan-out of admin operations to the engines' admin APIs (see the module docstring)."""

    def __init__(
        self,
        config: ControllerConfig | None = None,
        *,
        host: str = "127.0.0.1",
        tokenizer: PromptTokenizer | None = None,
        remote_tokens: RemoteTokens | None = None,
        on_register: Callable[[str, str], None] | None = None,
    ) -> None:
        self.config = config if config is not None else ControllerConfig().with_env()
        self.loopback = is_loopback(host)
        self.tokenizer = tokenizer
        self.remote_tokens = remote_tokens
        self.on_register = on_register  # (name, url) of an engine registering anew
        self.endpoints: dict[str, Endpoint] = {}
        for spec in self.config.admins:
            name, url = parse_admin(spec)
            self.endpoints[name] = Endpoint(name, url, static=True)
        self._client: aiohttp.ClientSession | None = None

    def add_admin(self, spec: str) -> str:
        """Add an admin endpoint ``URL[,name=NAME]`` (before or while running); its name."""
        name, url = parse_admin(spec)
        self.endpoints[name] = Endpoint(name, url, static=True)
        return name

    # -- aiohttp wiring ----------------------------------------------------------------------
    def mount(self, app: web.Application) -> None:
        app.router.add_route("*", CONTROLLER_PREFIX + "{op}", self._handle)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)

    async def _startup(self, app: web.Application) -> None:
        self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.call_timeout_s))
        if not self.config.token:
            log.warning("kvmesh controller: no admin token (%s) set; mutating calls are refused", TOKEN_ENV)

    async def _cleanup(self, app: web.Application) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        op = request.match_info["op"]
        auth = request.headers.get("Authorization")
        token = self.config.token
        if op == "openapi.json" and request.method == "GET":
            if not allowed(False, auth, token, self.loopback):
                return _unauthorized()
            return web.json_response(openapi_document(CONTROLLER_OPS, CONTROLLER_PREFIX, "kvmesh controller"))
        if op == "replicas" and request.method == "GET":
            if not allowed(False, auth, token, self.loopback):
                return _unauthorized()
            return web.json_response({"replicas": self._describe()})
        spec = CONTROLLER_OPS.get(op)
        if spec is None:
            if allowed(False, auth, token, self.loopback):
                return web.json_response(error_body(f"no operation {op!r}"), status=404)
            return _unauthorized()
        if not allowed(spec.mutating, auth, token, self.loopback):
            return _unauthorized()
        if request.method not in ("POST", "GET") or (spec.mutating and request.method != "POST"):
            return web.json_response(error_body(f"use POST {CONTROLLER_PREFIX}{op}"), status=405)
        try:
            # A deadline for the whole body: a client dripping bytes must not hold the handler.
            raw = await asyncio.wait_for(request.read(), self.config.body_timeout_s)
        except TimeoutError:
            msg = f"request body not received within {self.config.body_timeout_s} s"
            timed_out = web.json_response(error_body(msg, "body"), status=408)
            timed_out.force_close()  # the rest of the body is not waited for
            return timed_out
        except web.HTTPRequestEntityTooLarge:
            return web.json_response(error_body("request body is too large", "body"), status=413)
        try:
            body = parse_body(spec.body, raw)
            if op == "register":
                return web.json_response(self._register(body))
            if op == "unregister":
                ep = self.endpoints.get(body.name)
                if ep is not None and not ep.static:
                    ep.stopped = True  # shown as down until it registers again
                return web.json_response({"ok": True})
            payload = await self._payload(body, spec.needs_tokens)
        except BodyError as exc:
            return web.json_response(error_body(exc.message, exc.field), status=exc.status)
        answers = await self.fan_out(op, payload, body.replicas, _timeout(op, payload, self.config))
        out: dict[str, Any] = {"op": op, "replicas": answers}
        if op == "lookup":
            out["tokens"] = len(payload["tokens"])
            out["remote"] = _shared_remote(answers)
        return web.json_response(out)

    # -- registry ----------------------------------------------------------------------------
    def _register(self, body: Any) -> dict[str, Any]:
        try:
            parts = urlsplit(body.url)
        except ValueError as exc:  # e.g. an unclosed "[" of an IPv6 host
            raise BodyError("url", f"must look like http://host:port, got {body.url!r} ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise BodyError("url", f"must look like http://host:port, got {body.url!r}")
        ep = self.endpoints.get(body.name)
        if ep is None or ep.url != body.url.rstrip("/"):
            if ep is None or not ep.static:
                log.info("kvmesh controller: engine %s registered at %s", body.name, body.url)
            ep = Endpoint(body.name, body.url.rstrip("/"), static=False)
            self.endpoints[body.name] = ep
            if self.on_register is not None:
                try:
                    self.on_register(ep.name, ep.url)
                except Exception:  # a hook's bug must not refuse the engine
                    log.exception("kvmesh controller: on_register hook failed for %s", ep.name)
        ep.heartbeat_s = body.heartbeat_s
        ep.stopped = False
        ep.last_seen = time.monotonic()
        ep.last_seen_wall = time.time()
        ep.info = {"model_id": body.model_id, "shard": body.shard, "pid": body.pid}
        return {"ok": True, "name": body.name}

    def _describe(self) -> dict[str, Any]:
        out = {}
        for name, ep in self.endpoints.items():
            d = ep.describe()
            d["status"] = "down" if ep.down_reason(self.config.heartbeat_misses) is not None else "up"
            out[name] = d
        return out

    # -- requests ----------------------------------------------------------------------------
    async def _payload(self, body: Any, needs_tokens: bool) -> dict[str, Any]:
        """The engine body: the request's own fields, with prompt / messages tokenized."""
        payload: dict[str, Any] = body.model_dump(exclude=_TARGET_FIELDS)
        given = [f for f in ("tokens", "prompt", "messages") if getattr(body, f, None) is not None]
        if len(given) > 1:
            raise BodyError(given[1], f"give only one of tokens, prompt, messages (got {', '.join(given)})")
        if needs_tokens and not given:
            raise BodyError("tokens", "required: give tokens, prompt or messages")
        if given and given[0] != "tokens":
            payload["tokens"] = [int(t) for t in await self._tokenize(body)]
        return payload

    async def _tokenize(self, body: Any) -> np.ndarray:
        chat = body.messages is not None
        what = "messages" if chat else "prompt"
        req: dict[str, Any] = {"messages": body.messages} if chat else {"prompt": body.prompt}
        try:
            if self.tokenizer is not None:
                tok = self.tokenizer
                fn = tok.chat if chat else tok.completion
                return await asyncio.get_running_loop().run_in_executor(None, fn, req)
            if self.remote_tokens is not None:
                return await self.remote_tokens(req, chat)
        except TokenizeError as exc:
            raise BodyError(what, str(exc)) from None
        raise BodyError(what, "the router has no tokenizer (start it with --model); give tokens instead")

    async def fan_out(
        self, op: str, payload: dict[str, Any], replicas: list[str] | None, timeout_s: float
    ) -> dict[str, Any]:
        names = list(dict.fromkeys(replicas)) if replicas is not None else sorted(self.endpoints)
        results = await asyncio.gather(*(self._call(n, op, payload, timeout_s) for n in names))
        return dict(zip(names, results, strict=True))

    async def _call(self, name: str, op: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        ep = self.endpoints.get(name)
        if ep is None:
            return {"ok": False, "status": "unknown", "error": f"no replica named {name!r}"}
        base: dict[str, Any] = {"url": ep.url}
        if op == "health":
            base.update(ep.describe())
        down = ep.down_reason(self.config.heartbeat_misses)
        if down is not None:
            return {**base, "ok": False, "status": "down", "error": down}
        client = self._client
        if client is None:
            return {**base, "ok": False, "status": "down", "error": "the controller is not running"}
        headers = {"Authorization": f"Bearer {self.config.token}"} if self.config.token else {}
        try:
            async with client.post(
                ep.url + ENGINE_PREFIX + op,
                json=payload,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                data = await json_capped(resp)
                status = resp.status
        except TimeoutError:
            return {**base, "ok": False, "status": "down", "error": f"no answer within {timeout_s:.1f}s"}
        except ValueError:
            return {**base, "ok": False, "status": "down", "error": "the answer is not kvmesh admin JSON"}
        except (aiohttp.ClientError, OSError) as exc:
            return {
                **base,
                "ok": False,
                "status": "down",
                "error": f"unreachable: {exc or type(exc).__name__}",
            }
        if status != 200:
            msg = data.get("error", {}).get("message") if isinstance(data, dict) else None
            if status == 401:
                msg = "the engine refused the controller's token"
            field_name = data.get("error", {}).get("field") if isinstance(data, dict) else None
            err: dict[str, Any] = {**base, "ok": False, "status": "up", "code": status}
            err["error"] = msg or f"HTTP {status}"
            if field_name:
                err["field"] = field_name
            return err
        return {**base, "ok": True, "status": "up", "result": data}


def _timeout(op: str, payload: dict[str, Any], cfg: ControllerConfig) -> float:
    if op == "check_finish" and payload.get("wait"):
        return float(payload.get("timeout_s", 60.0)) + cfg.call_timeout_s
    return cfg.call_timeout_s


def _shared_remote(answers: Mapping[str, Any]) -> dict[str, Any] | None:
    """The shared remote tier's answer, from the first replica that has one."""
    for ans in answers.values():
        if ans.get("ok"):
            remote = ans["result"].get("tiers", {}).get("remote")
            if remote is not None and "tokens" in remote:
                return dict(remote)
    return None


def _unauthorized() -> web.Response:
    return web.Response(status=401, headers={"WWW-Authenticate": "Bearer"})
