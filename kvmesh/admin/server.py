"""The admin HTTP API of one :class:`~kvmesh.CacheEngine`, on a daemon thread.

Stdlib ``ThreadingHTTPServer`` only: it runs inside vLLM's worker process, where a second
event loop would be one thing too many. The engine is thread-safe, so each request runs on
its own thread. ``POST /kvmesh/admin/v1/<op>`` with a JSON body (``GET`` works for the
read-only operations); the schema is at ``/kvmesh/admin/v1/openapi.json``.

With ``controller_url`` set it registers with the controller and re-registers every
``heartbeat_s`` (the heartbeat); on :meth:`AdminServer.stop` it unregisters.

Off by default for a library ``CacheEngine``: start it with ``AdminServer(engine).start()``
(or :func:`start_admin`); the vLLM connector starts it unless ``admin_enabled`` is false.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np

from kvmesh.admin import ops
from kvmesh.admin.httpd import BoundedHandler, BoundedHTTPServer, Limits
from kvmesh.admin.schema import (
    CONTROLLER_PREFIX,
    ENGINE_PREFIX,
    OPS,
    TOKEN_ENV,
    allowed,
    error_body,
    is_loopback,
    openapi_document,
    parse_body,
)
from kvmesh.core.keys import KeyBuilder, as_token_array
from kvmesh.errors import BodyError, ClosedError, TierError

if TYPE_CHECKING:
    from kvmesh.core.engine import CacheEngine

log = logging.getLogger(__name__)
HeldSource = Callable[[int, int], dict[str, Any]]
"""``(cursor, limit)`` → ``{"events": [...], "next": cursor | None}``: what the engine holds."""


class AdminServer:
    """Serve ``engine``'s admin API; settings default to ``engine.config``'s ``admin_*`` keys.

    ``on_clear`` runs after every ``clear``/``move`` (the connector re-announces removed
    chunks to the router's index); ``extra_stats()`` is merged into ``stats``.
    """

    def __init__(
        self,
        engine: CacheEngine,
        *,
        host: str | None = None,
        port: int | None = None,
        token: str | None = None,
        controller_url: str | None = None,
        name: str | None = None,
        heartbeat_s: float = 2.0,
        on_clear: Callable[[], None] | None = None,
        extra_stats: Callable[[], dict[str, Any]] | None = None,
        held: HeldSource | None = None,
        limits: Limits | None = None,
    ) -> None:
        cfg = engine.config
        self.engine = engine
        self.host = host if host is not None else cfg.admin_host
        self.port = port if port is not None else cfg.admin_port
        self.token = token or cfg.admin_token or os.environ.get(TOKEN_ENV) or None
        self.controller_url = (controller_url or cfg.controller_url or "").rstrip("/") or None
        self._name = name or cfg.admin_name
        self.heartbeat_s = heartbeat_s
        self.on_clear = on_clear
        self.extra_stats = extra_stats
        self.held = held
        self.limits = limits if limits is not None else Limits()
        self.loopback = is_loopback(self.host)
        self._httpd: BoundedHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()
        self.registered = threading.Event()  # set after the first heartbeat the controller took

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> AdminServer:
        if self._httpd is not None:
            raise ClosedError("the admin server was already started")
        httpd = BoundedHTTPServer((self.host, self.port), _Handler, self.limits)
        httpd.admin = self  # type: ignore[attr-defined]
        self._httpd = httpd
        self.port = int(httpd.server_address[1])
        t = threading.Thread(target=httpd.serve_forever, name="kvmesh-admin", daemon=True)
        t.start()
        self._threads.append(t)
        if self.controller_url:
            hb = threading.Thread(target=self._heartbeat_loop, name="kvmesh-admin-heartbeat", daemon=True)
            hb.start()
            self._threads.append(hb)
            self._heartbeat = hb
        if not self.token:
            log.warning(
                "kvmesh admin API on %s: no admin_token (or %s) set; mutating calls are refused",
                self.url,
                TOKEN_ENV,
            )
        log.info("kvmesh admin API on %s (name %s)", self.url, self.name)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._httpd is None or self._stop.is_set():
            return
        self._stop.set()
        if self.controller_url:
            # A register already on its way must land before the unregister: after it, it
            # would show this stopped engine up again until its heartbeat ran out.
            if self._heartbeat is not None:
                self._heartbeat.join(timeout_s)
            self._post_controller("unregister", {"name": self.name}, timeout_s=1.0)
        self._httpd.shutdown()
        self._httpd.server_close()
        for t in self._threads:
            t.join(timeout_s)

    def __enter__(self) -> AdminServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The URL others reach this API at (a wildcard bind advertises the host's address)."""
        host = self.host
        if host in ("", "0.0.0.0", "::"):
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def name(self) -> str:
        if self._name:
            return self._name
        return urlsplit(self.url).netloc

    # -- heartbeat ---------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        warned = False
        while not self._stop.is_set():
            body = {
                "name": self.name,
                "url": self.url,
                "heartbeat_s": self.heartbeat_s,
                "model_id": self.engine.model_id,
                "shard": self.engine.keys.shard,
                "pid": os.getpid(),
            }
            err = self._post_controller("register", body, timeout_s=max(1.0, self.heartbeat_s))
            if err is None:
                self.registered.set()
                warned = False
            elif not warned:
                log.warning("kvmesh admin: cannot register with %s: %s", self.controller_url, err)
                warned = True
            self._stop.wait(self.heartbeat_s)

    def _post_controller(self, op: str, body: dict[str, Any], timeout_s: float) -> str | None:
        """POST to the controller; ``None`` on success, else why not."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        url = f"{self.controller_url}{CONTROLLER_PREFIX}{op}"
        req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                resp.read(1 << 16)  # the controller's short answer; never an endless one
            return None
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            return str(exc)

    # -- operations --------------------------------------------------------------------------
    def authorized(self, mutating: bool, header: str | None) -> bool:
        return allowed(mutating, header, self.token, self.loopback)

    def run(self, op: str, body: Any) -> dict[str, Any]:
        """Run operation ``op`` with a validated body (see :data:`~kvmesh.admin.schema.OPS`)."""
        e = self.engine
        result: dict[str, Any]
        if op == "lookup":
            result = _lookup(e, body.tokens, body.cache_salt)
        elif op == "clear":
            result = ops.clear(e, body.tier, body.tokens, body.force)
        elif op == "pin":
            result = ops.pin(e, body.tokens, body.tier)
        elif op == "unpin":
            result = ops.unpin(e, body.tokens, body.tier)
        elif op == "move":
            result = ops.move(e, body.tokens, body.tier)
        elif op == "compress":
            result = ops.compress(e, body.tokens, body.codec, body.tier)
        elif op == "decompress":
            result = ops.compress(e, body.tokens, "raw", body.tier)
        elif op == "health":
            result = ops.health(e)
        elif op == "check_finish":
            result = ops.check_finish(e, body.wait, body.timeout_s)
        elif op == "held":
            if self.held is None:
                result = {"events": [], "next": None, "note": "this engine does not track what it announced"}
            else:
                result = self.held(body.cursor, body.limit)
        elif op == "stats":
            result = ops.stats(e)
            if self.extra_stats is not None:
                result.update(self.extra_stats())
        else:  # pragma: no cover - the handler only passes names of OPS
            raise BodyError("op", f"unknown operation {op!r}", status=404)
        if op in ("clear", "move") and self.on_clear is not None:
            try:
                self.on_clear()
            except Exception:
                log.exception("kvmesh admin: on_clear hook failed")
        return result


class _Handler(BoundedHandler):
    server_version = "kvmesh-admin"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("admin %s - " + format, self.client_address[0], *args)

    def do_GET(self) -> None:
        self._handle(False)

    def do_POST(self) -> None:
        self._handle(True)

    def _send(self, status: int, data: Any) -> None:
        body = json.dumps(data).encode() if data is not None else b""
        self.send_response(status)
        if data is not None:
            self.send_header("Content-Type", "application/json")
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _refuse(self, status: int, data: Any) -> None:
        """Answer without reading the body: the connection cannot carry another request."""
        self.close_connection = True
        self._send(status, data)

    def _handle(self, post: bool) -> None:
        admin: AdminServer = self.server.admin  # type: ignore[attr-defined]
        auth = self.headers.get("Authorization")
        try:
            path = urlsplit(self.path).path
        except ValueError:  # e.g. "http://[x": no path this server serves (a 401 or a 404 below)
            path = ""
        op = path[len(ENGINE_PREFIX) :] if path.startswith(ENGINE_PREFIX) else None
        spec = OPS.get(op) if op else None
        # Who may ask comes first: nothing of an unauthorized request's body is read.
        if op == "openapi.json" or spec is None:
            if not admin.authorized(False, auth):
                self._refuse(401, None)  # an unauthenticated caller learns nothing of what exists
            elif op == "openapi.json":
                self._refuse(200, openapi_document(OPS, ENGINE_PREFIX, "kvmesh engine admin API"))
            else:
                self._refuse(404, error_body("not found"))
            return
        if not admin.authorized(spec.mutating, auth):
            self._refuse(401, None)
            return
        if spec.mutating and not post:
            self._refuse(405, error_body(f"{op} changes the cache: use POST"))
            return
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._refuse(411, error_body("send a Content-Length; chunked bodies are not accepted", "body"))
            return
        limit = admin.limits.max_body_bytes
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self._refuse(400, error_body("Content-Length must be a byte count", "body"))
            return
        if length > limit:
            self._refuse(413, error_body(f"body of {length} bytes is over the {limit}-byte limit", "body"))
            return
        raw = self.read_body(length) if length else b""
        if len(raw) < length:
            self.close_connection = True  # the client went away or stalled mid-body
            return
        try:
            body = parse_body(spec.body, raw)
            if spec.needs_tokens and getattr(body, "tokens", None) is None:
                raise BodyError("tokens", "required: the prompt's token ids")
            result = admin.run(op or "", body)
        except BodyError as exc:
            self._send(exc.status, error_body(exc.message, exc.field))
            return
        except Exception as exc:
            log.exception("kvmesh admin: %s failed", op)
            self._send(500, error_body(f"{op} failed: {type(exc).__name__}: {exc}"))
            return
        self._send(200, result)


def _lookup(engine: CacheEngine, tokens: list[int] | None, salt: str | None) -> dict[str, Any]:
    """``ops.lookup`` under the caller's salt. The engine's own salt is the common case; any
    other salt gets keys of its own namespace, so it sees only chunks stored under it (in a
    shared remote tier, by an engine of that salt), never this engine's."""
    if salt == engine.keys.salt:
        return ops.lookup(engine, tokens)
    if tokens is None:
        raise BodyError("tokens", "required: the prompt's token ids")
    k = engine.keys
    keys = KeyBuilder(k.model_id, k.layout, k.chunk_size, k.shard, salt, k.save_unfull_chunk)
    arr = as_token_array(np.asarray(tokens, dtype=np.int64))
    chunks, bounds = keys.keys_for_array(arr), keys.chunk_bounds(len(arr))
    held = {"cpu": engine.cpu.contains(chunks)}
    tiers: dict[str, Any] = {}
    for name, tier in engine.lower.items():
        try:
            held[name] = tier.contains(chunks)
        except TierError as exc:
            tiers[name] = {"error": str(exc)}
    for name, flags in held.items():
        tiers[name] = {"tokens": _leading(flags, bounds)}
    anywhere = [any(f[i] for f in held.values()) for i in range(len(chunks))]
    order = ["cpu", *engine.lower]
    return {
        "tokens": len(arr),
        "hit_tokens": _leading(anywhere, bounds),
        "tiers": {n: tiers[n] for n in order},
    }


def _leading(flags: list[bool], bounds: list[tuple[int, int]]) -> int:
    n = next((i for i, f in enumerate(flags) if not f), len(flags))
    return bounds[n - 1][1] if n else 0


def start_admin(
    engine: CacheEngine,
    *,
    default_on: bool,
    port_offset: int = 0,
    on_clear: Callable[[], None] | None = None,
    extra_stats: Callable[[], dict[str, Any]] | None = None,
    held: HeldSource | None = None,
) -> AdminServer | None:
    """Start the admin API if ``engine.config.admin_enabled`` (``None``: ``default_on``) says
    so. Never raises: a port in use is logged and the engine serves on without it."""
    cfg = engine.config
    enabled = default_on if cfg.admin_enabled is None else cfg.admin_enabled
    if not enabled:
        return None
    port = cfg.admin_port + port_offset if cfg.admin_port else 0
    name = f"{cfg.admin_name}/tp{port_offset}" if cfg.admin_name and port_offset else None
    try:
        return AdminServer(
            engine, port=port, name=name, on_clear=on_clear, extra_stats=extra_stats, held=held
        ).start()
    except OSError as exc:
        log.error("kvmesh: admin API not started on %s:%d: %s", cfg.admin_host, port, exc)
        return None
