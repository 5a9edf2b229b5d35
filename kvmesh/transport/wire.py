"""The framing of kvmesh's socket protocols (the PD transfer, the TP lookup RPC): a 4-byte
big-endian length, then a msgpack map (a control message). No pickle: a peer can only send
data. Every read is bounded before it allocates: a frame longer than the reader's ``limit``
ends the connection, and a frame's body is received in pieces as it arrives, so announcing a
large frame costs the sender the bytes, not the receiver the allocation. Blocking reads take
a ``deadline`` (a :func:`time.monotonic` instant) for the whole message, and optionally
``stall_s``: the longest the peer may send nothing at all before :class:`Stalled` (a
``TimeoutError``) is raised, so a stream that stopped is told apart from one that is slow.

The transfer protocol, after the handshake of :mod:`kvmesh.transport.auth`
(client -> server)::

    {"op": "fetch", "req": <transfer id>, "first": <chunk index>, "count": <chunks>}
    {"op": "confirm", "req": <transfer id>}      # done with it: unpin
    {"op": "ping"}

Server -> client, for a fetch, one message per chunk held under the transfer id from
``first`` on, in order, then ``{"t": "end"}``::

    {"t": "chunk", "i": <index>, "hlen": <header bytes>, "plen": <payload bytes>,
     "mac": <tag over header and payload, with a fleet key>}  + header + payload
    {"t": "missing", "i": <index>}   # not held under that id (any later chunk is not sent)

``{"t": "ok"}`` for confirm / ping, ``{"t": "error", "error": <text>}`` for a bad request.
A chunk's header and payload are kvmesh's chunk format (:mod:`kvmesh.core.serde`), so
nothing received is trusted before its checks pass.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from kvmesh.errors import WireError

__all__ = [
    "MAX_CONTROL",
    "SOCKET_BUFFER",
    "FrameReader",
    "Stalled",
    "WireError",
    "decode_body",
    "frame",
    "recv_exact",
    "recv_into_exact",
    "recv_msg",
    "send_msg",
    "send_parts",
]

# The transfer's control messages are a few dozen bytes (a fetch names a transfer id and
# two numbers, never keys); this cap is all a peer can make the other side buffer.
MAX_CONTROL = 4096
_LEN = struct.Struct(">I")
_T = TypeVar("_T")
PIECE = 1 << 16  # bytes a bounded read asks for at once
SOCKET_BUFFER = 4 << 20  # bytes; the kernel caps it at net.core.{r,w}mem_max


def frame(obj: dict[str, Any]) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return _LEN.pack(len(body)) + body


def send_parts(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """``sendall`` of several buffers with one ``sendmsg`` (no concatenation copy); a
    partial send finishes with ``sendall`` of what is left."""
    views = [memoryview(p).cast("B") for p in parts]
    sent = sock.sendmsg(views)
    for v in views:
        if sent >= v.nbytes:
            sent -= v.nbytes
            continue
        sock.sendall(v[sent:])
        sent = 0


def send_msg(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(frame(obj))


class Stalled(TimeoutError):
    """Nothing at all arrived for the read's ``stall_s``, with its deadline still ahead."""


def _wait(sock: socket.socket, deadline: float | None, stall_s: float | None = None) -> float | None:
    """Bound the next read by ``deadline`` and ``stall_s``; returns ``stall_s`` where it is
    the tighter bound (a timeout then means the peer stalled), else ``None``."""
    if deadline is None:
        if stall_s is None:
            return None
        sock.settimeout(stall_s)
        return stall_s
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the message did not arrive before its deadline")
    if stall_s is not None and stall_s < left:
        sock.settimeout(stall_s)
        return stall_s
    sock.settimeout(left)
    return None


def _read(stall: float | None, call: Callable[..., _T], *args: Any) -> _T:
    """``call(*args)``, a read bounded by :func:`_wait` (whose answer ``stall`` is)."""
    try:
        return call(*args)
    except TimeoutError:
        if stall is None:
            raise
        raise Stalled(f"nothing arrived for {stall:.1f} s") from None


def recv_into_exact(
    sock: socket.socket, view: memoryview, deadline: float | None = None, stall_s: float | None = None
) -> None:
    """Fill ``view`` from the socket (straight into the caller's buffer: a pool slot)."""
    view = view.cast("B")
    got = 0
    while got < view.nbytes:
        n = _read(_wait(sock, deadline, stall_s), sock.recv_into, view[got:], view.nbytes - got)
        if n == 0:
            raise WireError(f"peer closed the connection after {got} of {view.nbytes} bytes")
        got += n


def recv_exact(
    sock: socket.socket, n: int, deadline: float | None = None, stall_s: float | None = None
) -> bytes:
    """``n`` bytes, received in pieces: the buffer grows with what arrived, never ahead of it."""
    buf = bytearray()
    while len(buf) < n:
        part = _read(_wait(sock, deadline, stall_s), sock.recv, min(PIECE, n - len(buf)))
        if not part:
            raise WireError(f"peer closed the connection after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)


def decode_body(body: bytes | memoryview) -> dict[str, Any]:
    """A control message's map; anything else (bad msgpack, nesting bombs, not a map) is a
    :class:`WireError`."""
    try:
        msg = msgspec.msgpack.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise WireError(f"undecodable control message: {exc}") from None
    if not isinstance(msg, dict):
        raise WireError(f"a control message is a map, got {type(msg).__name__}")
    return msg


def recv_msg(
    sock: socket.socket, limit: int = MAX_CONTROL, deadline: float | None = None, stall_s: float | None = None
) -> dict[str, Any]:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline, stall_s))
    if n > limit:
        raise WireError(f"control message of {n} bytes exceeds the {limit}-byte limit")
    return decode_body(recv_exact(sock, n, deadline, stall_s))


class FrameReader:
    """Incremental parsing of frames for a non-blocking reader: :meth:`feed` what a
    ``recv`` returned, get back the complete messages. The buffer never holds more than one
    partial frame (at most ``limit`` + 4 bytes) plus one read."""

    def __init__(self, limit: int = MAX_CONTROL) -> None:
        self.limit = limit
        self._buf = bytearray()
        self.started: float | None = None  # when the partial message now buffered began

    @property
    def pending(self) -> bool:
        """Whether part of a message has arrived and the rest has not."""
        return bool(self._buf)

    def feed(self, data: bytes, now: float | None = None) -> list[dict[str, Any]]:
        """Append ``data``; the messages now complete, in order. A frame over the limit is
        a :class:`WireError` once no complete message precedes it (``feed(b"")`` after
        raising :attr:`limit` parses what waited)."""
        self._buf += data
        out: list[dict[str, Any]] = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > self.limit:
                if out:  # the messages before it may raise the limit (a proof that verified)
                    break
                raise WireError(f"control message of {n} bytes exceeds the {self.limit}-byte limit")
            end = _LEN.size + n
            if len(self._buf) < end:
                break
            out.append(decode_body(bytes(self._buf[_LEN.size : end])))
            del self._buf[:end]
            self.started = None
        if self._buf and self.started is None:
            self.started = time.monotonic() if now is None else now
        return out
