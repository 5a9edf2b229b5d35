"""Bounded reads of a replica's answers (kvmesh.routing.replies) against a real aiohttp server
on 127.0.0.1: whole bodies however they arrive, nothing past a bound, JSON bounded in depth."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvmesh.routing.replies import ReplyError, json_capped, read_capped

BIG = {"events": [{"block": i, "tokens": list(range(16))} for i in range(20_000)]}  # ~1.3 MB
BIG_JSON = json.dumps(BIG).encode()


async def _trickled(request: web.Request) -> web.StreamResponse:
    """BIG in 16 KiB writes, chunked: it reaches the reader in many reads."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    for i in range(0, len(BIG_JSON), 16 << 10):
        await resp.write(BIG_JSON[i : i + (16 << 10)])
        await asyncio.sleep(0)
    return resp


async def _declared(request: web.Request) -> web.StreamResponse:
    """Declares 10 GB; sends a few bytes."""
    resp = web.StreamResponse(headers={"Content-Length": str(10 << 30)})
    await resp.prepare(request)
    await resp.write(b"x" * 1024)
    return resp


ROUTES: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]] = {
    "/trickled": _trickled,
    "/declared": _declared,
    "/empty": lambda r: _static(b""),
    "/deep": lambda r: _static(b"[" * 100_000 + b"]" * 100_000),
}


async def _static(body: bytes) -> web.StreamResponse:
    return web.Response(body=body, content_type="application/json")


def _get(path: str, read: Callable[[aiohttp.ClientResponse], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        app = web.Application()
        for route, handler in ROUTES.items():
            app.router.add_get(route, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with (
                aiohttp.ClientSession() as client,
                client.get(f"http://127.0.0.1:{port}{path}") as resp,
            ):
                return await read(resp)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_a_body_that_arrives_in_many_reads_is_read_whole() -> None:
    """One ``content.read(n)`` returns what has arrived, not ``n`` bytes: the cost reports read
    their JSON that way, and a body longer than one network read failed to parse."""
    assert _get("/trickled", lambda r: json_capped(r, 4 << 20)) == BIG


def test_nothing_past_the_bound_is_read() -> None:
    with pytest.raises(ReplyError, match="over its bound"):
        _get("/trickled", lambda r: read_capped(r, 1 << 20))
    with pytest.raises(ReplyError, match=f"answered {10 << 30} bytes"):  # refused on its header
        _get("/declared", lambda r: read_capped(r, 1 << 20))


def test_json_is_bounded_in_depth_and_an_empty_body_is_none() -> None:
    assert _get("/empty", json_capped) is None  # as aiohttp's json(): an error status may have none
    with pytest.raises(ReplyError, match="nested deeper"):
        _get("/deep", json_capped)
