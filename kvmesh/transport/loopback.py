"""The transfer's own speed: a pull between two engines over loopback against a raw socket
send of the same bytes, interleaved in one run (for ``kvmesh bench pd``).

The producer runs in a child process, as it does in vLLM (another replica's worker); the
raw send comes from that process too. The raw send is the floor any protocol pays: one
``sendall`` of the payload bytes, read
with ``recv_into`` into one preallocated buffer, no framing, no checksum, no pool, over a
socket set up as the transfer's are (the same :data:`~kvmesh.transport.wire.SOCKET_BUFFER`
send and receive buffers, ``TCP_NODELAY``). The pull does everything a consumer does with a
fleet key: the handshake, framing, header checks, a pool slot per chunk, the keyed BLAKE3
MAC of every chunk (computed by the producer when it pins, checked by the consumer). The
two alternate which goes first, repeat by repeat.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from kvmesh.core.engine import CacheEngine
from kvmesh.core.fleetkey import FleetKey
from kvmesh.core.keys import KVLayout
from kvmesh.transport.client import connect, pull
from kvmesh.transport.pins import PinLedger
from kvmesh.transport.server import TransferServer
from kvmesh.transport.wire import SOCKET_BUFFER, recv_into_exact


def _chunking(chunk_size: int | None) -> dict[str, int]:
    """The engine config's chunk size: kvmesh's shipped default unless one is asked for."""
    return {} if chunk_size is None else {"chunk_size": chunk_size}


def _producer(
    conn: Connection, tokens: int, dims: tuple[int, int, int], chunk_size: int | None, secret: bytes
) -> None:
    """Child process: an engine holding ``tokens`` tokens of random KV behind a transfer
    server, and a raw server sending the same bytes to whoever connects; then waits."""
    layout = KVLayout(*dims, torch.float32)
    nbytes = tokens * layout.bytes_per_token
    cfg = {**_chunking(chunk_size), "max_local_cpu_size": nbytes / 1e9 + 0.05, "admin_enabled": False}
    eng = CacheEngine(cfg, layout=layout, model_id="loopback")
    kv = torch.randn(layout.shape(tokens), generator=torch.Generator().manual_seed(0))
    eng.store(np.arange(tokens, dtype=np.int64), kv)
    pins = PinLedger(eng, 600.0, max_chunks=eng.cpu.pool.num_slots)  # the pool is sized for this transfer
    srv = TransferServer(eng, pins, "127.0.0.1", 0, key=FleetKey([secret])).start()
    keys = eng.keys.keys_for_array(np.arange(tokens, dtype=np.uint32))
    pins.hold("bench", keys)  # as the producer's export does
    srv.prepare(keys)
    payload = bytearray(kv.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(4)

    def raw_loop() -> None:
        while True:
            try:
                c, _ = lst.accept()
            except OSError:
                return
            with c:  # set up as the transfer server's connections are
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
                c.sendall(payload)

    threading.Thread(target=raw_loop, daemon=True).start()
    conn.send((srv.port, lst.getsockname()[1]))
    conn.recv()  # until the parent is done
    lst.close()
    srv.close()
    eng.close()


def _raw_once(port: int, sink: memoryview) -> float:
    t0 = time.perf_counter()
    with connect(("127.0.0.1", port), 60.0) as sock:  # the transfer client's own socket set-up
        recv_into_exact(sock, sink)
    return time.perf_counter() - t0


def transfer_vs_raw(
    tokens: int = 2048,
    dims: tuple[int, int, int] = (4, 8, 64),
    chunk_size: int | None = None,
    repeats: int = 5,
) -> dict[str, Any]:
    """Median GB/s of a pull of ``tokens`` tokens of float32 KV (``dims``: layers, KV heads,
    head size) from a producer process into this process's engine, and of a raw send of
    the same bytes from that process, alternating which goes first; ``ratio``: median of the
    paired ratios. ``chunk_size``: kvmesh's shipped default unless given."""
    layout = KVLayout(*dims, torch.float32)
    nbytes = tokens * layout.bytes_per_token
    secret = FleetKey.generate().encode()
    key = FleetKey([secret])
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=_producer, args=(child, tokens, dims, chunk_size, secret), daemon=True
    )
    proc.start()
    cfg = {**_chunking(chunk_size), "max_local_cpu_size": nbytes / 1e9 + 0.05, "admin_enabled": False}
    cons = CacheEngine(cfg, layout=layout, model_id="loopback")
    try:
        if not parent.poll(120):
            raise ConnectionError("the loopback producer process did not start within 120 s")
        port, raw_port = parent.recv()
        toks = np.arange(tokens, dtype=np.int64)
        keys = cons.keys.keys_for_array(toks.astype(np.uint32))
        sink = memoryview(bytearray(nbytes))
        pulls, raws, ratios = [], [], []

        def pulled() -> float:
            cons.clear("cpu", force=True)
            t0 = time.perf_counter()
            res = pull(
                cons, "127.0.0.1", port, "bench", keys, toks, timeout_s=60.0, confirm_after=False, key=key
            )
            took = time.perf_counter() - t0
            if res.reason is not None or res.nbytes != nbytes:
                raise ConnectionError(f"loopback pull failed: {res.reason} {res.detail}")
            return took

        for i in range(repeats + 1):  # the first pair warms both paths' pages: not counted
            if i % 2 == 0:  # who goes first alternates: neither always meets a warmer machine
                took = pulled()
                raw = _raw_once(raw_port, sink)
            else:
                raw = _raw_once(raw_port, sink)
                took = pulled()
            if i:
                pulls.append(nbytes / took / 1e9)
                raws.append(nbytes / raw / 1e9)
                ratios.append(raw / took)
        return {
            "bytes": nbytes,
            "chunks": len(keys),
            "repeats": repeats,
            "pull_gbps": statistics.median(pulls),
            "raw_gbps": statistics.median(raws),
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "pull_gbps_all": pulls,
            "raw_gbps_all": raws,
        }
    finally:
        parent.send("done")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        cons.close()
