"""A replica that answers without end costs the router a bounded amount, then a 502.

The router holds a whole answer in memory before relaying it (so that an answer broken off
before its end can go to another replica), and a stream chunk by chunk. A replica pod that is
compromised or broken can answer forever: a Content-Length of 100 GB and bytes without end,
a chunked answer whose chunks never stop, a chunk that declares 2^48 bytes, 100 Continue
without end. Each is a 502 naming the bound, soon, with the router process's memory
within the bound (``max_answer_bytes``, 8 MiB here) plus slack, and the router keeps
serving.

The hostile replica is :class:`FakeVLLM` (its health, models and metrics answers are
real HTTP) writing raw bytes for its completions; no real server answers like this.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import psutil
import pytest
from aiohttp import web

from kvmesh.router.testing import FakeVLLM
from tests.security.conftest import StartRouter

LIMIT = 8 << 20  # the router's max_answer_bytes in these tests
MIB = 1 << 20
# What each answer starts with, and what it repeats until the router hangs up.
ANSWERS: dict[str, tuple[bytes, bytes]] = {
    "declared": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000000000\r\n\r\n",
        b"x" * MIB,
    ),
    "chunks": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"100000\r\n" + b"y" * MIB + b"\r\n",
    ),
    "huge_chunk": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffff\r\n", b"z" * MIB),
    "interim": (b"", b"HTTP/1.1 100 Continue\r\n\r\n" * 64),
}
SAYS = {"declared": "max_answer_bytes", "chunks": "max_answer_bytes", "huge_chunk": "max_answer_bytes",
        "interim": "interim"}  # fmt: skip


class EndlessReplica(FakeVLLM):
    """Answers every completion with ``ANSWERS[mode]``: its start, then its unit until the
    connection closes (written as fast as the router reads)."""

    mode = "declared"

    async def _answer(self, request: web.Request, body: dict[str, Any], chat: bool) -> web.StreamResponse:
        transport = request.transport
        start, unit = ANSWERS[self.mode]
        if transport is not None:
            transport.write(start)
            while not transport.is_closing():
                if transport.get_write_buffer_size() > 4 * MIB:
                    await asyncio.sleep(0.001)
                    continue
                transport.write(unit)
                await asyncio.sleep(0)
        return web.Response()  # never sent: the router hung up


@pytest.mark.parametrize("mode", list(ANSWERS))
def test_an_endless_answer_is_a_502_within_the_bound(mode: str, start_router: StartRouter) -> None:
    hostile = EndlessReplica("hostile").start()
    hostile.mode = mode
    try:
        router = start_router(replicas=[{"url": hostile.url, "name": "hostile"}], max_answer_bytes=LIMIT)
        proc = psutil.Process(router.proc.pid)
        before = proc.memory_info().rss
        t0 = time.monotonic()
        resp = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=30)
        took = time.monotonic() - t0
        assert resp.status_code == 502, resp.text
        assert SAYS[mode] in resp.json()["error"]["message"]
        assert took < 10, took
        grew = proc.memory_info().rss - before
        assert grew < 4 * LIMIT + 64 * MIB, f"the router grew {grew / MIB:.0f} MiB"
        if mode == "declared":
            # Refused on its Content-Length, not read up to the bound. (What the replica wrote
            # is no measure: kernel socket buffers take megabytes the router never reads.)
            assert "answer's 100000000000 bytes are more than" in resp.json()["error"]["message"]
        # Not a failure of the replica (every one would answer the same), and the router serves on.
        assert httpx.get(router.url + "/health", timeout=5).status_code == 200
    finally:
        hostile.stop()


class EndlessSide(FakeVLLM):
    """Answers ``/metrics`` or ``/v1/models`` (``side``) without end, as fast as the router
    reads; its completions are FakeVLLM's. ``most``: the largest answer it got out."""

    side = "/metrics"
    most = 0

    async def _endless(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        sent, unit = 0, b"# " + b"x" * (MIB - 3) + b"\n"
        try:
            while True:
                await resp.write(unit)
                sent += len(unit)
                self.most = max(self.most, sent)
        except (ConnectionError, RuntimeError):  # the router hung up
            return resp

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return await (self._endless(request) if self.side == "/metrics" else super()._metrics(request))

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return await (self._endless(request) if self.side == "/v1/models" else super()._models(request))


@pytest.mark.parametrize("side", ["/metrics", "/v1/models"])
def test_an_endless_metrics_or_models_answer_is_cut_at_its_bound(
    side: str, start_router: StartRouter
) -> None:
    """The router scrapes ``/metrics`` and reads ``/v1/models`` of every replica by itself, and
    read each whole within the health timeout: one replica answering without end grew the
    router by 500-600 MB per scrape (7 December 2026). Each is read up to its bound
    (:mod:`kvmesh.routing.replies`), and the router serves on."""
    from kvmesh.routing.replies import METRICS_BYTES, MODELS_BYTES

    hostile = EndlessSide("hostile")
    hostile.side = side
    hostile.start()
    bound = METRICS_BYTES if side == "/metrics" else MODELS_BYTES
    try:
        router = start_router(replicas=[{"url": hostile.url, "name": "hostile"}], health_timeout_s=3.0)
        proc = psutil.Process(router.proc.pid)
        before, peak = proc.memory_info().rss, 0
        end = time.monotonic() + 3
        while time.monotonic() < end:  # several scrapes (and a models read, at the first check)
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.02)
        if side == "/v1/models":  # the router's own /v1/models asks the replica too
            assert httpx.get(router.url + "/v1/models", timeout=10).status_code == 503
        assert 0 < hostile.most < bound + 32 * MIB, hostile.most  # the bound, and what the sockets took
        assert peak - before < 4 * bound + 64 * MIB, f"the router grew {(peak - before) / MIB:.0f} MiB"
        resp = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=10)
        assert resp.status_code == 200, resp.text
    finally:
        hostile.stop()
