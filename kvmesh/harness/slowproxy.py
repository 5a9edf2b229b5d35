"""A TCP proxy that adds latency and caps bandwidth: a shared tier "far away", for benchmarks.

``SlowProxy(target_port, latency_s=0.05, bandwidth_bps=...)`` listens on a loopback port and
forwards every connection to ``127.0.0.1:target_port``. Each direction delivers every byte
``latency_s`` after it was read (one way: a request and its answer take twice that) and no
faster than ``bandwidth_bps``, like a link that far away and that narrow; the byte stream
is never changed or reordered. It runs as a process of its own (``python -m
kvmesh.harness.slowproxy``), so its timers do not share an interpreter lock with the client
it is measured by. ``tc netem`` would do the same in the kernel, but needs a network
namespace and root, which a benchmark should not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Iterator

from kvmesh.harness.ports import free_port, wait_for_port
from kvmesh.harness.processes import Service

_CHUNK = 64 << 10


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, latency_s: float, bandwidth_bps: float
) -> None:
    """Copy ``reader`` to ``writer``: each chunk leaves ``latency_s`` after it arrived, and
    the link carries ``bandwidth_bps`` at most (a chunk leaves once the ones before it have)."""
    queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

    async def read() -> None:
        try:
            while data := await reader.read(_CHUNK):
                await queue.put((time.monotonic() + latency_s, data))
        except (ConnectionError, OSError):
            pass
        finally:
            await queue.put(None)

    async def write() -> None:
        link_free = 0.0  # when the link has sent what it took before
        try:
            while (item := await queue.get()) is not None:
                due, data = item
                start = max(due, link_free)
                link_free = start + (len(data) / bandwidth_bps if bandwidth_bps > 0 else 0.0)
                delay = link_free - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(ConnectionError, OSError):
                writer.close()

    await asyncio.gather(read(), write())


async def serve(listen_port: int, target_port: int, latency_s: float, bandwidth_bps: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(
            _pipe(client_r, server_w, latency_s, bandwidth_bps),
            _pipe(server_r, client_w, latency_s, bandwidth_bps),
        )

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def slow_redis(latency_s: float, bandwidth_bps: float) -> Iterator[str]:
    """A throwaway redis-server behind a :class:`SlowProxy`: yields the proxy's ``redis://`` URL."""
    from kvmesh.harness.services import RedisServer

    with RedisServer() as server, SlowProxy(server.port, latency_s, bandwidth_bps) as proxy:
        proxy.start()
        yield f"redis://127.0.0.1:{proxy.port}"


class SlowProxy(Service):
    """The proxy as a process (see the module docstring); ``port`` is where to connect."""

    name = "slow proxy"

    def __init__(
        self, target_port: int, latency_s: float, bandwidth_bps: float, log_path: str | None = None
    ) -> None:
        self.port = free_port()
        self.latency_s, self.bandwidth_bps = latency_s, bandwidth_bps
        args = [sys.executable, "-m", "kvmesh.harness.slowproxy", "--listen", str(self.port)]
        args += ["--target", str(target_port), "--latency", str(latency_s), "--bandwidth", str(bandwidth_bps)]
        super().__init__(args, dict(os.environ), log_path)

    def ready(self) -> bool:
        wait_for_port(self.port, timeout=0.2)
        return True


def main() -> None:
    p = argparse.ArgumentParser(description="TCP proxy adding latency and capping bandwidth (loopback)")
    p.add_argument("--listen", type=int, required=True)
    p.add_argument("--target", type=int, required=True)
    p.add_argument("--latency", type=float, default=0.05, help="one-way delay, seconds")
    p.add_argument("--bandwidth", type=float, default=0.0, help="bytes per second per direction (0: no cap)")
    args = p.parse_args()
    asyncio.run(serve(args.listen, args.target, args.latency, args.bandwidth))


if __name__ == "__main__":
    main()
