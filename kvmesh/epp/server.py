"""``kvmesh epp``'s servers: ext_proc gRPC, gRPC health and Prometheus, on one event loop.

Three ports, as the protocol's reference EPP: 9002 the ``ExternalProcessor`` service (over
TLS unless ``secure_serving`` is off; it answers gRPC health too, for the gateway), 9003
the standard ``grpc.health.v1.Health`` service (``liveness``, ``readiness``, and
``envoy.service.ext_proc.v3.ExternalProcessor``), 9090 ``/metrics`` (plus ``/kvmesh/state``).
Liveness is SERVING while the process answers; readiness and the ext_proc service are
SERVING once discovery has listed the endpoints and at least one is healthy.

:class:`EppServer` runs in the caller's loop (the CLI); :class:`EppThread` runs one on a
daemon thread with its own loop (tests, the benchmark).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvmesh.errors import ClosedError, ProcessError
from kvmesh.routing.loop import freeze_heap, loop_factory

from .config import EppConfig
from .protocol import StreamHandler, StreamTimeout
from .scoring import EndpointPicker
from .tls import server_pair

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_HEALTH_EVERY_S = 0.5


class _Processor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            async for response in StreamHandler(self.picker).run(request_iterator):
                yield response
        except asyncio.CancelledError:
            raise  # the gateway closed the stream (the HTTP request ended): normal
        except StreamTimeout as exc:
            self.picker.metrics.stream_errors.inc()
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except Exception:
            self.picker.metrics.stream_errors.inc()
            log.exception("ext_proc stream failed")
            await context.abort(grpc.StatusCode.INTERNAL, "kvmesh epp failed on this request; see its log")


class EppServer:
    """The three servers around one :class:`EndpointPicker` (and its discovery, if any)."""

    def __init__(
        self, config: EppConfig, picker: EndpointPicker | None = None, discovery: Any = None
    ) -> None:
        self.config = config
        self.picker = picker if picker is not None else EndpointPicker(config)
        self.discovery = discovery
        if discovery is None:
            self.picker.synced = True  # static endpoints: listed from the start
        self.grpc_port = config.grpc_port
        self.health_port = config.health_port
        self.metrics_port = config.metrics_port
        # Read now: a missing or empty certificate stops the start with a ConfigError naming it.
        self._tls = server_pair(config.cert_path) if config.secure_serving else None
        self._grpc: grpc.aio.Server | None = None
        self._health: grpc.aio.Server | None = None
        self._health_servicer = health.aio.HealthServicer()
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.picker.start()
        if self.discovery is not None:
            await self.discovery.start(self.picker)
        cfg = self.config
        host = cfg.host
        # One message carries a body chunk at most; past max_streams a new stream is refused
        # (RESOURCE_EXHAUSTED) instead of queueing work and memory without end.
        limit = cfg.max_body_bytes + (1 << 20)
        self._grpc = grpc.aio.server(
            options=[("grpc.max_receive_message_length", limit)], maximum_concurrent_rpcs=cfg.max_streams
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(_Processor(self.picker), self._grpc)
        # Health on the ext_proc port too, so that a gateway health-checks it over its TLS.
        health_pb2_grpc.add_HealthServicer_to_server(self._health_servicer, self._grpc)
        host = host.strip("[]")  # --host=[fd00::7] or fd00::7
        bind = f"[{host}]" if ":" in host else host  # an IPv6 pod IP, as gRPC spells it
        address = f"{bind}:{cfg.grpc_port}"
        if self._tls is not None:
            cert, key = self._tls
            creds = grpc.ssl_server_credentials([(key, cert)])
            self.grpc_port = self._grpc.add_secure_port(address, creds)
        else:
            log.warning("kvmesh epp: secure_serving is off: ext_proc on %s is plaintext", address)
            self.grpc_port = self._grpc.add_insecure_port(address)
        self._health = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._health_servicer, self._health)
        self.health_port = self._health.add_insecure_port(f"{bind}:{self.config.health_port}")
        if not self.grpc_port or not self.health_port:
            raise ProcessError(f"kvmesh epp cannot bind its gRPC ports on {host} (in use?)")
        await self._grpc.start()
        await self._health.start()
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/kvmesh/state", self._state)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        # A wildcard (in a pod with no POD_IP) is every address of both families, as gRPC's is.
        site = web.TCPSite(
            self._runner, None if host in ("0.0.0.0", "::") else host, self.config.metrics_port
        )
        await site.start()
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            self.metrics_port = server.sockets[0].getsockname()[1]
        await self._set_health()
        self._tasks.append(asyncio.create_task(self._health_loop(), name="kvmesh-epp-health"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self.discovery is not None:
            await self.discovery.stop()
        for server in (self._grpc, self._health):
            if server is not None:
                await server.stop(grace=0.5)
        if self._runner is not None:
            await self._runner.cleanup()
        await self.picker.stop()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(_HEALTH_EVERY_S)
            await self._set_health()

    async def _set_health(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        ready = serving if self.picker.ready() else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health_servicer.set("liveness", serving)
        await self._health_servicer.set("", serving)
        await self._health_servicer.set("readiness", ready)
        await self._health_servicer.set(EXT_PROC_SERVICE, ready)
        await self._health_servicer.set("inference-extension", ready)  # the name llm-d's probes ask

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        body = generate_latest(self.picker.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _state(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.picker.describe())


async def serve_forever(server: EppServer) -> None:
    """Serve until cancelled (the ``kvmesh epp`` command); its process's start-up heap frozen
    (:func:`kvmesh.routing.loop.freeze_heap`)."""
    await server.start()
    freeze_heap()
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


class EppThread:
    """An :class:`EppServer` on a daemon thread; ``call(fn)`` runs ``fn()`` on its loop."""

    def __init__(
        self, config: EppConfig, picker: EndpointPicker | None = None, discovery: Any = None
    ) -> None:
        self._args = (config, picker, discovery)
        self.server: EppServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def picker(self) -> EndpointPicker:
        if self.server is None:
            raise ClosedError("the EPP is not running; call start() first")
        return self.server.picker

    def start(self, timeout: float = 30.0) -> EppThread:
        self._thread = threading.Thread(target=self._run, name="kvmesh-epp", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise ProcessError(f"kvmesh epp did not start: {self._error!r}")
        return self

    def _run(self) -> None:
        loop = self._loop = loop_factory()()
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self.server = EppServer(*self._args)
        await self.server.start()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await self.server.stop()

    def call(self, fn: Any) -> Any:
        if self._loop is None:
            raise ClosedError("the EPP is not running; call start() first")

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)
        self._loop = None

    def __enter__(self) -> EppThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["EXT_PROC_SERVICE", "EppServer", "EppThread", "pb", "serve_forever"]
