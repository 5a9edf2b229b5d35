"""The producer's side of the direct KV transfer: serves chunks of its engine's cpu pool.

Runs in the vLLM worker process (the owner of the :class:`~kvmesh.CacheEngine`), one
thread per connection. A chunk is sent from its pool slot as it is (kvmesh's chunk header,
then the slot's bytes: no copy on this side); the header carries the payload's checksum,
so the consumer verifies what arrives. ``confirm`` releases the request's pins
(:class:`~kvmesh.transport.pins.PinLedger`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvmesh.core import serde
from kvmesh.core.engine import CacheEngine
from kvmesh.core.keys import ChunkKey
from kvmesh.errors import ConfigError
from kvmesh.transport.pins import PinLedger
from kvmesh.transport.wire import SOCKET_BUFFER, WireError, frame, recv_msg, send_msg, send_parts

log = logging.getLogger(__name__)

VLLM_DEFAULT_KV_PORT = 14579
IDLE_TIMEOUT_S = 300.0  # a connection silent this long is dropped (its thread ends)


class TransferServer:
    """Serves ``engine``'s chunks on ``host:port`` (0: a free port; see :attr:`port`).

    ``fallback_port``: when ``port`` is taken, listen on a free port instead of failing;
    the address goes to consumers in ``kv_transfer_params``, so any port works."""

    def __init__(
        self,
        engine: CacheEngine,
        pins: PinLedger,
        host: str = "127.0.0.1",
        port: int = 0,
        fallback_port: bool = True,
    ) -> None:
        self.engine = engine
        self.pins = pins
        self.host = host
        self._want_port = port
        self._fallback = fallback_port
        self.port = 0
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self.counters: Counter[str] = Counter()
        # Chunk headers (with the payload checksum) computed when a request is pinned, so a
        # fetch only sends: key text -> (header, holds referring to it). A pinned chunk
        # stays the same pool object, so its header stays true until the last hold ends.
        self._heads: dict[str, tuple[bytes, int]] = {}
        pins.on_release.append(self._forget)

    def start(self) -> TransferServer:
        try:
            listener = self._bind(self._want_port)
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
            listener = self._bind(0)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        threading.Thread(target=self._accept_loop, name="kvmesh-pd-server", daemon=True).start()
        return self

    def _bind(self, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.host, port))
            listener.listen(64)
        except OSError:
            listener.close()
            raise
        return listener

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            conn.settimeout(IDLE_TIMEOUT_S)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kvmesh-pd-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                msg = recv_msg(conn)
                op = msg.get("op")
                if op == "fetch":
                    self._fetch(conn, msg)
                elif op == "confirm":
                    self.pins.release(str(msg.get("req")))
                    send_msg(conn, {"t": "ok"})
                elif op == "ping":
                    send_msg(conn, {"t": "ok"})
                else:
                    send_msg(conn, {"t": "error", "error": f"unknown op {op!r}; known: confirm, fetch, ping"})
        except (OSError, WireError):
            pass  # the consumer went away or timed out: nothing to clean up but the socket
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def prepare(self, keys: Sequence[ChunkKey]) -> int:
        """Compute the headers of ``keys`` (pinned by the caller) ahead of their fetch;
        returns how many chunks are held. Called when the producer pins a request."""
        n = 0
        for key in keys:
            with self._lock:
                entry = self._heads.get(key.text)
                if entry is not None:
                    self._heads[key.text] = (entry[0], entry[1] + 1)
                    n += 1
                    continue
            obj = self.engine.cpu.get([key])[0]
            if obj is None:
                continue
            try:
                if obj.layout is None or obj.tokens is None:
                    continue
                head, _ = serde.encode(key, obj.layout, obj.tokens, obj.raw(), "raw")
            finally:
                obj.release()
            with self._lock:
                old = self._heads.get(key.text)
                self._heads[key.text] = (head, (old[1] if old else 0) + 1)
            n += 1
        return n

    def _forget(self, keys: list[ChunkKey]) -> None:
        with self._lock:
            for key in keys:
                entry = self._heads.get(key.text)
                if entry is None:
                    continue
                if entry[1] <= 1:
                    del self._heads[key.text]
                else:
                    self._heads[key.text] = (entry[0], entry[1] - 1)

    def _fetch(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        keys = msg.get("keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            send_msg(conn, {"t": "error", "error": "fetch needs 'keys': a list of chunk key strings"})
            return
        self.counters["fetches"] += 1
        cs = self.engine.config.chunk_size
        for i, text in enumerate(keys):
            try:
                key = ChunkKey.parse(text, cs)
            except ValueError:
                send_msg(conn, {"t": "missing", "i": i})
                break
            obj = self.engine.cpu.get([key])[0]  # holds a reference until released
            if obj is None or obj.layout is None or obj.tokens is None:
                if obj is not None:
                    obj.release()
                self.counters["missing"] += 1
                send_msg(conn, {"t": "missing", "i": i})
                break
            try:
                with self._lock:
                    cached = self._heads.get(key.text)
                body = obj.raw()
                if cached is not None:
                    head = cached[0]
                else:  # not prepared (pinned by hand, or its hold has ended): hash now
                    head, _ = serde.encode(key, obj.layout, obj.tokens, body, "raw")
                plen = body.nbytes
                ctrl = frame({"t": "chunk", "i": i, "hlen": len(head), "plen": plen})
                send_parts(conn, [ctrl, head, memoryview(body)])  # one syscall, the slot uncopied
                self.counters["chunks"] += 1
                self.counters["bytes"] += plen
            finally:
                obj.release()
        send_msg(conn, {"t": "end"})

    def stats(self) -> dict[str, int]:
        return {f"pd_served_{k}": int(v) for k, v in self.counters.items()}

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
