"""Finding 4: the PD transfer server against peers that hold it up. Plain sockets connect to a
real producer's transfer server and stay idle, drip a message a byte at a time, announce a
16 MiB control frame, or arrive by the hundred. The server must not allocate what a frame
announces, must not give such peers a thread each, must cut them off at their deadlines,
and must keep serving a real consumer (a PdWorker, over the fleet key handshake) meanwhile:
64 such connections cost under 16 MiB and delay a transfer by under 100 ms."""

from __future__ import annotations

import contextlib
import gc
import socket
import statistics
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvmesh.core.fleetkey import TRANSFER_AUTH
from kvmesh.integrations.vllm.pd import PdWorker, response_params
from kvmesh.transport.auth import client_handshake
from kvmesh.transport.listener import Limits
from tests.security.pd_peers import CS, frame, pair, prompt, rss_bytes

MIB = 1 << 20
ANNOUNCE_16MIB = struct.pack(">I", 16 * MIB)  # the largest frame the server used to accept


def _timed_pull(prod: PdWorker, cons: PdWorker, toks: list[int], i: int) -> float:
    answer = prod.export(f"p-{i}", toks)
    assert answer is not None
    params = response_params("engine-p", [answer], key=prod.key, ttl_s=60)
    cons.engine.clear("cpu", force=True)
    t0 = time.perf_counter()
    got = cons.pull(f"d-{i}", toks, params)
    took = time.perf_counter() - t0
    assert got["reason"] is None and got["tokens"] == len(toks), got
    return took


@contextlib.contextmanager
def hostile(port: int, idle: int, slow: int, big: int) -> Iterator[list[socket.socket]]:
    """``idle`` connections that send nothing, ``slow`` that drip a hello a byte every
    50 ms, ``big`` that announce a 16 MiB frame and then drip its body."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(idle + slow + big)]
    hello = frame({"op": "hello", "v": 1, "nonce": b"n" * 32})
    stop = threading.Event()

    def drip() -> None:
        for s in socks[idle + slow :]:
            with contextlib.suppress(OSError):
                s.sendall(ANNOUNCE_16MIB)
        i = 0
        while not stop.wait(0.05):
            for s in socks[idle:]:
                with contextlib.suppress(OSError):
                    s.send(hello[i % len(hello) : i % len(hello) + 1])
            i += 1

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    try:
        yield socks
    finally:
        stop.set()
        t.join()
        for s in socks:
            s.close()


def test_64_idle_or_dripping_connections_cost_little_and_delay_nothing(tmp_path: Path) -> None:
    with pair(tmp_path) as (prod, cons):
        toks, kv = prompt(4 * CS)
        prod.engine.store(toks, kv)
        base = [_timed_pull(prod, cons, toks, i) for i in range(7)]  # also touches the pool pages
        gc.collect()
        rss0, threads0 = rss_bytes(), threading.active_count()
        with hostile(prod.server.port, idle=22, slow=21, big=21):  # type: ignore[union-attr]
            time.sleep(0.5)  # every connection accepted, every 16 MiB frame announced
            under = [_timed_pull(prod, cons, toks, 100 + i) for i in range(7)]
            grew = rss_bytes() - rss0
            threads = threading.active_count() - threads0
        delay = statistics.median(under) - statistics.median(base)
        assert grew < 16 * MIB, f"64 hostile connections cost {grew / MIB:.1f} MiB"
        assert threads <= 4, f"64 hostile connections cost {threads} threads"
        assert delay < 0.100, f"a transfer took {delay * 1000:.0f} ms longer beside them"


def test_a_connection_flood_is_capped(tmp_path: Path) -> None:
    with pair(tmp_path) as (prod, cons):
        toks, kv = prompt(2 * CS, seed=2)
        prod.engine.store(toks, kv)
        threads0 = threading.active_count()
        socks: list[socket.socket] = []
        try:
            for _ in range(300):
                socks.append(socket.create_connection(("127.0.0.1", prod.server.port), timeout=5))  # type: ignore[union-attr]
            time.sleep(0.3)
            assert threading.active_count() - threads0 <= 4, "a thread per connection"
            assert prod.server.listener.stats()["open"] <= Limits().max_fresh  # type: ignore[union-attr]
            _timed_pull(prod, cons, toks, 0)  # the newest connection is the real consumer's
        finally:
            for s in socks:
                s.close()


def _closed_within(s: socket.socket, seconds: float, drip: bytes) -> float | None:
    """Drip ``drip`` a byte at a time every 0.2 s until the server hangs up; how long it took."""
    t0 = time.monotonic()
    s.settimeout(0.2)
    i = 0
    while time.monotonic() - t0 < seconds:
        try:
            s.send(drip[i % len(drip) : i % len(drip) + 1])
            if s.recv(4096) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            pass
        except OSError:
            return time.monotonic() - t0
        i += 1
    return None


def test_a_dripped_message_is_cut_off_at_its_deadline(tmp_path: Path) -> None:
    with pair(tmp_path) as (prod, _):
        port: Any = prod.server.port  # type: ignore[union-attr]
        lim = Limits()
        hello = frame({"op": "hello", "v": 1, "nonce": b"n" * 32})
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            took = _closed_within(s, lim.handshake_s + 3, hello)
        assert took is not None and took < lim.handshake_s + 1, "a dripping peer kept its connection"
        # An authenticated peer that drips a request (200+ bytes at 5 a second): the
        # per-message deadline.
        key = prod.key
        assert key is not None
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            client_handshake(s, key, TRANSFER_AUTH, time.monotonic() + 2)
            fetch = frame({"op": "fetch", "req": "x" * 200, "first": 0, "count": 1})
            took = _closed_within(s, lim.message_s + 3, fetch)
        assert took is not None and took < lim.message_s + 1, "an authenticated peer dripped without end"
