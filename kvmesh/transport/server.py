"""The producer's side of the direct KV transfer: serves held chunks of its engine's cpu pool.

Runs in the vLLM worker process (the owner of the :class:`~kvmesh.CacheEngine`) on a
bounded :class:`~kvmesh.transport.listener.Listener`: with a fleet key every connection
passes the handshake of :mod:`kvmesh.transport.auth` before its first request is read;
connections, frames and time are capped there. A fetch names a transfer id and is served
only the chunks pinned under it (:class:`~kvmesh.transport.pins.PinLedger`): nothing else
in the pool is reachable. A chunk is sent from its pool slot as it is (kvmesh's chunk
header, then the slot's bytes: no copy on this side); the header carries the payload's
checksum and, with a key, a MAC over header and payload, so the consumer verifies what
arrives. ``confirm`` releases the hold.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvmesh.core import serde
from kvmesh.core.engine import CacheEngine
from kvmesh.core.fleetkey import TRANSFER_AUTH, FleetKey
from kvmesh.core.keys import ChunkKey
from kvmesh.errors import ConfigError
from kvmesh.transport.auth import chunk_mac
from kvmesh.transport.listener import Limits, Listener
from kvmesh.transport.pins import PinLedger
from kvmesh.transport.wire import SOCKET_BUFFER, frame, send_msg, send_parts

log = logging.getLogger(__name__)

VLLM_DEFAULT_KV_PORT = 14579
# Up to 8 fetches stream at once (sends release the GIL); more consumers queue for a thread.
TRANSFER_LIMITS = Limits(workers=8)
SERVED = ("fetches", "unknown_transfers", "missing", "chunks", "bytes", "slowest_ms")


class TransferServer:
    """Serves ``engine``'s held chunks on ``host:port`` (0: a free port; see :attr:`port`).

    ``key``: the fleet key every connection must prove (``None``: no authentication, only
    for ``pd_allow_insecure``). ``fallback_port``: when ``port`` is taken, listen on a free
    port instead of failing; the address goes to consumers in ``kv_transfer_params``, so
    any port works."""

    def __init__(
        self,
        engine: CacheEngine,
        pins: PinLedger,
        host: str = "127.0.0.1",
        port: int = 0,
        fallback_port: bool = True,
        *,
        key: FleetKey | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.engine = engine
        self.pins = pins
        self.host = host
        self.key = key
        self._want_port = port
        self._fallback = fallback_port
        self.port = 0
        self.listener = Listener(
            "kvmesh-pd-server", self._handle, key, TRANSFER_AUTH, limits or TRANSFER_LIMITS
        )
        self._lock = threading.Lock()
        # Every key up front: stats() copies it while pool threads count.
        self.counters: Counter[str] = Counter(dict.fromkeys(SERVED, 0))
        # Chunk headers (with the payload checksum) and MACs computed when a request is
        # pinned, so a fetch only sends: key text -> (header, mac, holds referring to it). A
        # pinned chunk stays the same pool object, so both stay true until the last hold ends.
        self._heads: dict[str, tuple[bytes, bytes | None, int]] = {}
        pins.on_release.append(self._forget)

    def start(self) -> TransferServer:
        try:
            lst = self._bind(self._want_port)
        except OSError as exc:
            if not (self._fallback and self._want_port):
                raise ConfigError(
                    f"kvmesh transfer server cannot listen on {self.host}:{self._want_port} "
                    f"(kv_ip / kv_port): {exc}"
                ) from None
            # vLLM's kv_port defaults to 14579 on every replica: on a shared host the second
            # one lands here, which is fine (consumers learn the port from kv_transfer_params).
            log.log(
                logging.INFO if self._want_port == VLLM_DEFAULT_KV_PORT else logging.WARNING,
                "kvmesh: transfer port %s:%d is taken (%s); listening on a free port instead "
                "(consumers learn it from kv_transfer_params)",
                self.host,
                self._want_port,
                exc,
            )
            lst = self._bind(0)
        self.port = int(lst.getsockname()[1])
        self.listener.add(lst, authenticate=self.key is not None)
        self.listener.start()
        return self

    def _bind(self, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        lst = socket.socket(family, socket.SOCK_STREAM)
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            lst.bind((self.host, port))
            lst.listen(128)
        except OSError:
            lst.close()
            raise
        return lst

    def _handle(self, conn: socket.socket, msg: dict[str, Any]) -> bool:
        op = msg.get("op")
        req = msg.get("req")
        if op == "fetch" and isinstance(req, str):
            self._fetch(conn, req, msg.get("first"), msg.get("count"))
        elif op == "confirm" and isinstance(req, str):
            self.pins.release(req)
            send_msg(conn, {"t": "ok"})
        elif op == "ping":
            send_msg(conn, {"t": "ok"})
        else:
            send_msg(conn, {"t": "error", "error": "expected fetch / confirm with a string 'req', or ping"})
        return True

    def prepare(self, keys: Sequence[ChunkKey]) -> int:
        """Compute the headers (and MACs) of ``keys`` (pinned by the caller) ahead of their
        fetch; returns how many chunks are held. Called when the producer pins a request."""
        n = 0
        for key in keys:
            with self._lock:
                entry = self._heads.get(key.text)
                if entry is not None:
                    self._heads[key.text] = (entry[0], entry[1], entry[2] + 1)
                    n += 1
                    continue
            obj = self.engine.cpu.get([key])[0]
            if obj is None:
                continue
            try:
                if obj.layout is None or obj.tokens is None:
                    continue
                head, _ = serde.encode(key, obj.layout, obj.tokens, obj.raw(), "raw")
                tag = chunk_mac(self.key, TRANSFER_AUTH, head, obj.raw()) if self.key else None
            finally:
                obj.release()
            with self._lock:
                old = self._heads.get(key.text)
                self._heads[key.text] = (head, tag, (old[2] if old else 0) + 1)
            n += 1
        return n

    def _forget(self, keys: list[ChunkKey]) -> None:
        with self._lock:
            for key in keys:
                entry = self._heads.get(key.text)
                if entry is None:
                    continue
                if entry[2] <= 1:
                    del self._heads[key.text]
                else:
                    self._heads[key.text] = (entry[0], entry[1], entry[2] - 1)

    def _fetch(self, conn: socket.socket, req: str, first: object, count: object) -> None:
        t0 = time.monotonic()
        try:
            self._serve(conn, req, first, count)
        finally:
            took = int((time.monotonic() - t0) * 1000)
            if took > self.counters["slowest_ms"]:
                self.counters["slowest_ms"] = took  # the longest a fetch took to send

    def _serve(self, conn: socket.socket, req: str, first: object, count: object) -> None:
        held = self.pins.keys_of(req)
        start = first if isinstance(first, int) and first >= 0 else 0
        n = count if isinstance(count, int) and count >= 0 else 0
        self.counters["fetches"] += 1
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)  # chunks are megabytes
        if held is None:
            self.counters["unknown_transfers"] += 1
            send_msg(conn, {"t": "missing", "i": start})
            send_msg(conn, {"t": "end"})
            return
        for i in range(start, min(start + n, len(held))):
            if not self._send_chunk(conn, i, held[i]):
                self.counters["missing"] += 1
                send_msg(conn, {"t": "missing", "i": i})
                break
        else:
            if start + n > len(held):
                send_msg(conn, {"t": "missing", "i": len(held)})
        send_msg(conn, {"t": "end"})

    def _send_chunk(self, conn: socket.socket, i: int, key: ChunkKey) -> bool:
        obj = self.engine.cpu.get([key])[0]  # holds a reference until released
        if obj is None or obj.layout is None or obj.tokens is None:
            if obj is not None:
                obj.release()
            return False
        try:
            with self._lock:
                cached = self._heads.get(key.text)
            body = obj.raw()
            if cached is not None:
                head, tag = cached[0], cached[1]
            else:  # its hold was replaced meanwhile: hash now
                head, _ = serde.encode(key, obj.layout, obj.tokens, body, "raw")
                tag = chunk_mac(self.key, TRANSFER_AUTH, head, body) if self.key else None
            ctrl: dict[str, Any] = {"t": "chunk", "i": i, "hlen": len(head), "plen": body.nbytes}
            if tag is not None:
                ctrl["mac"] = tag
            send_parts(conn, [frame(ctrl), head, memoryview(body)])  # one syscall, the slot uncopied
            self.counters["chunks"] += 1
            self.counters["bytes"] += body.nbytes
        finally:
            obj.release()
        return True

    def stats(self) -> dict[str, int]:
        out = {f"pd_served_{k}": int(v) for k, v in self.counters.items()}
        out.update({f"pd_server_{k}": v for k, v in self.listener.stats().items()})
        return out

    def close(self) -> None:
        self.listener.close()
