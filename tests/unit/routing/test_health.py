"""Active health checks against real HTTP servers on 127.0.0.1: a late answer counts toward
``health_failure_threshold``; a refused connection or an error answer takes a replica out at once."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from aiohttp import web

from kvmesh.routing.config import ReplicaConfig
from kvmesh.routing.health import Monitor
from kvmesh.routing.pool import Pool


class Upstream:
    """A /health endpoint whose behaviour the test sets: "ok", "late" (answers after the
    checker's timeout) or a status code."""

    def __init__(self) -> None:
        self.mode: str | int = "ok"
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _health(self, _: web.Request) -> web.Response:
        if self.mode == "late":
            await asyncio.sleep(1.0)
        status = self.mode if isinstance(self.mode, int) else 200
        return web.Response(status=status, text="")

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny"}]})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_late_answers_count_to_the_threshold_errors_and_refusals_do_not_wait() -> None:
    async def run() -> None:
        up = Upstream()
        url = await up.start()
        dead = f"http://127.0.0.1:{_closed_port()}"
        pool = Pool([ReplicaConfig(url=url), ReplicaConfig(url=dead)])
        async with aiohttp.ClientSession() as session:
            monitor = Monitor(pool, health_timeout_s=0.2, health_failure_threshold=3)
            monitor._session = session  # checks driven one round at a time, no loops
            busy, gone = pool.replicas[ReplicaConfig(url=url).key], pool.replicas[ReplicaConfig(url=dead).key]
            await monitor.check_all()
            assert busy.healthy and busy.models == ("tiny",)
            assert not gone.healthy and "Connect" in str(gone.last_error)  # refused: never in

            up.mode = "late"
            for _ in range(2):  # late twice: still taking traffic, no error shown
                await monitor.check_all()
                assert busy.healthy and busy.last_error is None
            up.mode = "ok"  # an answer in time resets the count
            await monitor.check_all()
            up.mode = "late"
            for _ in range(2):
                await monitor.check_all()
                assert busy.healthy
            await monitor.check_all()  # the third late one in a row
            assert not busy.healthy and "TimeoutError" in str(busy.last_error)
            up.mode = "ok"
            await monitor.check_all()
            assert busy.healthy and busy.last_error is None

            up.mode = 503  # the replica says it is not well: out at the first answer
            await monitor.check_all()
            assert not busy.healthy and busy.last_error == "GET /health answered 503"
            up.mode = "ok"
            await monitor.check_all()
            assert busy.healthy

            await up.stop()  # the process is gone: connection refused, out at once
            await monitor.check_all()
            assert not busy.healthy

    asyncio.run(run())


def test_threshold_one_takes_a_replica_out_at_its_first_late_answer() -> None:
    async def run() -> None:
        up = Upstream()
        url = await up.start()
        pool = Pool([ReplicaConfig(url=url)])
        try:
            async with aiohttp.ClientSession() as session:
                monitor = Monitor(pool, health_timeout_s=0.2, health_failure_threshold=1)
                monitor._session = session
                replica = next(iter(pool.replicas.values()))
                await monitor.check_all()
                assert replica.healthy
                up.mode = "late"
                await monitor.check_all()
                assert not replica.healthy
        finally:
            await up.stop()

    asyncio.run(run())
