"""A bounded listener for kvmesh's framed-msgpack protocols (the PD transfer server, the TP
lookup RPC): idle, slow or hostile connections cost a socket and a few bytes, never a thread.

One selector thread owns every connection that is not running a request. It reads what
arrives, without blocking, into a :class:`~kvmesh.transport.wire.FrameReader` (frames over
``max_frame`` end the connection before anything is allocated for them), runs the
handshake of :mod:`kvmesh.transport.auth` on listeners that require it, and enforces the
deadlines: a new connection must authenticate (or, on a listener without a key, send its
first request) within ``handshake_s``; a message, once begun, must arrive whole within
``message_s``; an established connection silent for ``idle_s`` is closed. Only a complete,
authenticated request reaches a thread of the small pool (``workers``), which owns the socket
(blocking, each send bounded by ``send_timeout_s``) until the handler returns, then hands it
back. A listener whose established peers are few and latency-bound (the lookup RPC:
``dedicated=True``) gives each established connection a thread of its own instead, which
reads it blocking under the same frame cap and deadlines (one hand-off less per request:
~40 us). New connections are capped: at most ``max_fresh`` not yet proven (the oldest of those
is closed to admit a new one, so a flood of idle connections cannot lock a real peer out),
and at most ``max_connections`` in all (beyond it a new connection is closed at once).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvmesh.core import stallwatch
from kvmesh.core.fleetkey import FleetKey
from kvmesh.errors import WireError
from kvmesh.transport.auth import AUTH_FAILED, ServerAuth
from kvmesh.transport.wire import MAX_CONTROL, PIECE, FrameReader, frame

log = logging.getLogger(__name__)

# Runs one request on a pool thread with the socket in blocking mode; ``True`` keeps the
# connection for the next request.
Handler = Callable[[socket.socket, dict[str, Any]], bool]
SWEEP_S = 0.05  # how often deadlines are checked
LATE_WARN_MS = 1000  # a selector thread held up this long is logged (a new maximum only)
STALL_HINT = f" ({stallwatch.ENV}=3 logs every thread's stack when a stall that long comes)"
COUNTERS = (
    "accepted",
    "refused_cap",
    "evicted_fresh",
    "auth_failures",
    "bad_frames",
    "deadline_drops",
    "requests",
    "queue_wait_ms_max",  # the longest a complete request waited for a pool thread
    # The longest the selector thread was away past its wake-up (select's timeout, or the
    # end of a pass over ready sockets): a thread starved of the CPU or the interpreter
    # lock, which every connection's handshake then waits for.
    "loop_late_ms_max",
    "held_up",  # how many times it was held up LATE_WARN_MS or more (each one, not a new maximum)
)


@dataclass(frozen=True)
class Limits:
    max_frame: int = MAX_CONTROL  # bytes of one control message
    max_connections: int = 256  # open connections in all
    max_fresh: int = 64  # connections not yet authenticated (or, without a key, without a request)
    handshake_s: float = 2.0  # accept -> authenticated / first request
    message_s: float = 5.0  # first byte of a message -> its last
    idle_s: float = 120.0  # an established connection silent this long is closed
    workers: int = 4  # threads running requests
    send_timeout_s: float = 30.0  # a request's replies must make progress within this


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    reader: FrameReader
    auth: ServerAuth | None  # None: no handshake on this listener
    accepted: float
    phase: str = "fresh"  # fresh -> (challenged) -> ready
    last: float = 0.0  # end of the last request (ready connections)
    busy: bool = False  # a pool thread owns the socket
    closed: bool = False
    backlog: collections.deque[dict[str, Any]] = field(default_factory=collections.deque)


class Listener:
    """Serves ``handler`` on the sockets given to :meth:`add`; see the module docstring."""

    def __init__(
        self,
        name: str,
        handler: Handler,
        key: FleetKey | None,
        purpose: str,
        limits: Limits | None = None,
        dedicated: bool = False,
    ) -> None:
        self.name = name
        self.dedicated = dedicated
        self.handler = handler
        self.key = key
        self.purpose = purpose
        self.limits = limits or Limits()
        # Every key up front: stats() copies it from other threads while this one counts.
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._sel = selectors.DefaultSelector()
        self._listeners: dict[socket.socket, bool] = {}  # listening socket -> requires the handshake
        self._conns: dict[socket.socket, _Conn] = {}
        self._fresh: collections.OrderedDict[socket.socket, None] = collections.OrderedDict()
        self._returned: queue.SimpleQueue[tuple[_Conn, bool]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._pool = ThreadPoolExecutor(self.limits.workers, thread_name_prefix=f"{name}-req")
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _busy (read by close from another thread)
        self._busy: set[socket.socket] = set()
        self._usage: stallwatch.Usage | None = None  # set by the selector thread (_loop)

    def add(self, sock: socket.socket, authenticate: bool) -> None:
        """Serve connections of the bound, listening ``sock``; ``authenticate``: each must
        pass the fleet key handshake first (needs a key)."""
        if authenticate and self.key is None:
            raise ValueError("a listener that authenticates needs a fleet key")
        sock.setblocking(False)
        self._listeners[sock] = authenticate
        self._sel.register(sock, selectors.EVENT_READ, sock)

    def start(self) -> Listener:
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stats(self) -> dict[str, int]:
        return {**self.counters, "open": len(self._conns)}

    # -- the selector thread -------------------------------------------------------------
    def _loop(self) -> None:
        next_sweep = time.monotonic() + SWEEP_S
        stallwatch.started()
        # With stall dumps on: what the process and the machine had used at most USAGE_S
        # ago, so a held-up line can say what happened meanwhile.
        self._usage = stallwatch.usage() if stallwatch.enabled() else None
        try:
            while not self._closed.is_set():
                asked = time.monotonic()
                stallwatch.pet(asked)
                ready = self._sel.select(SWEEP_S)
                woke = time.monotonic()
                # Due at asked + SWEEP_S at the latest: a thread that got the CPU or the
                # interpreter lock back only after that is late, whether or not a socket
                # became ready meanwhile (a starved thread wakes to a ready one).
                self._late(woke - asked - SWEEP_S)
                if self._usage is not None and woke - self._usage.at >= stallwatch.USAGE_S:
                    self._usage = stallwatch.usage(woke)
                for skey, _ in ready:
                    if skey.data is None:
                        self._take_returned()
                    elif isinstance(skey.data, socket.socket):
                        self._accept(skey.data)
                    else:
                        self._read(skey.data)
                now = time.monotonic()
                self._late(now - woke)  # one pass over what was ready
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + SWEEP_S
        except Exception:  # never expected; the log says why the listener stopped
            log.exception("kvmesh: listener %s stopped", self.name)
        finally:
            stallwatch.stopped()
            for conn in list(self._conns.values()):
                if not conn.busy:
                    self._drop(conn, None)

    def _late(self, seconds: float) -> None:
        ms = int(seconds * 1000)
        if ms >= LATE_WARN_MS:
            self.counters["held_up"] += 1
        if ms > self.counters["loop_late_ms_max"]:
            self.counters["loop_late_ms_max"] = ms
            if ms >= LATE_WARN_MS:
                seen = ""
                if self._usage is not None:
                    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None  # Linux
                    seen = "; " + stallwatch.meanwhile(self._usage, stallwatch.usage(), cpus)
                log.warning(
                    "kvmesh: listener %s: its selector thread was held up %d ms (the process is "
                    "short of CPU, or another thread holds the interpreter lock); handshakes wait for it%s%s",
                    self.name,
                    ms,
                    seen,
                    STALL_HINT if not stallwatch.enabled() else "",
                )

    def _accept(self, lst: socket.socket) -> None:
        while True:
            try:
                sock, _ = lst.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # closed, or out of descriptors: the next readiness retries
            self.counters["accepted"] += 1
            authenticate = self._listeners.get(lst, False)
            if len(self._fresh) >= self.limits.max_fresh:
                oldest = next(iter(self._fresh))
                self.counters["evicted_fresh"] += 1
                self._drop(self._conns[oldest], None)
            if len(self._conns) >= self.limits.max_connections:
                self.counters["refused_cap"] += 1
                sock.close()
                continue
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth = ServerAuth(self.key, self.purpose) if authenticate and self.key is not None else None
            # Before its proof a peer sends handshake messages only: the small cap.
            limit = min(MAX_CONTROL, self.limits.max_frame) if auth is not None else self.limits.max_frame
            conn = _Conn(sock, FrameReader(limit), auth, time.monotonic())
            self._conns[sock] = conn
            self._fresh[sock] = None
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(PIECE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn, None)
            return
        if not data:
            self._drop(conn, None)
            return
        try:
            conn.backlog.extend(conn.reader.feed(data))
        except WireError as exc:
            self.counters["bad_frames"] += 1
            self._drop(conn, str(exc))
            return
        self._advance(conn)

    def _advance(self, conn: _Conn) -> None:
        """Work through the messages that have arrived, up to the first request."""
        while conn.backlog and not conn.busy and not conn.closed:
            msg = conn.backlog.popleft()
            if conn.phase == "fresh" and conn.auth is not None:
                try:
                    reply = conn.auth.challenge(msg)
                except WireError as exc:
                    self.counters["auth_failures"] += 1
                    self._drop(conn, str(exc))
                    return
                if not self._send_small(conn, reply):
                    return
                conn.phase = "challenged"
            elif conn.phase == "challenged":
                assert conn.auth is not None
                if not conn.auth.verify(msg):
                    self.counters["auth_failures"] += 1
                    self._drop(conn, AUTH_FAILED)
                    return
                self._established(conn)
            else:
                self._established(conn)
                if not conn.closed:
                    self._dispatch(conn, msg)

    def _established(self, conn: _Conn) -> None:
        if conn.phase != "ready":
            conn.phase = "ready"
            conn.last = time.monotonic()
            conn.reader.limit = self.limits.max_frame
            self._fresh.pop(conn.sock, None)
            try:  # a request sent right behind the proof may have waited for the higher cap
                conn.backlog.extend(conn.reader.feed(b""))
            except WireError as exc:
                self.counters["bad_frames"] += 1
                self._drop(conn, str(exc))

    def _send_small(self, conn: _Conn, msg: dict[str, Any]) -> bool:
        """A handshake reply from the selector thread: it fits any socket buffer, so a peer
        whose buffer cannot take it is not reading at all."""
        data = frame(msg)
        try:
            sent = conn.sock.send(data)
        except OSError:
            sent = -1
        if sent != len(data):
            self._drop(conn, None)
            return False
        return True

    def _dispatch(self, conn: _Conn, msg: dict[str, Any]) -> None:
        self.counters["requests"] += 1
        conn.busy = True
        self._sel.unregister(conn.sock)
        with self._lock:
            self._busy.add(conn.sock)
        if self.dedicated:
            name = f"{self.name}-conn"
            threading.Thread(target=self._own, args=(conn, msg), name=name, daemon=True).start()
        else:
            self._pool.submit(self._run, conn, msg, time.monotonic())

    def _take_returned(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        while True:
            try:
                conn, keep = self._returned.get_nowait()
            except queue.Empty:
                return
            conn.busy = False
            with self._lock:
                self._busy.discard(conn.sock)
            if not keep or self._closed.is_set():
                self._drop(conn, None)
                continue
            conn.last = time.monotonic()
            try:
                conn.sock.setblocking(False)
                self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            except (OSError, ValueError):
                self._drop(conn, None)
                continue
            self._advance(conn)  # requests the client sent behind the last one

    def _sweep(self, now: float) -> None:
        lim = self.limits
        for conn in list(self._conns.values()):
            if conn.busy:
                continue
            if conn.phase != "ready":
                due = conn.accepted + lim.handshake_s
            elif conn.reader.started is not None:
                due = conn.reader.started + lim.message_s
            else:
                due = conn.last + lim.idle_s
            if now >= due:
                self.counters["deadline_drops"] += 1
                self._drop(conn, None)

    def _drop(self, conn: _Conn, error: str | None) -> None:
        conn.closed = True
        if error is not None:
            with contextlib.suppress(OSError):
                conn.sock.send(frame({"t": "error", "error": error[:500]}))
        if not conn.busy:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(conn.sock)
        self._conns.pop(conn.sock, None)
        self._fresh.pop(conn.sock, None)
        with contextlib.suppress(OSError):
            conn.sock.close()

    # -- pool threads --------------------------------------------------------------------
    def _run(self, conn: _Conn, msg: dict[str, Any], queued: float) -> None:
        keep = False
        waited = int((time.monotonic() - queued) * 1000)
        if waited > self.counters["queue_wait_ms_max"]:
            self.counters["queue_wait_ms_max"] = waited
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(self.limits.send_timeout_s)
            keep = bool(self.handler(conn.sock, msg))
        except (OSError, WireError):
            keep = False  # the peer went away, timed out or broke the protocol
        except Exception:  # a handler bug must not cost the listener a thread
            log.exception("kvmesh: %s request failed", self.name)
        self._hand_back(conn, keep)

    def _hand_back(self, conn: _Conn, keep: bool) -> None:
        if self._closed.is_set():  # the selector thread is gone: nobody takes it back
            with self._lock:
                self._busy.discard(conn.sock)
            conn.sock.close()
            return
        self._returned.put((conn, keep))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _own(self, conn: _Conn, msg: dict[str, Any] | None) -> None:
        """A dedicated connection's thread: run requests until the peer goes, breaks the
        protocol or a deadline passes; then the selector thread closes it."""
        lim = self.limits
        try:
            while msg is not None and not self._closed.is_set():
                conn.sock.setblocking(True)
                conn.sock.settimeout(lim.send_timeout_s)
                if not self.handler(conn.sock, msg):
                    break
                conn.last = time.monotonic()
                msg = None
                while msg is None:
                    if conn.backlog:
                        self.counters["requests"] += 1
                        msg = conn.backlog.popleft()
                        break
                    started = conn.reader.started
                    due = conn.last + lim.idle_s if started is None else started + lim.message_s
                    left = due - time.monotonic()
                    if left <= 0:
                        self.counters["deadline_drops"] += 1
                        break
                    conn.sock.settimeout(left)
                    data = conn.sock.recv(PIECE)
                    if not data:
                        break
                    conn.backlog.extend(conn.reader.feed(data))
        except WireError:
            self.counters["bad_frames"] += 1
        except TimeoutError:
            self.counters["deadline_drops"] += 1
        except OSError:
            pass  # the peer went away
        except Exception:  # a handler bug must not go unseen
            log.exception("kvmesh: %s request failed", self.name)
        self._hand_back(conn, False)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            busy = list(self._busy)
        for sock in busy:  # wakes a pool thread blocked in a send to this peer
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        while True:  # handed back as the selector thread stopped
            try:
                conn, _ = self._returned.get_nowait()
            except queue.Empty:
                break
            conn.sock.close()
        for lst in list(self._listeners):  # after the selector thread is gone: it owns them
            with contextlib.suppress(OSError):
                lst.shutdown(socket.SHUT_RDWR)
            lst.close()
        self._listeners.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for s in (self._wake_r, self._wake_w):
            s.close()
        with contextlib.suppress(Exception):
            self._sel.close()
