"""The PD transfer itself: producer-to-consumer GB/s over loopback, against a raw socket.

The producer is a :class:`~kvmesh.CacheEngine` holding ``nbytes`` of random KV (an
8B-class layout: 32 layers, 8 KV heads of 128, bfloat16, 128 KiB per token) behind kvmesh's
:class:`~kvmesh.transport.TransferServer`; the consumer pulls every chunk into its own
engine's pool with :func:`~kvmesh.transport.pull` (framing, verification and the pool slots
included). The reference sends the same bytes over a plain loopback TCP socket
(``sendall`` into a ``recv_into`` loop, no framing, no checks): what the machine can move.
Both run ``repeats`` times, interleaved; GB/s is the median.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from typing import Any

GB = 1e9


def _raw_once(payload: memoryview) -> float:
    """Seconds to send ``payload`` over a fresh loopback connection until the receiver has it all."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    got: list[float] = []

    def receive() -> None:
        conn, _ = listener.accept()
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        left = len(payload)
        while left:
            n = conn.recv_into(view[: min(left, len(buf))])
            if not n:
                break
            left -= n
        got.append(time.perf_counter())
        conn.sendall(b"k")  # the ack, as the transport's confirm
        conn.close()

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        sock.sendall(payload)
        sock.recv(1)
        elapsed = time.perf_counter() - t0
    thread.join(10)
    listener.close()
    return elapsed


def measure(nbytes: int, repeats: int = 3) -> dict[str, Any]:
    """``{"raw_socket_gbps", "kvmesh_gbps", "ratio", ...}``; ``error`` says why kvmesh's side
    could not run (the raw socket figure is still given)."""
    import numpy as np

    out: dict[str, Any] = {"bytes": nbytes, "repeats": repeats}
    try:
        from kvmesh.core.engine import CacheEngine
        from kvmesh.core.keys import KVLayout
        from kvmesh.transport import PinLedger, TransferServer, pull
    except ImportError as exc:
        payload = memoryview(np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).data)
        out["raw_socket_gbps"] = round(
            nbytes / statistics.median(_raw_once(payload) for _ in range(repeats)) / GB, 3
        )
        out["error"] = f"kvmesh's transport is not available: {exc}"
        return out
    import torch

    layout = KVLayout(num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16")
    chunk = 256
    n_tokens = max(chunk, nbytes // layout.bytes_per_token // chunk * chunk)
    cfg = {"chunk_size": chunk, "max_local_cpu_size": 2.2 * n_tokens * layout.bytes_per_token / (1 << 30)}
    tokens = np.arange(n_tokens, dtype=np.uint32) + 7
    kv = torch.randn(layout.shape(n_tokens), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    producer = CacheEngine(cfg, layout=layout, model_id="bench-pd")
    pins = PinLedger(producer, timeout_s=60.0)
    server = TransferServer(producer, pins).start()
    try:
        producer.store(tokens, kv)
        keys = producer.keys.keys(tokens)
        payload = memoryview(kv.view(torch.uint8).reshape(-1).numpy().data)
        sent = len(payload)
        raw, ours = [], []
        for i in range(repeats):
            raw.append(_raw_once(payload))
            consumer = CacheEngine(cfg, layout=layout, model_id="bench-pd")
            try:
                pins.hold(f"bench-{i}", keys)
                res = pull(consumer, "127.0.0.1", server.port, f"bench-{i}", keys, tokens, timeout_s=120.0)
                if res.reason is not None:
                    out["error"] = f"pull failed: {res.reason} {res.detail}"
                    break
                ours.append(res.seconds)
                out["pulled_bytes"] = res.nbytes
            finally:
                consumer.close()
        out["bytes"] = sent
        out["chunks"] = len(keys)
        out["raw_socket_gbps"] = round(sent / statistics.median(raw) / GB, 3)
        if ours:
            out["kvmesh_gbps"] = round(sent / statistics.median(ours) / GB, 3)
            out["ratio"] = round(out["kvmesh_gbps"] / out["raw_socket_gbps"], 3)
            out["target_ge"] = 0.8
            out["met"] = out["ratio"] >= 0.8
    finally:
        server.close()
        pins.close()
        producer.close()
    return out
