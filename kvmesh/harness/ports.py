"""Loopback ports for the processes the harness starts (the product itself binds what its
configuration names, or port 0, and never needs to guess a free one)."""

from __future__ import annotations

import collections
import socket
import time

_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=256)


def free_port() -> int:
    """A loopback port nothing listens on now, and not one this process handed out recently:
    services are often given several ports before any of them binds, and the kernel may offer
    a port again until someone binds it (two LMCache servers once got each other's ports)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            break
    _HANDED_OUT.append(port)
    return port


def wait_for_port(port: int, timeout: float = 10.0, host: str = "127.0.0.1") -> None:
    """Until something accepts TCP connections on ``host:port``; TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing answered on {host}:{port} within {timeout:.0f} s")
