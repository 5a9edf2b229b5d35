"""A bounded stdlib HTTP server for the admin API (it runs inside vLLM's worker process).

``ThreadingHTTPServer`` alone has no socket timeout and starts a thread per connection
without limit: a client that opens connections and sends nothing (or one header byte a
second, "slowloris") holds a thread each, forever. :class:`BoundedHTTPServer` adds:

* at most ``max_connections`` connections at once; when full, a new connection closes the
  one that has waited longest for its request head (a slow client, never one being served)
  and takes its place, or is closed itself when every connection is being served;
* a deadline for the request line and headers (``head_timeout_s``, from the connection's
  start or its previous response: time to first byte and idle keep-alive both count), and
  at most ``max_head_bytes`` of them (431 beyond);
* a deadline for the body (``body_timeout_s``), read only after the handler has checked
  the token and the declared size (``max_body_bytes``).

A deadline is the whole phase's, not a per-``recv`` timeout, so dripping bytes does not
extend it. Past it the connection is closed.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    max_connections: int = 32
    head_timeout_s: float = 2.0
    body_timeout_s: float = 10.0
    write_timeout_s: float = 10.0
    max_head_bytes: int = 16 << 10
    max_body_bytes: int = 16 << 20  # a 1M-token lookup is ~8 MiB of JSON


class DeadlineReader:
    """``rfile`` with a deadline per phase and a byte budget for the request head."""

    def __init__(self, raw: BinaryIO, sock: socket.socket, limits: Limits) -> None:
        self._raw = raw
        self._sock = sock
        self._limits = limits
        self._deadline = 0.0
        self._head_left: int | None = None  # None: not reading a head

    def begin_head(self) -> None:
        self._deadline = time.monotonic() + self._limits.head_timeout_s
        self._head_left = self._limits.max_head_bytes

    def begin_body(self) -> None:
        self._deadline = time.monotonic() + self._limits.body_timeout_s
        self._head_left = None

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the client was too slow")
        self._sock.settimeout(left)

    def readline(self, limit: int = -1) -> bytes:
        budget = self._head_left
        cap = limit if limit >= 0 else 1 << 30
        if budget is not None:
            cap = min(cap, budget + 1)
        # Byte by buffered chunk, not the buffered reader's readline: that one loops over
        # recv inside, and each recv would get the whole timeout again (dripping wins).
        line = bytearray()
        while len(line) < cap:
            self._arm()
            ahead = self._raw.peek(1)  # type: ignore[attr-defined]  # at most one recv
            if not ahead:
                break
            nl = ahead.find(b"\n")
            take = min(len(ahead) if nl < 0 else nl + 1, cap - len(line))
            line += self._raw.read(take)  # already buffered: does not block
            if nl >= 0 and nl < take:
                break
        if budget is not None:
            if len(line) > budget:
                raise http.client.LineTooLong(f"request head over {self._limits.max_head_bytes} bytes")
            self._head_left = budget - len(line)
        return bytes(line)

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            raise ValueError("the admin server reads bodies of a declared length only")
        parts: list[bytes] = []
        while n > 0:
            self._arm()
            # read1: one recv at most, so the deadline is checked between chunks
            chunk = self._raw.read1(min(n, 1 << 16))  # type: ignore[attr-defined]
            if not chunk:
                break
            parts.append(chunk)
            n -= len(chunk)
        return b"".join(parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class BoundedHandler(BaseHTTPRequestHandler):
    """Base handler: reads through a :class:`DeadlineReader`; see the module docstring."""

    server: BoundedHTTPServer
    rfile: DeadlineReader  # type: ignore[assignment]

    def setup(self) -> None:
        super().setup()
        self.rfile = DeadlineReader(self.rfile, self.connection, self.server.limits)  # type: ignore[arg-type]

    def handle_one_request(self) -> None:
        self.server.waiting(self.connection, True)
        self.rfile.begin_head()
        try:
            super().handle_one_request()
        except http.client.LineTooLong:
            # The request line itself blew the budget (parse_request answers for headers).
            self.requestline, self.request_version, self.command = "", "HTTP/1.1", ""
            self.close_connection = True
            self.send_error(431, "request head too large")
        finally:
            self.server.waiting(self.connection, False)

    def parse_request(self) -> bool:
        ok = super().parse_request()
        # The head is in: from here the connection is being served, not waiting.
        self.server.waiting(self.connection, False)
        self.connection.settimeout(self.server.limits.write_timeout_s)
        return ok

    def read_body(self, length: int) -> bytes:
        self.rfile.begin_body()
        try:
            return self.rfile.read(length)
        finally:
            self.connection.settimeout(self.server.limits.write_timeout_s)


class BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BoundedHandler], limits: Limits) -> None:
        self.limits = limits
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self._lock = threading.Lock()
        self._waiting: dict[socket.socket, float] = {}  # connections still sending a request head
        self.refused = 0  # connections closed because every slot was busy serving
        # shutdown() wakes the serving loop through this pair, so a stop takes no poll
        # interval (socketserver's loop looks at its stop flag every 0.5 s)
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._served = threading.Event()
        self._served.set()  # not serving yet: a shutdown has nothing to wait for
        super().__init__(address, handler)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """socketserver's loop (handle what is ready, then ``service_actions``), also woken
        by :meth:`shutdown`."""
        self._served.clear()
        try:
            with selectors.DefaultSelector() as sel:
                if self._stopping:
                    return
                sel.register(self, selectors.EVENT_READ)
                sel.register(self._wake_r, selectors.EVENT_READ)
                while not self._stopping:
                    for key, _ in sel.select(poll_interval):
                        if key.fileobj is self and not self._stopping:
                            # socketserver's own step of its loop (not in its typeshed stub)
                            self._handle_request_noblock()  # type: ignore[attr-defined]
                    self.service_actions()
        finally:
            self._served.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait until it has returned (at once: no poll)."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._served.wait()

    def server_close(self) -> None:
        super().server_close()
        self._wake_r.close()
        self._wake_w.close()

    def waiting(self, conn: socket.socket, on: bool) -> None:
        with self._lock:
            if on:
                self._waiting[conn] = time.monotonic()
            else:
                self._waiting.pop(conn, None)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._drop_slowest()
            if not self._slots.acquire(timeout=0.5):
                self.refused += 1
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.waiting(request, False)
            self._slots.release()

    def _drop_slowest(self) -> None:
        """Close the connection that has waited longest for its request head."""
        with self._lock:
            if not self._waiting:
                return
            conn = min(self._waiting, key=self._waiting.__getitem__)
            del self._waiting[conn]
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)  # its thread's read ends; the thread frees the slot

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that vanished or was dropped mid-request is routine here, not a traceback.
        log.debug("kvmesh admin: connection from %s ended with an error", client_address, exc_info=True)
