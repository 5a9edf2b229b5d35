"""The consumer's side of the direct KV transfer: pull a request's chunks into the pool.

One connection, one ``fetch`` of all keys: the producer streams the chunks back to back
(every chunk is in flight at once, no round trip per chunk), and each payload is received
straight into a freshly allocated pool slot of the consumer's engine. A chunk enters the
pool only after its header names the expected key, layout and tokens and its payload's
checksum matches; the first chunk that fails ends the pull (a later chunk without it can
never be a prefix hit). Every wait is bounded by ``timeout_s`` overall, so a dead or hung
producer costs at most that long, and :func:`pull` never raises for transfer trouble: the
result says what went wrong (``reason``) and the caller falls back.

With a fleet key the connection first passes the handshake of :mod:`kvmesh.transport.auth`
(the producer proves the key before anything is sent to it), within ``connect_timeout_s``:
a listener that accepts and stays silent costs that long, not ``timeout_s``. Every chunk
must then carry a valid MAC over its header and payload.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvmesh.core import serde
from kvmesh.core.engine import CacheEngine
from kvmesh.core.fleetkey import TRANSFER_AUTH, FleetKey
from kvmesh.core.keys import ChunkKey
from kvmesh.errors import CorruptChunkError, PeerAuthError
from kvmesh.transport.auth import ChunkMacCheck, client_handshake
from kvmesh.transport.wire import (
    SOCKET_BUFFER,
    Stalled,
    WireError,
    recv_exact,
    recv_into_exact,
    recv_msg,
    send_msg,
)

MAX_HEADER = 1 << 20
MAC_PIECE = 1 << 20  # bytes received, then hashed while in cache, at a time
CONFIRM_S = 1.0  # a confirm's own budget, past the pull's (it only unpins: the KV is here)
MAX_RESUMES = 2  # fresh connections a stalled fetch resumes on
MIN_LEFT_S = 0.05  # of the pull's budget, for a resume to be worth a handshake

# Why a pull ended short (PullResult.reason), the labels of kvmesh_pd_fallbacks_total.
UNREACHABLE = "producer_unreachable"  # connect refused / failed: the producer is gone
TIMEOUT = "timeout"  # connected, but the transfer did not finish in time
DISCONNECTED = "disconnected"  # the producer dropped the connection mid-transfer
CORRUPT = "corrupt_chunk"  # a header or payload failed verification
MISSING = "missing_chunks"  # the producer no longer holds a chunk (evicted / pins expired)
POOL_FULL = "pool_full"  # no pool slot free here within the store wait
AUTH_FAILED = "auth_failed"  # the producer did not prove the fleet key, or refused ours


@dataclass
class PullResult:
    tokens: int = 0  # leading tokens whose chunks are now in the pool (pulled or already there)
    chunks: int = 0  # chunks received
    nbytes: int = 0
    seconds: float = 0.0
    reason: str | None = None  # None: every requested chunk arrived
    detail: str = ""
    confirmed: bool | None = None  # the producer acknowledged the confirm (None: none sent)
    resumes: int = 0  # fresh connections the fetch resumed on after a stream stalled
    stalled: bool = False  # the last connection delivered nothing for the allowed silence
    waiting: str = ""  # what the pull was waiting for when it ended short: "chunk 3's payload"


def pull(
    engine: CacheEngine,
    host: str,
    port: int,
    req: str,
    keys: Sequence[ChunkKey],
    tokens: np.ndarray,
    timeout_s: float = 5.0,
    connect_timeout_s: float = 1.0,
    confirm_after: bool = True,
    first: int = 0,
    *,
    key: FleetKey | None = None,
) -> PullResult:
    """Pull ``keys`` (the chunks of ``tokens`` from chunk index ``first`` on, in order:
    the ones before are already here), held by the producer at ``host:port`` under the
    transfer id ``req``, into ``engine``'s pool, then (``confirm_after``) confirm ``req``
    there so the producer unpins it, whatever the outcome. ``key``: the fleet key both
    sides must hold (``None``: an unauthenticated producer, ``pd_allow_insecure``).

    ``connect_timeout_s`` bounds the handshake. Mid-stream, a connection that delivers
    nothing at all for :func:`stall_budget` is given up and the fetch resumes from the
    next chunk on a fresh one (up to :data:`MAX_RESUMES` times, within ``timeout_s``): a
    stream stuck in one connection costs that long, not the whole pull."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    res = PullResult()
    if first:
        res.tokens = engine.keys.chunk_bounds(len(tokens))[first - 1][1]
    stall_s = stall_budget(timeout_s, connect_timeout_s)
    while True:
        sock = _open(host, port, key, min(connect_timeout_s, deadline - time.monotonic()), deadline, res)
        if sock is None:
            res.seconds = time.monotonic() - t0
            return res
        got = res.chunks
        healthy = fetch_over(sock, engine, req, keys[got:], tokens, deadline, res, first + got, key, stall_s)
        if not res.stalled or res.resumes >= MAX_RESUMES or deadline - time.monotonic() < MIN_LEFT_S:
            break
        sock.close()  # the producer's send to it fails and its handler ends
        res.resumes += 1
        res.reason, res.detail, res.stalled = None, "", False
    try:
        if not healthy and res.chunks == len(keys) and res.reason in (DISCONNECTED, TIMEOUT):
            # Every chunk arrived and verified; only the stream's end marker did not: the
            # pull is whole (the confirm goes over a fresh connection below).
            res.reason, res.detail = None, ""
        if confirm_after and healthy:
            res.confirmed = _confirm_over(sock, req, max(deadline, time.monotonic()) + CONFIRM_S)
    finally:
        sock.close()
    if confirm_after and res.confirmed is None and res.reason in (None, CORRUPT, POOL_FULL, MISSING):
        # The connection is unusable (abandoned mid-stream, or it broke after the last chunk)
        # and the producer is alive: unpin over a fresh one. A confirm that never lands costs
        # the producer its pins until pd_pin_timeout_s, nothing here.
        res.confirmed = confirm(host, port, req, timeout_s=CONFIRM_S, key=key)
    res.seconds = time.monotonic() - t0
    return res


