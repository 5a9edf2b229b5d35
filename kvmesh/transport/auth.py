"""Mutual challenge-response over the fleet key, for kvmesh's listeners (the PD transfer
server, the TP lookup RPC over TCP), and the MAC that binds a transferred chunk to the key.

Each side proves it holds the fleet key over a fresh nonce of the other side, so neither a
client nor a server can be impersonated by someone without the key, and a recorded exchange
replays nowhere (the other side's nonce is new every time)::

    client -> server  {"op": "hello", "v": 1, "nonce": Nc}                       32 random bytes
    server -> client  {"t": "challenge", "v": 1, "nonce": Ns, "mac": M("server", Nc, Ns)}
    client -> server  {"op": "auth", "mac": M("client", Nc, Ns)}

``M`` is :meth:`FleetKey.mac <kvmesh.core.fleetkey.FleetKey.mac>` under the protocol's
purpose (``TRANSFER_AUTH`` or ``RPC_AUTH``: a transfer tag never opens the RPC), with the
role as the first part, so a server's proof is never a valid client proof (no reflection).
The client checks the server's proof before it sends its own or anything else, and may send
its first request right behind its ``auth``; the server reads that request only once the
proof verified. A failed proof is answered ``{"t": "error", "error": "authentication
failed"}`` and the connection is closed.

The handshake authenticates the peers, not the stream after it: a chunk's bytes could still
be altered on the path, so with a key every chunk carries :func:`chunk_mac`, a tag over its
header and payload computed by the producer when it pins the request, which the consumer
checks before the chunk enters its pool. Control messages are not tagged: altering one can
only make a transfer fail (a recompute), never deliver other KV.
"""

from __future__ import annotations

import hmac
import os
import socket
from typing import Any

from kvmesh.core.fleetkey import KEY_ID_BYTES, TAG_BYTES, Bytes, FleetKey
from kvmesh.errors import PeerAuthError, WireError
from kvmesh.transport.wire import MAX_CONTROL, recv_msg, send_msg

VERSION = 1
NONCE_BYTES = 32
AUTH_FAILED = "authentication failed"


def _nonce(msg: dict[str, Any]) -> bytes | None:
    n = msg.get("nonce")
    return n if isinstance(n, bytes) and len(n) == NONCE_BYTES else None


def _tag(msg: dict[str, Any]) -> bytes | None:
    t = msg.get("mac")
    return t if isinstance(t, bytes) and len(t) == TAG_BYTES else None


def client_handshake(sock: socket.socket, key: FleetKey, purpose: str, deadline: float) -> None:
    """Prove the key to the server at the other end of ``sock`` and check its proof; raises
    :class:`PeerAuthError` if the server cannot prove it, :class:`WireError` /
    ``TimeoutError`` / ``OSError`` if the exchange breaks off."""
    nc = os.urandom(NONCE_BYTES)
    send_msg(sock, {"op": "hello", "v": VERSION, "nonce": nc})
    msg = recv_msg(sock, MAX_CONTROL, deadline)
    if msg.get("t") == "error":
        raise PeerAuthError(f"the server refused the handshake: {str(msg.get('error'))[:200]}")
    ns, tag = _nonce(msg), _tag(msg)
    if msg.get("t") != "challenge" or msg.get("v") != VERSION or ns is None:
        raise WireError(f"expected a version-{VERSION} challenge, got {str(msg)[:200]}")
    if tag is None or not key.verify(purpose, tag, b"server", nc, ns):
        raise PeerAuthError("the server did not prove it holds the fleet key")
    send_msg(sock, {"op": "auth", "mac": key.mac(purpose, b"client", nc, ns)})


class ServerAuth:
    """One connection's side of the handshake, for a non-blocking server: answer the
    ``hello`` with :meth:`challenge`, then :meth:`verify` the ``auth``."""

    def __init__(self, key: FleetKey, purpose: str) -> None:
        self.key = key
        self.purpose = purpose
        self._nonces: tuple[bytes, bytes] | None = None

    def challenge(self, hello: dict[str, Any]) -> dict[str, Any]:
        """The reply to the client's first message; raises :class:`WireError` if it is not a
        ``hello`` of this version."""
        nc = _nonce(hello)
        if hello.get("op") != "hello" or hello.get("v") != VERSION or nc is None:
            raise WireError("authentication required: the first message must be a version-1 hello")
        ns = os.urandom(NONCE_BYTES)
        self._nonces = (nc, ns)
        proof = self.key.mac(self.purpose, b"server", nc, ns)
        return {"t": "challenge", "v": VERSION, "nonce": ns, "mac": proof}

    def verify(self, auth: dict[str, Any]) -> bool:
        tag = _tag(auth)
        if self._nonces is None or auth.get("op") != "auth" or tag is None:
            return False
        return self.key.verify(self.purpose, tag, b"client", *self._nonces)


def chunk_mac(key: FleetKey, purpose: str, header: Bytes, payload: Bytes) -> bytes:
    """The tag a producer sends with a chunk (see the module docstring)."""
    return key.mac(purpose, b"chunk", header, payload)


def chunk_ok(key: FleetKey, purpose: str, tag: object, header: Bytes, payload: Bytes) -> bool:
    return isinstance(tag, bytes) and key.verify(purpose, tag, b"chunk", header, payload)


class ChunkMacCheck:
    """:func:`chunk_ok` over a payload fed piece by piece as it arrives, so each piece is
    hashed while still in the CPU's cache (about a fifth less time per pull than hashing
    the whole slot afterwards). The framing is :meth:`FleetKey.mac`'s: every part preceded
    by its length (8 bytes, little-endian); a unit test holds the two equal."""

    def __init__(self, key: FleetKey, purpose: str, tag: object, header: Bytes, payload_len: int) -> None:
        self._tag = tag if isinstance(tag, bytes) and len(tag) == TAG_BYTES else None
        self._h = key.hasher(purpose, self._tag[:KEY_ID_BYTES]) if self._tag is not None else None
        if self._h is not None:
            for part in (b"chunk", header):
                mv = memoryview(part).cast("B")
                self._h.update(mv.nbytes.to_bytes(8, "little"))
                self._h.update(mv)
            self._h.update(payload_len.to_bytes(8, "little"))

    def update(self, piece: Bytes) -> None:
        if self._h is not None:
            self._h.update(piece)

    def ok(self) -> bool:
        if self._h is None or self._tag is None:
            return False
        return hmac.compare_digest(self._h.digest(), self._tag[KEY_ID_BYTES:])
