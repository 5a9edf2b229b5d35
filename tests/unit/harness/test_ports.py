"""The one free_port: loopback, bindable, never handed out twice in a row of many."""

from __future__ import annotations

import socket
import threading

import pytest

from kvmesh.harness.ports import free_port, wait_for_port


def test_free_ports_are_not_handed_out_twice() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_a_free_port_can_be_bound_on_loopback() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_the_fixture_is_the_harness_function(free_port: object) -> None:
    from kvmesh.harness import ports

    assert free_port is ports.free_port


def test_wait_for_port() -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        wait_for_port(int(srv.getsockname()[1]), timeout=2)
    port = free_port()
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port}"):
        wait_for_port(port, timeout=0.3)
    # a listener that comes up late is waited for
    late = socket.socket()
    late.bind(("127.0.0.1", 0))
    timer = threading.Timer(0.3, late.listen)
    timer.start()
    try:
        wait_for_port(int(late.getsockname()[1]), timeout=5)
    finally:
        timer.cancel()
        late.close()
