"""The scheduler-to-worker RPC across nodes: TCP with the fleet key, the address each rank
reports through vLLM's handshake metadata, and a rank that cannot be reached or does not
answer reported as an error (real sockets; a second "node" is a different node id)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvmesh.core.fleetkey import FleetKey
from kvmesh.errors import ConfigError
from kvmesh.integrations.vllm.ranks import choose_address, connect_ranks, rpc_tcp_host
from kvmesh.integrations.vllm.rpc import RpcAddress, RpcClient, RpcServer, node_id, socket_path
from kvmesh.transport.listener import Limits

KEY = FleetKey([b"unit-test fleet key, 32 bytes or more"])


def _server(tmp_path: Path, name: str, tcp: bool = True, **handlers: Any) -> RpcServer:
    path = socket_path(name, 0, 0, str(tmp_path))
    return RpcServer(path, handlers, key=KEY, tcp_host="127.0.0.1" if tcp else None).start()


def test_tcp_and_unix_answer_alike(tmp_path: Path) -> None:
    server = _server(tmp_path, "e1", lookup=lambda req, seq, tokens: len(tokens))
    try:
        assert server.tcp_address is not None
        unix = RpcClient(server.path)
        tcp = RpcClient(server.tcp_address, key=KEY)
        for client in (unix, tcp):
            assert client.call("lookup", req="r", seq=1, tokens=list(range(5000))) == 5000
            assert client.call("ping") == "pong"
        assert RpcClient(server.tcp_address).call("ping") is None  # TCP needs the key
        addr = server.address()
        assert addr.node == node_id() and addr.path == server.path and addr.tcp_port == server.tcp_address[1]
    finally:
        server.close()


def test_tcp_needs_a_key_and_rpc_host_is_chosen(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="without a fleet key"):
        RpcServer(str(tmp_path / "x.sock"), {}, tcp_host="127.0.0.1")
    opts = SimpleNamespace(rpc_host=None, fleet_key=KEY)
    assert rpc_tcp_host(opts, 1) is None  # one rank: beside its scheduler, the unix socket
    assert rpc_tcp_host(SimpleNamespace(rpc_host=None, fleet_key=None), 4) is None
    assert rpc_tcp_host(SimpleNamespace(rpc_host="10.1.2.3", fleet_key=KEY), 1) == "10.1.2.3"
    assert rpc_tcp_host(opts, 2)  # vLLM's host IP


def test_choose_address_by_node() -> None:
    a = RpcAddress("n1/boot", "/tmp/s.sock", "10.0.0.2", 4000)
    assert choose_address(0, a, here="n1/boot")[0] == "/tmp/s.sock"
    assert choose_address(1, a, here="n2/boot")[0] == ("10.0.0.2", 4000)
    target, why = choose_address(1, RpcAddress("n1/boot", "/tmp/s.sock"), here="n2/boot")
    assert target is None and "fleet_key_file" in why and "rank 1" in why


def test_connect_ranks_retargets_and_reports_the_ones_that_do_not_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = _server(tmp_path, "r0", tcp=False)
    remote = _server(tmp_path, "r1")  # "another node": reached over TCP
    gone = _server(tmp_path, "r3")
    gone_addr = gone.address()
    gone.close()  # a rank that reported an address and then died
    try:
        lookups = [
            RpcClient(f"/nonexistent/{r}.sock", timeout_s=0.5, key=KEY, label=f"rank {r}") for r in range(4)
        ]
        others = [RpcClient(c.address, timeout_s=0.5, key=KEY) for c in lookups]
        meta = {
            0: local.address(),
            1: RpcAddress("elsewhere/1", remote.path, *remote.tcp_address),  # type: ignore[misc]
            3: RpcAddress("elsewhere/3", gone_addr.path, gone_addr.tcp_host, gone_addr.tcp_port),
        }  # rank 2 reported nothing
        with caplog.at_level(logging.INFO):
            alive = connect_ranks(lookups, others, meta, KEY, probe_timeout_s=0.5)
        assert alive == [0, 1]
        assert lookups[1].address == remote.tcp_address and others[1].address == remote.tcp_address
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("no address of TP rank 2" in m for m in errors)
        assert any("rank 3" in m and "does not answer" in m for m in errors)
    finally:
        local.close()
        remote.close()


def test_a_rank_that_keeps_failing_is_an_error_now_and_then(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = RpcClient(str(tmp_path / "none.sock"), timeout_s=0.2, label="TP rank 1")
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            assert client.call("lookup") is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "TP rank 1" in errors[0].getMessage() and client.failures == 5
    server = RpcServer(client.path, {}).start()
    try:
        with caplog.at_level(logging.WARNING):
            assert client.call("ping") == "pong"
        assert "answers again" in caplog.records[-1].getMessage()
    finally:
        server.close()


def test_idle_connections_are_closed_and_the_client_reconnects(tmp_path: Path) -> None:
    lim = Limits(max_frame=1 << 20, idle_s=0.3, handshake_s=0.3)
    path = socket_path("idle", 0, 0, str(tmp_path))
    server = RpcServer(path, {}, key=KEY, tcp_host="127.0.0.1", limits=lim).start()
    try:
        assert server.tcp_address is not None
        for client in (RpcClient(path), RpcClient(server.tcp_address, key=KEY)):
            assert client.call("ping") == "pong"
            time.sleep(0.6)  # the worker closed the idle connection meanwhile
            assert client.call("ping") == "pong" and client.failures == 0
    finally:
        server.close()


def test_a_socket_dir_too_deep_for_a_unix_socket_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """The worker's bind failed with "AF_UNIX path too long" inside vLLM's engine start-up;
    the path is refused where it is made, with the key to change."""
    deep = str(tmp_path / ("d" * 80))
    with pytest.raises(ConfigError, match=r"socket_dir '.*d{80}'.* more than a unix socket's path may be"):
        socket_path("engine", 0, 0, deep)
    assert len(socket_path("engine", 0, 0, "/tmp")) <= 107
