"""The consumer's side of the direct KV transfer: pull a request's chunks into the pool.

One connection, one ``fetch`` of all keys: the producer streams the chunks back to back
(every chunk is in flight at once, no round trip per chunk), and each payload is received
straight into a freshly allocated pool slot of the consumer's engine. A chunk enters the
pool only after its header names the expected key, layout and tokens and its payload's
checksum matches; the first chunk that fails ends the pull (a later chunk without it can
never be a prefix hit). Every wait is bounded by ``timeout_s`` overall, so a dead or hung
producer costs at most that long, and :func:`pull` never raises for transfer trouble: the
result says what went wrong (``reason``) and the caller falls back.
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
from kvmesh.core.keys import ChunkKey
from kvmesh.errors import CorruptChunkError
from kvmesh.transport.wire import SOCKET_BUFFER, WireError, recv_exact, recv_into_exact, recv_msg, send_msg

MAX_HEADER = 1 << 20

# Why a pull ended short (PullResult.reason), the labels of kvmesh_pd_fallbacks_total.
UNREACHABLE = "producer_unreachable"  # connect refused / failed: the producer is gone
TIMEOUT = "timeout"  # connected, but the transfer did not finish in time
DISCONNECTED = "disconnected"  # the producer dropped the connection mid-transfer
CORRUPT = "corrupt_chunk"  # a header or payload failed verification
MISSING = "missing_chunks"  # the producer no longer holds a chunk (evicted / pins expired)
POOL_FULL = "pool_full"  # no pool slot free here within the store wait


@dataclass
class PullResult:
    tokens: int = 0  # leading tokens whose chunks are now in the pool (pulled or already there)
    chunks: int = 0  # chunks received
    nbytes: int = 0
    seconds: float = 0.0
    reason: str | None = None  # None: every requested chunk arrived
    detail: str = ""


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
) -> PullResult:
    """Pull ``keys`` (the chunks of ``tokens`` from chunk index ``first`` on, in order:
    the ones before are already here) from the producer at ``host:port`` into
    ``engine``'s pool, then (``confirm_after``) confirm ``req`` there so the producer
    unpins it, whatever the outcome."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    res = PullResult()
    if first:
        res.tokens = engine.keys.chunk_bounds(len(tokens))[first - 1][1]
    try:
        sock = connect((host, port), timeout=max(0.01, min(connect_timeout_s, timeout_s)))
    except OSError as exc:
        res.reason, res.detail = UNREACHABLE, f"{host}:{port}: {exc}"
        res.seconds = time.monotonic() - t0
        return res
    healthy = False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        healthy = _receive(engine, sock, req, keys, tokens, deadline, res, first)
        if confirm_after and healthy:
            _set_deadline(sock, deadline + 1.0)  # a confirm may run a little past the pull
            send_msg(sock, {"op": "confirm", "req": req})
            recv_msg(sock)
    except TimeoutError as exc:
        res.reason, res.detail = TIMEOUT, str(exc) or f"no reply within {timeout_s} s"
    except CorruptChunkError as exc:
        res.reason, res.detail = CORRUPT, str(exc)
    except (WireError, OSError) as exc:
        res.reason, res.detail = DISCONNECTED, str(exc)
    finally:
        sock.close()
    if confirm_after and not healthy and res.reason in (CORRUPT, POOL_FULL):
        # The connection was abandoned mid-stream; the producer is alive: unpin it anyway.
        confirm(host, port, req, timeout_s=min(1.0, timeout_s))
    res.seconds = time.monotonic() - t0
    return res


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


def _receive(
    engine: CacheEngine,
    sock: socket.socket,
    req: str,
    keys: Sequence[ChunkKey],
    tokens: np.ndarray,
    deadline: float,
    res: PullResult,
    first: int,
) -> bool:
    """Receive the fetch's stream. ``True``: the stream ended cleanly (the connection can
    carry the confirm); the result's ``reason`` may still say a chunk was missing."""
    bounds = engine.keys.chunk_bounds(len(tokens))[first:]
    want = tokens.astype("<u4")
    _set_deadline(sock, deadline)
    send_msg(sock, {"op": "fetch", "req": req, "keys": [k.text for k in keys]})
    expect = 0
    while True:
        _set_deadline(sock, deadline)
        msg = recv_msg(sock)
        kind = msg.get("t")
        if kind == "end":
            if expect < len(keys) and res.reason is None:
                res.reason = MISSING
            return True
        if kind == "missing":
            res.reason, res.detail = MISSING, f"producer lacks chunk {msg.get('i')} of {len(keys)}"
            continue  # the end message follows
        if kind != "chunk" or msg.get("i") != expect or expect >= len(keys):
            raise WireError(f"unexpected message {msg!r} (expected chunk {expect})")
        hlen, plen = int(msg.get("hlen", -1)), int(msg.get("plen", -1))
        if not 0 < hlen <= MAX_HEADER or plen < 0:
            raise WireError(f"bad chunk lengths hlen={hlen} plen={plen}")
        key, (s, e) = keys[expect], bounds[expect]
        header = serde.decode_header(recv_exact(sock, hlen), expected_key=key.text)
        if header.layout != engine.layout or header.codec != "raw":
            raise CorruptChunkError(
                f"chunk {key} has layout {header.layout} codec {header.codec}; expected {engine.layout} raw"
            )
        if plen != header.payload_len or plen != (e - s) * engine.layout.bytes_per_token:
            need = (e - s) * engine.layout.bytes_per_token
            raise CorruptChunkError(f"chunk {key} carries {plen} bytes, expected {need}")
        if not np.array_equal(header.tokens, want[s:e]):
            raise CorruptChunkError(f"chunk {key} holds other tokens than the prompt's {s}..{e}")
        obj = engine.cpu.allocate(plen, engine.config.store_wait_s)
        if obj is None:
            res.reason, res.detail = POOL_FULL, f"no free pool slot for chunk {expect}"
            return False
        try:
            _set_deadline(sock, deadline)
            recv_into_exact(sock, obj.raw())
            if xxhash.xxh3_128_hexdigest(obj.raw()) != header.payload_checksum:
                raise CorruptChunkError(f"chunk {key}: payload checksum mismatch")
        except BaseException:
            obj.release()
            raise
        obj.layout = engine.layout
        obj.tokens = tokens[s:e].copy()
        engine.cpu.put(key, obj)  # a duplicate (already held) is dropped, the resident kept
        res.chunks += 1
        res.nbytes += plen
        res.tokens = e
        expect += 1


def confirm(host: str, port: int, req: str, timeout_s: float = 1.0) -> bool:
    """Tell the producer the consumer is done with ``req`` (it unpins). Best effort."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            send_msg(sock, {"op": "confirm", "req": req})
            return recv_msg(sock).get("t") == "ok"
    except (OSError, WireError):
        return False


def ping(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a transfer server answers at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            send_msg(sock, {"op": "ping"})
            return recv_msg(sock).get("t") == "ok"
    except (OSError, WireError):
        return False
