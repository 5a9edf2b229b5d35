"""A raw RESP pipeline over a socket: the Redis tier's limit, what the server and the socket
move when the client costs next to nothing.

The commands are encoded before the clock starts; timed is only sending them in one write
and receiving the replies into a preallocated buffer. Nothing is parsed: the replies of
``SET`` and ``GET`` on known keys and values are known in advance, so the client reads
exactly that many bytes and compares them with what they must be (after the clock stops;
a difference raises). redis-py, the client the tier uses, would measure the tier's own
client, not a limit; ``redis-benchmark`` was slower than redis-py at ``SET`` of 1 MiB values
here, so it is no limit either.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from urllib.parse import unquote, urlsplit

from kvmesh.errors import ConfigError, ProcessError


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def encode(*args: bytes) -> bytes:
    """One command as a RESP array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)


class RawPipeline:
    """One connection to the server of a ``redis://`` or ``unix://`` URL (``AUTH`` and
    ``SELECT`` from the URL sent on connect)."""

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        u = urlsplit(url)
        if u.scheme == "unix":
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout_s)
            self.sock.connect(u.path)
        elif u.scheme == "redis":
            self.sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), timeout_s)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            raise ConfigError(f"a raw RESP pipeline takes a redis:// or unix:// URL, got {u.scheme}://")
        if u.password:
            user = [unquote(u.username).encode()] if u.username else []
            self._expect(encode(b"AUTH", *user, unquote(u.password).encode()), b"+OK\r\n")
        db = u.path.strip("/") if u.scheme == "redis" else ""
        if db:
            self._expect(encode(b"SELECT", db.encode()), b"+OK\r\n")

    def _expect(self, request: bytes, reply: bytes) -> None:
        got = self.exchange(request, len(reply))[1]
        if got != reply:
            raise ProcessError(f"redis answered {bytes(got[:200])!r}, expected {reply!r}")

    def exchange(self, request: bytes, reply_bytes: int) -> tuple[float, memoryview]:
        """Send ``request`` in one write and read exactly ``reply_bytes`` back: the seconds
        that took and the bytes read."""
        buf = bytearray(reply_bytes)
        view = memoryview(buf)
        t0 = time.perf_counter()
        got = 0
        try:
            self.sock.sendall(request)
            while got < reply_bytes:
                n = self.sock.recv_into(view[got:])
                if not n:
                    raise ProcessError(
                        f"redis closed the connection after {got} of {reply_bytes} reply bytes"
                    )
                got += n
        except TimeoutError as exc:  # a shorter reply than expected (an error, a miss) ends here
            raise ProcessError(
                f"redis sent {got} of the {reply_bytes} reply bytes expected: {bytes(view[:got][:200])!r}"
            ) from exc
        return time.perf_counter() - t0, view

    def timed(self, request: bytes, reply: bytes) -> float:
        """:meth:`exchange` of ``request``, checked against the ``reply`` it must get back."""
        seconds, got = self.exchange(request, len(reply))
        if got != reply:
            raise ProcessError("redis's replies differ from the expected ones (an error reply?)")
        return seconds

    def close(self) -> None:
        self.sock.close()


def set_get(names: Sequence[bytes], values: Sequence[bytes]) -> tuple[bytes, bytes, bytes, bytes]:
    """The pipelines of ``SET name value`` and ``GET name`` for every pair, and the replies
    each must get: ``(set request, set replies, get request, get replies)``."""
    sets = b"".join(encode(b"SET", n, v) for n, v in zip(names, values, strict=True))
    gets = b"".join(encode(b"GET", n) for n in names)
    return sets, b"+OK\r\n" * len(names), gets, b"".join(_bulk(v) for v in values)
