"""The bounded listener under kvmesh's socket protocols, over real sockets: a proof with a
large request right behind it, requests pipelined on one connection, the pool and the
dedicated modes alike, idle peers closed at their deadlines, and close() while a request
runs. (Hostile peers against the real transfer server: tests/security/.)"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvmesh.core import stallwatch
from kvmesh.core.fleetkey import TRANSFER_AUTH, FleetKey
from kvmesh.transport.listener import Limits, Listener
from kvmesh.transport.wire import frame, recv_msg, send_msg
from tests.waiting import eventually

KEY = FleetKey([b"unit-test fleet key, 32 bytes or more"])


def echo(sock: socket.socket, msg: dict[str, Any]) -> bool:
    if msg.get("op") == "sleep":
        time.sleep(float(msg["s"]))
    send_msg(sock, {"t": "ok", "n": len(msg.get("blob", b""))})
    return True


@pytest.fixture(params=[False, True], ids=["pool", "dedicated"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[Listener, int]]:
    lim = Limits(max_frame=1 << 20, handshake_s=0.5, idle_s=0.5, message_s=0.5)
    lst = Listener("test", echo, KEY, TRANSFER_AUTH, lim, dedicated=request.param)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    lst.add(sock, authenticate=True)
    lst.start()
    yield lst, sock.getsockname()[1]
    lst.close()


def _proof(s: socket.socket) -> bytes:
    nonce = os.urandom(32)
    s.sendall(frame({"op": "hello", "v": 1, "nonce": nonce}))
    ch = recv_msg(s, deadline=time.monotonic() + 2)
    return frame({"op": "auth", "mac": KEY.mac(TRANSFER_AUTH, b"client", nonce, ch["nonce"])})


def test_a_large_request_right_behind_the_proof_is_served(server: tuple[Listener, int]) -> None:
    lst, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        blob = os.urandom(300_000)  # far over the 4 KiB cap a peer has before its proof
        s.sendall(_proof(s) + frame({"op": "x", "blob": blob}) + frame({"op": "y"}))
        assert recv_msg(s, deadline=time.monotonic() + 2) == {"t": "ok", "n": 300_000}
        assert recv_msg(s, deadline=time.monotonic() + 2) == {"t": "ok", "n": 0}
    assert lst.stats()["requests"] == 2 and lst.stats()["auth_failures"] == 0


def test_idle_peers_are_closed_at_their_deadlines(server: tuple[Listener, int]) -> None:
    lst, port = server
    fresh = socket.create_connection(("127.0.0.1", port), timeout=5)
    done = socket.create_connection(("127.0.0.1", port), timeout=5)
    done.sendall(_proof(done) + frame({"op": "x"}))
    recv_msg(done, deadline=time.monotonic() + 2)
    time.sleep(1.2)  # past handshake_s for the first, idle_s for the second
    for s in (fresh, done):
        assert _hung_up(s)
        s.close()
    assert lst.stats()["deadline_drops"] == 2 and lst.stats()["open"] == 0


def _hung_up(s: socket.socket) -> bool:
    s.settimeout(1.0)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


def test_close_while_a_request_runs(server: tuple[Listener, int]) -> None:
    lst, port = server
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(_proof(s) + frame({"op": "sleep", "s": 0.3}))
    time.sleep(0.1)
    t0 = time.monotonic()
    lst.close()
    assert time.monotonic() - t0 < 2.5
    assert not any(t.name == "test" for t in threading.enumerate())  # the selector thread ended
    assert _hung_up(s)  # the request's connection is closed once its handler returns
    s.close()


def _stall_first_wait(lst: Listener, seconds: float = 1.2) -> threading.Event:
    """Fault injection: the selector thread's next wait overruns by ``seconds`` and returns
    nothing (as a thread starved of the CPU or the interpreter lock would); set once it began."""
    real = lst._sel.select
    stalled = threading.Event()

    def select(timeout: float | None = None) -> Any:
        if not stalled.is_set():
            stalled.set()
            time.sleep(seconds)
            return []
        return real(timeout)

    lst._sel.select = select  # type: ignore[method-assign]
    return stalled


def test_a_held_up_selector_thread_is_counted_and_logged(
    server: tuple[Listener, int], caplog: pytest.LogCaptureFixture
) -> None:
    """Fault injection: the selector thread's next wait overruns by 1.2 s (as a thread starved
    of the CPU or the interpreter lock would); the listener reports it and keeps serving."""
    lst, port = server
    stalled = _stall_first_wait(lst)
    assert stalled.wait(5)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(_proof(s) + frame({"op": "x"}))
        assert recv_msg(s, deadline=time.monotonic() + 2) == {"t": "ok", "n": 0}
    assert lst.stats()["loop_late_ms_max"] >= 1000 and lst.stats()["held_up"] == 1
    assert any("held up" in r.getMessage() for r in caplog.records)


def test_with_stall_dumps_on_a_held_up_line_says_what_happened_meanwhile(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With ``KVMESH_STALL_DUMP_S`` set, the held-up line carries the process's CPU time, major
    page faults and the hypervisor's steal over the stall (kvmesh.core.stallwatch.meanwhile):
    what tells a thread starved of the interpreter lock from a virtual CPU not scheduled."""
    stallwatch.reset_for_tests(30.0)  # on; no dump within the test
    lst = Listener("test", echo, KEY, TRANSFER_AUTH, Limits(), dedicated=False)
    stalled = _stall_first_wait(lst)
    try:
        lst.start()
        assert stalled.wait(5)
        eventually(lambda: lst.stats()["held_up"], 5)
    finally:
        lst.close()
        stallwatch.reset_for_tests()
    (line,) = [r.getMessage() for r in caplog.records if "held up" in r.getMessage()]
    assert "meanwhile (" in line and "s of CPU in all its threads" in line, line
    assert f"the thread runs on cpu {','.join(map(str, sorted(os.sched_getaffinity(0))))}" in line


def test_a_thread_held_up_until_a_socket_is_ready_is_counted_too(server: tuple[Listener, int]) -> None:
    """Fault injection: the selector thread is held up 1.2 s and wakes to a ready socket (the
    connection that arrived meanwhile), the way a starved thread does. A CI run's producer
    counted 781 ms on such a listener while a handshake waited 5 s for it: the overrun of a
    wait that returned ready sockets went uncounted."""
    lst, port = server
    real = lst._sel.select
    stalled, connected = threading.Event(), threading.Event()

    def select(timeout: float | None = None) -> Any:
        if not stalled.is_set():
            stalled.set()
            assert connected.wait(5)
            time.sleep(1.2)
            ready = real(1.0)
            assert ready  # the connection below
            return ready
        return real(timeout)

    lst._sel.select = select  # type: ignore[method-assign]
    assert stalled.wait(5)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        connected.set()
        s.sendall(_proof(s) + frame({"op": "x"}))
        assert recv_msg(s, deadline=time.monotonic() + 5) == {"t": "ok", "n": 0}
    assert lst.stats()["loop_late_ms_max"] >= 1000 and lst.stats()["held_up"] == 1
