"""A tiny request/reply channel from vLLM's scheduler process to its worker process.

On vLLM-CPU the scheduler (EngineCore) and the worker are separate processes with no shared
memory, and only the worker can own the :class:`~kvmesh.CacheEngine` (it needs the paged KV
tensors). The scheduler must still know, before it allocates blocks, how many prompt tokens
kvmesh holds. So the worker serves a few operations (``lookup``, ``release``, ``stats``,
``clear``, ``wait_for_writes``) on a unix domain socket whose path both processes derive
from the vLLM instance's ``kv_transfer_config.engine_id``.

Wire: each message is a 4-byte big-endian length and a msgpack map (no pickle: whatever
connects to the socket can only send data). The socket file is mode 0600.

The client never raises and never hangs: any failure (worker not up yet, timeout, a bad
reply) returns ``None`` — the scheduler treats that as a miss — and after a timeout the
client stays quiet for ``retry_after_s`` so a stuck worker costs one timeout, not one per
request.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from kvmesh.errors import ConfigError

log = logging.getLogger(__name__)

MAX_MESSAGE = 64 << 20  # a 4k-token lookup is ~20 KB; anything near this is garbage
_LEN = struct.Struct(">I")
Handler = Callable[..., Any]


def socket_path(engine_id: str, tp_rank: int = 0, dp_rank: int = 0, directory: str | None = None) -> str:
    """Where the worker of ``engine_id`` (tensor-parallel rank ``tp_rank``) listens.

    The engine id is hashed: unix socket paths are limited to ~107 bytes, and an id is
    free-form text."""
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    return os.path.join(directory or tempfile.gettempdir(), f"kvmesh-{digest}-dp{dp_rank}-tp{tp_rank}.sock")


def _send(sock: socket.socket, obj: Any) -> None:
    body = msgspec.msgpack.encode(obj)
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


def _recv(sock: socket.socket) -> Any:
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        raise ConnectionError("peer closed the connection")
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE:
        raise ConnectionError(f"message of {n} bytes exceeds the {MAX_MESSAGE}-byte limit")
    body = _recv_exact(sock, n)
    if body is None:
        raise ConnectionError("peer closed the connection mid-message")
    return msgspec.msgpack.decode(body)


class RpcServer:
    """Serves ``handlers[op](**args)`` on a unix socket, one thread per connection."""

    def __init__(self, path: str, handlers: Mapping[str, Handler]) -> None:
        self.path = path
        self.handlers = dict(handlers)
        self._listener: socket.socket | None = None
        self._closed = threading.Event()

    def start(self) -> RpcServer:
        if os.path.exists(self.path):
            if self._alive(self.path):
                raise ConfigError(
                    f"another kvmesh worker already serves {self.path}; two vLLM instances share "
                    "an engine_id: give each its own kv_transfer_config.engine_id"
                )
            os.unlink(self.path)  # left over from a crashed process
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        os.chmod(self.path, 0o600)
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept_loop, name="kvmesh-rpc", daemon=True).start()
        return self

    @staticmethod
    def _alive(path: str) -> bool:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(0.5)
        try:
            probe.connect(path)
            return True
        except OSError:
            return False
        finally:
            probe.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="kvmesh-rpc-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    msg = _recv(conn)
                    reply = self._dispatch(msg)
                    _send(conn, reply)  # the client may have given up (timeout): OSError
                except (OSError, ConnectionError, msgspec.DecodeError):
                    return

    def _dispatch(self, msg: Any) -> dict[str, Any]:
        if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
            return {"ok": False, "error": "a request is a map with a string 'op'"}
        op = msg.pop("op")
        handler = self.handlers.get(op)
        if handler is None:
            return {"ok": False, "error": f"unknown op {op!r}; known: {', '.join(sorted(self.handlers))}"}
        try:
            return {"ok": True, "result": handler(**msg)}
        except Exception as exc:  # a bad request must not kill the connection thread
            log.exception("kvmesh rpc %s failed", op)
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            # shutdown() wakes the thread blocked in accept(); close() alone may not.
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class RpcClient:
    """Calls an :class:`RpcServer`; returns ``None`` on any failure instead of raising."""

    def __init__(self, path: str, timeout_s: float = 2.0, retry_after_s: float = 1.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.failures = 0
        self._sock: socket.socket | None = None
        self._quiet_until = 0.0
        self._lock = threading.Lock()
        self._warned = False

    def call(self, op: str, **args: Any) -> Any:
        with self._lock:
            if time.monotonic() < self._quiet_until:
                return None
            try:
                sock = self._connect()
                _send(sock, {"op": op, **args})
                reply = _recv(sock)
            except (OSError, ConnectionError, msgspec.DecodeError, msgspec.EncodeError) as exc:
                self._fail(op, exc, timed_out=isinstance(exc, TimeoutError))
                return None
            if not isinstance(reply, dict) or not reply.get("ok"):
                err = reply.get("error") if isinstance(reply, dict) else reply
                self._fail(op, RuntimeError(str(err)), timed_out=False, reconnect=False)
                return None
            return reply.get("result")

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def _fail(self, op: str, exc: BaseException, timed_out: bool, reconnect: bool = True) -> None:
        self.failures += 1
        if reconnect:
            self.close()  # a late reply must never be read as the answer to the next call
        if timed_out:
            self._quiet_until = time.monotonic() + self.retry_after_s
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        log.log(level, "kvmesh rpc %s to %s failed (%s); counting it as a miss", op, self.path, exc)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
