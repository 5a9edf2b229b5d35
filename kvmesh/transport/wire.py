"""The transfer's framing: a 4-byte big-endian length, then a msgpack map (a control
message); a chunk's control message is followed by the chunk itself in kvmesh's chunk
format (:mod:`kvmesh.core.serde`: checksummed header, then the raw KV payload), so nothing
received is trusted before its checksums pass. No pickle: a peer can only send data.

Client -> server::

    {"op": "fetch", "req": <producer request id>, "keys": [<chunk key text>, ...]}
    {"op": "confirm", "req": <producer request id>}      # done with it: unpin
    {"op": "ping"}

Server -> client, for a fetch, one message per key in order, then ``{"t": "end"}``::

    {"t": "chunk", "i": <index>, "hlen": <header bytes>, "plen": <payload bytes>}  + bytes
    {"t": "missing", "i": <index>}        # not held (any later key is not sent either)

and ``{"t": "ok"}`` for confirm / ping, ``{"t": "error", "error": <text>}`` for a bad request.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec

MAX_CONTROL = 16 << 20  # a fetch of 1,000 keys is ~100 KB; anything near this is garbage
_LEN = struct.Struct(">I")
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


class WireError(ConnectionError):
    """The peer closed the connection or sent something that is not this protocol."""


def send_msg(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(frame(obj))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket (straight into the caller's buffer: a pool slot)."""
    view = view.cast("B")
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:], view.nbytes - got)
        if n == 0:
            raise WireError(f"peer closed the connection after {got} of {view.nbytes} bytes")
        got += n


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_CONTROL:
        raise WireError(f"control message of {n} bytes exceeds the {MAX_CONTROL}-byte limit")
    try:
        msg = msgspec.msgpack.decode(recv_exact(sock, n))
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable control message: {exc}") from None
    if not isinstance(msg, dict):
        raise WireError(f"a control message is a map, got {type(msg).__name__}")
    return msg