def stall_budget(timeout_s: float, connect_timeout_s: float) -> float:
    """How long a transfer's stream may deliver nothing before the fetch resumes on a fresh
    connection: the handshake's budget, and at least a third of the pull's (a fetch queued
    behind a busy producer's other streams is not taken for a stalled one)."""
    return max(0.01, connect_timeout_s, timeout_s / (MAX_RESUMES + 1))


def _after_resumes(res: PullResult) -> str:
    """What a detail adds once the fetch has resumed (nothing before)."""
    return f" (after {res.resumes} resumes on fresh connections)" if res.resumes else ""


def _open(
    host: str, port: int, key: FleetKey | None, connect_timeout_s: float, deadline: float, res: PullResult
) -> socket.socket | None:
    """:func:`open_connection`, or ``None`` with ``res`` saying why not."""
    try:
        return open_connection(host, port, key, connect_timeout_s, deadline)
    except OSError as exc:
        res.reason = TIMEOUT if isinstance(exc, TimeoutError) else UNREACHABLE
        res.reason = AUTH_FAILED if isinstance(exc, PeerAuthError) else res.reason
        res.detail = f"{host}:{port}: {exc}{_after_resumes(res)}"
        return None


def _confirm_over(sock: socket.socket, req: str, deadline: float) -> bool:
    try:
        return _ask(sock, {"op": "confirm", "req": req}, deadline)
    except (WireError, OSError):
        return False


def _ask(sock: socket.socket, msg: dict[str, object], deadline: float) -> bool:
    """Send ``msg`` over ``sock``; whether the reply, by ``deadline``, is ``ok``."""
    _set_deadline(sock, deadline)
    send_msg(sock, msg)
    return recv_msg(sock, deadline=deadline).get("t") == "ok"


