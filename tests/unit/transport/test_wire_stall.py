"""The wire's read bounds over a real socket pair: ``deadline`` bounds a whole message,
``stall_s`` the silence between bytes. A peer that stops mid-message raises
:class:`~kvmesh.transport.wire.Stalled` after ``stall_s``; one that keeps sending never
does, and a deadline that comes first is a plain ``TimeoutError``."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvmesh.transport.wire import Stalled, recv_exact, recv_into_exact


def _drip(sock: socket.socket, pieces: int, every_s: float) -> threading.Thread:
    def run() -> None:
        for _ in range(pieces):
            sock.sendall(b"x" * 10)
            time.sleep(every_s)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_peer_that_stops_mid_message_is_a_stall_after_stall_s() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"x" * 10)  # 10 of the 100 bytes, then nothing
        t0 = time.monotonic()
        with pytest.raises(Stalled, match=r"nothing arrived for 0\.3 s"):
            recv_exact(a, 100, time.monotonic() + 5.0, stall_s=0.3)
        assert 0.25 < time.monotonic() - t0 < 2.0


def test_a_slow_peer_that_keeps_sending_is_not_a_stall() -> None:
    a, b = socket.socketpair()
    with a, b:
        writer = _drip(b, 10, 0.15)  # 100 bytes over 1.5 s, more than stall_s, never silent for it
        view = memoryview(bytearray(100))
        recv_into_exact(a, view, time.monotonic() + 5.0, stall_s=1.0)
        writer.join()
        assert bytes(view) == b"x" * 100


def test_a_deadline_before_the_stall_bound_is_a_plain_timeout() -> None:
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(TimeoutError) as info:
            recv_exact(a, 10, time.monotonic() + 0.2, stall_s=5.0)
        assert not isinstance(info.value, Stalled)
