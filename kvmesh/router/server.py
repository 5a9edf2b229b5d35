"""Run the router: in the foreground (the CLI) or on a background thread (tests, the demo).

uvloop is used when it is installed (:func:`kvmesh.routing.loop.loop_factory`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kvmesh.errors import ClosedError, ProcessError
from kvmesh.index import BlockIndex
from kvmesh.router.app import RouterService
from kvmesh.router.config import RouterConfig
from kvmesh.router.metrics import RouterMetrics
from kvmesh.routing.loop import freeze_heap, loop_factory
from kvmesh.routing.tokenize import PromptTokenizer


def run_forever(service: RouterService) -> None:
    """Serve on ``config.host:config.port`` until SIGINT/SIGTERM (the ``kvmesh router`` command)."""
    cfg = service.config
    loop = loop_factory()()
    asyncio.set_event_loop(loop)
    app = service.make_app()
    app.on_startup.append(_freeze)  # the last hook: after the service's own start-up
    web.run_app(
        app,
        host=cfg.host,
        port=cfg.port,
        access_log=None,
        loop=loop,
        print=None,
        shutdown_timeout=cfg.shutdown_timeout_s,
    )


async def _freeze(app: web.Application) -> None:
    freeze_heap()


class Router:
    """The router on a daemon thread with its own event loop.

    ::

        with Router(RouterConfig(model=DIR, replicas=[ReplicaConfig(url=...)], port=0)) as r:
            httpx.post(r.url + "/v1/completions", json={...})

    ``index`` (a :class:`BlockIndex`) may be passed in to feed it directly; ``service`` gives
    access to the pool, picker, sessions and metrics. Only ``start``/``stop``/``call`` are
    safe to use from other threads; ``call(fn)`` runs ``fn()`` on the router's loop.
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        index: BlockIndex | None = None,
        tokenizer: PromptTokenizer | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.config = config
        self.service = RouterService(config, index=index, tokenizer=tokenizer, metrics=metrics)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.port: int | None = None

    @property
    def index(self) -> BlockIndex:
        return self.service.index

    @property
    def url(self) -> str:
        if self.port is None:
            raise ClosedError("the router is not running; call start() first")
        host = self.config.host if self.config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> Router:
        if self._thread is not None:
            raise ClosedError("the router was already started")
        self._thread = threading.Thread(target=self._run, name="kvmesh-router", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the router did not start within {timeout_s}s")
        if self._error is not None:
            self._thread.join(timeout_s)
            raise ProcessError(f"the router failed to start: {self._error!r}") from self._error
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is None or stop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop may have closed already
            loop.call_soon_threadsafe(stop.set)
        thread.join(timeout_s)
        self._loop = self._stop = None
        self.port = None

    def call(self, fn: Callable[[], Any], timeout_s: float = 10.0) -> Any:
        """Run ``fn()`` on the router's loop and return its result (for tests poking at state)."""
        if self._loop is None:
            raise ClosedError("the router is not running")

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout_s)

    def __enter__(self) -> Router:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        loop = self._loop = loop_factory()()
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(self.service.make_app(), access_log=None, handle_signals=False)
        try:
            self._stop = asyncio.Event()
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.config.host, self.config.port, reuse_address=True)
            loop.run_until_complete(site.start())
            self.port = int(runner.addresses[0][1])
        except BaseException as exc:  # reported to start()'s caller, who re-raises it
            self._error = exc
            self._ready.set()
            loop.run_until_complete(runner.cleanup())
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_until_complete(self._stop.wait())
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()