def open_connection(
    host: str, port: int, key: FleetKey | None, connect_timeout_s: float, deadline: float | None = None
) -> socket.socket:
    """A connection to the transfer server at ``host:port``, authenticated with ``key``
    (when given) within ``connect_timeout_s`` of the call. Raises ``OSError`` (a
    :class:`PeerAuthError` when the server cannot prove the key)."""
    t0 = time.monotonic()
    budget = max(0.01, connect_timeout_s)
    sock = connect((host, port), timeout=budget)
    connected = time.monotonic() - t0
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if key is not None:
            handshake_by = t0 + budget if deadline is None else min(t0 + budget, deadline)
            try:
                client_handshake(sock, key, TRANSFER_AUTH, handshake_by)
            except TimeoutError:
                raise TimeoutError(
                    f"connected in {connected:.3f} s, then no proof of the fleet key within "
                    f"{budget:.1f} s of the call"
                ) from None
    except BaseException:
        sock.close()
        raise
    return sock


def connect(address: tuple[str, int], timeout: float) -> socket.socket:
    """A connection with a large receive buffer, set before connecting so the window
    scales: a chunk's megabytes arrive in few reads."""
    err: OSError | None = None
    for family, kind, proto, _, addr in socket.getaddrinfo(*address, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
            sock.settimeout(timeout)
            sock.connect(addr)
            return sock
        except OSError as exc:
            sock.close()
            err = exc
    raise err or OSError(f"cannot resolve {address[0]}")


def _set_deadline(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("transfer deadline passed")
    sock.settimeout(left)


def fetch_over(
    sock: socket.socket,
    engine: CacheEngine,
    req: str,
    keys: Sequence[ChunkKey],
    tokens: np.ndarray,
    deadline: float,
    res: PullResult,
    first: int = 0,
    key: FleetKey | None = None,
    stall_s: float | None = None,
) -> bool:
    """One fetch over an open (authenticated) connection, into ``res``; never raises for
    what the producer sends. ``True``: the stream ended cleanly (the connection can carry
    the confirm). ``stall_s``: the longest the producer may send nothing at all (then
    ``res.stalled``)."""
    t0 = time.monotonic()
    before = res.chunks  # received on connections before this one
    try:
        return _receive(engine, sock, req, keys, tokens, deadline, res, first, key, stall_s)
    except TimeoutError as exc:
        why = str(exc) or "no reply before the deadline"
        res.reason, res.stalled = TIMEOUT, isinstance(exc, Stalled)
        res.detail = (
            f"{res.chunks} of {before + len(keys)} chunks in {time.monotonic() - t0:.1f} s, then "
            f"{why} waiting for chunk {first + res.chunks - before}'s {res.waiting}{_after_resumes(res)}"
        )
    except CorruptChunkError as exc:
        res.reason, res.detail = CORRUPT, str(exc)
    except (WireError, OSError) as exc:
        res.reason, res.detail = DISCONNECTED, str(exc)
    return False


def _receive(
    engine: CacheEngine,
    sock: socket.socket,
    req: str,
    keys: Sequence[ChunkKey],
    tokens: np.ndarray,
    deadline: float,
    res: PullResult,
    first: int,
    key: FleetKey | None,
    stall_s: float | None = None,
) -> bool:
    """Receive the fetch's stream. ``True``: the stream ended cleanly (the connection can
    carry the confirm); the result's ``reason`` may still say a chunk was missing."""
    bounds = engine.keys.chunk_bounds(len(tokens))[first:]
    want = tokens.astype("<u4")
    _set_deadline(sock, deadline)
    send_msg(sock, {"op": "fetch", "req": req, "first": first, "count": len(keys)})
    expect = 0
    while True:
        res.waiting = "control message"
        msg = recv_msg(sock, deadline=deadline, stall_s=stall_s)
        kind = msg.get("t")
        if kind == "end":
            if expect < len(keys) and res.reason is None:
                res.reason = MISSING
            return True
        if kind == "missing":
            res.reason, res.detail = MISSING, f"producer lacks chunk {msg.get('i')} of {first + len(keys)}"
            continue  # the end message follows
        if kind == "error":
            raise WireError(f"the producer refused the fetch: {str(msg.get('error'))[:200]}")
        if kind != "chunk" or msg.get("i") != first + expect or expect >= len(keys):
            raise WireError(f"unexpected message {msg!r} (expected chunk {expect})")
        hlen, plen = msg.get("hlen"), msg.get("plen")
        if not isinstance(hlen, int) or not isinstance(plen, int) or not 0 < hlen <= MAX_HEADER or plen < 0:
            raise WireError(f"bad chunk lengths hlen={hlen} plen={plen}")
        ck, (s, e) = keys[expect], bounds[expect]
        res.waiting = "header"
        raw_header = recv_exact(sock, hlen, deadline, stall_s)
        header = serde.decode_header(raw_header)
        if header.key != ck.text:  # held under this id, but not ours (another model, shard, salt)
            res.reason, res.detail = MISSING, f"producer holds {header.key} where {ck} was asked for"
            return False
        if header.layout != engine.layout or header.codec != "raw":
            raise CorruptChunkError(
                f"chunk {ck} has layout {header.layout} codec {header.codec}; expected {engine.layout} raw"
            )
        if plen != header.payload_len or plen != (e - s) * engine.layout.bytes_per_token:
            need = (e - s) * engine.layout.bytes_per_token
            raise CorruptChunkError(f"chunk {ck} carries {plen} bytes, expected {need}")
        if not np.array_equal(header.tokens, want[s:e]):
            raise CorruptChunkError(f"chunk {ck} holds other tokens than the prompt's {s}..{e}")
        tag = msg.get("mac")
        if key is not None and not isinstance(tag, bytes):
            raise CorruptChunkError(f"chunk {ck} came without the MAC a producer holding the fleet key sends")
        obj = engine.cpu.allocate(plen, engine.config.store_wait_s)
        if obj is None:
            res.reason, res.detail = POOL_FULL, f"no free pool slot for chunk {expect}"
            return False
        res.waiting = "payload"
        try:
            # With a key the MAC covers the header (checksum included) and the payload, so it
            # alone decides; without one the unkeyed checksum catches accidents only.
            if key is not None:
                check = ChunkMacCheck(key, TRANSFER_AUTH, tag, raw_header, plen)
                view = obj.raw()
                for off in range(0, plen, MAC_PIECE):
                    piece = view[off : off + MAC_PIECE]
                    recv_into_exact(sock, piece, deadline, stall_s)
                    check.update(piece)
                if not check.ok():
                    raise CorruptChunkError(f"chunk {ck}: MAC mismatch (altered in transit, or another key)")
            else:
                recv_into_exact(sock, obj.raw(), deadline, stall_s)
                if xxhash.xxh3_128_hexdigest(obj.raw()) != header.payload_checksum:
                    raise CorruptChunkError(f"chunk {ck}: payload checksum mismatch")
        except BaseException:
            obj.release()
            raise
        obj.layout = engine.layout
        obj.tokens = tokens[s:e].copy()
        engine.cpu.put(ck, obj)  # a duplicate (already held) is dropped, the resident kept
        res.chunks += 1
        res.nbytes += plen
        res.tokens = e
        expect += 1


def confirm(host: str, port: int, req: str, timeout_s: float = 1.0, *, key: FleetKey | None = None) -> bool:
    """Tell the producer the consumer is done with ``req`` (it unpins). Best effort."""
    return _call(host, port, {"op": "confirm", "req": req}, timeout_s, key)


def ping(host: str, port: int, timeout_s: float = 1.0, *, key: FleetKey | None = None) -> bool:
    """Whether a transfer server answers (and, with ``key``, proves the key) at ``host:port``."""
    return _call(host, port, {"op": "ping"}, timeout_s, key)


def _call(host: str, port: int, msg: dict[str, object], timeout_s: float, key: FleetKey | None) -> bool:
    deadline = time.monotonic() + timeout_s
    try:
        with open_connection(host, port, key, timeout_s, deadline) as sock:
            return _ask(sock, msg, deadline)
    except (OSError, WireError):
        return False
