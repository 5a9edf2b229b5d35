"""The scheduler-to-worker lookup RPC over TCP (tensor-parallel ranks on another node): a
worker's RPC is reachable from the network there, and its operations pin, clear and report
the cache. A hostile peer (plain sockets) calls it without the fleet key, with another key,
and announces frames far over the limit; none of it may reach a handler or cost memory,
while the scheduler's client holding the key gets its answers."""

from __future__ import annotations

import contextlib
import gc
import socket
import struct
import time
from pathlib import Path
from typing import Any

from kvmesh.core.fleetkey import FleetKey
from kvmesh.integrations.vllm.rpc import RpcClient, RpcServer
from tests.security.pd_peers import frame, read_all, rss_bytes

MIB = 1 << 20


def test_rpc_over_tcp_answers_only_fleet_members(tmp_path: Path) -> None:
    key = FleetKey([FleetKey.generate().encode()])
    calls: list[dict[str, Any]] = []

    def clear(**kw: Any) -> int:
        calls.append(kw)
        return 7

    server = RpcServer(str(tmp_path / "w.sock"), {"clear": clear}, key=key, tcp_host="127.0.0.1").start()
    try:
        assert server.tcp_address is not None
        host, port = server.tcp_address
        with socket.create_connection((host, port), timeout=5) as s:  # no handshake
            s.sendall(frame({"op": "clear", "tier": "cpu"}))
            got = read_all(s, 1.0)
        assert b"ok" not in got and calls == []
        stranger = FleetKey([b"not this fleet's key, but 32 bytes long"])
        assert RpcClient((host, port), timeout_s=1.0, key=stranger).call("clear", tier="cpu") is None
        assert calls == []
        gc.collect()
        rss0 = rss_bytes()
        socks = [socket.create_connection((host, port), timeout=5) for _ in range(16)]
        for s in socks:  # each announces a frame far over the cap, then sends part of it
            with contextlib.suppress(OSError):
                s.sendall(struct.pack(">I", 1 << 30) + b"\0" * 4096)
        time.sleep(0.5)
        grew = rss_bytes() - rss0
        closed = sum(_hung_up(s) for s in socks)
        for s in socks:
            s.close()
        assert grew < 8 * MIB and closed == len(socks)
        assert RpcClient((host, port), timeout_s=2.0, key=key).call("clear", tier="cpu") == 7
        assert calls == [{"tier": "cpu"}]
    finally:
        server.close()


def _hung_up(s: socket.socket) -> bool:
    """Whether the server closed the connection (after any error message it sent)."""
    s.settimeout(1.0)
    try:
        while s.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True
