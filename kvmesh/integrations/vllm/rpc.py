"""A small request/reply channel from vLLM's scheduler process to its worker processes.

On vLLM-CPU the scheduler (EngineCore) and the worker are separate processes with no shared
memory, and only the worker can own the :class:`~kvmesh.CacheEngine` (it needs the paged KV
tensors). The scheduler must still know, before it allocates blocks, how many prompt tokens
kvmesh holds. So each worker rank serves a few operations (``lookup``, ``release``,
``stats``, ``clear``, ``wait_for_writes``, the PD calls, ``ping``):

- on a unix domain socket (mode 0600: only this user) whose path both processes derive from
  the vLLM instance's ``kv_transfer_config.engine_id``: the way when the rank runs on the
  scheduler's node. It is barely faster than loopback TCP (a 16-token lookup round trip
  ~20 us against ~22 us here, 4,096 tokens ~125 us against ~128 us) but needs no key: its
  file mode is the authentication;
- with a fleet key, also on TCP (``rpc_host:rpc_port``), for a scheduler on another node
  (tensor parallelism across nodes). Every TCP connection passes the fleet key handshake of
  :mod:`kvmesh.transport.auth` (purpose ``RPC_AUTH``) before its first request is read.

Workers tell the scheduler where they listen through vLLM's connector handshake metadata
(:class:`RpcAddress`, collected from every rank after the KV caches are registered); the
scheduler picks the unix socket for a rank on its own node and TCP otherwise, and says
loudly (an error naming the rank and what to set) when a rank cannot be reached.

Wire: :mod:`kvmesh.transport.wire` frames (a 4-byte big-endian length and a msgpack map; no
pickle), at most :data:`MAX_MESSAGE` bytes, read incrementally on the bounded
:class:`~kvmesh.transport.listener.Listener` (connection caps, per-message deadlines).

The client never raises and never hangs: any failure (worker not up yet, timeout, a bad
reply) returns ``None`` (the scheduler treats that as a miss); after a timeout the client
stays quiet for ``retry_after_s`` so a stuck worker costs one timeout, not one per request.
A rank that keeps failing is logged as an error when it starts and again every minute.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvmesh.core.fleetkey import RPC_AUTH, FleetKey
from kvmesh.errors import ConfigError, WireError
from kvmesh.transport.auth import client_handshake
from kvmesh.transport.listener import Limits, Listener
from kvmesh.transport.wire import recv_msg, send_msg

log = logging.getLogger(__name__)

MAX_MESSAGE = 32 << 20  # a 1M-token lookup is ~5 MB of msgpack; anything near this is garbage
Handler = Callable[..., Any]
Address = str | tuple[str, int]  # a unix socket path, or (host, port) over TCP
# The scheduler's connections are few and live for the engine's life (idle between requests).
RPC_LIMITS = Limits(
    max_frame=MAX_MESSAGE,
    max_connections=64,
    max_fresh=16,
    handshake_s=5.0,
    message_s=10.0,
    idle_s=3600.0,
    workers=8,  # a pd_pull may run for pd_fetch_timeout_s beside lookups
    send_timeout_s=10.0,
)
REPORT_EVERY_S = 60.0
# The longest path a unix socket binds to (Linux: sun_path is 108 bytes with its NUL)
UNIX_PATH_MAX = 107


def socket_path(engine_id: str, tp_rank: int = 0, dp_rank: int = 0, directory: str | None = None) -> str:
    """Where the worker of ``engine_id`` (tensor-parallel rank ``tp_rank``) listens.

    The engine id is hashed: unix socket paths are limited to ~107 bytes, and an id is
    free-form text."""
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    path = os.path.join(directory or tempfile.gettempdir(), f"kvmesh-{digest}-dp{dp_rank}-tp{tp_rank}.sock")
    size = len(os.fsencode(path))
    if size > UNIX_PATH_MAX:  # bind would fail deep in a worker: "AF_UNIX path too long"
        where = f"socket_dir {directory!r}" if directory else f"the temp directory {tempfile.gettempdir()!r}"
        raise ConfigError(
            f"{where}: the scheduler-to-worker socket {path!r} would be {size} bytes, "
            f"more than a unix socket's path may be ({UNIX_PATH_MAX}); set socket_dir to a shorter directory"
        )
    return path


def node_id() -> str:
    """This machine (hostname and boot id): a unix socket path means the same socket only
    within one node."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass
class RpcAddress:
    """Where one worker rank serves the RPC (sent to the scheduler by vLLM's handshake)."""

    node: str
    path: str
    tcp_host: str | None = None
    tcp_port: int = 0


class RpcServer:
    """Serves ``handlers[op](**args)`` on a unix socket (and, with ``key`` and ``tcp_host``,
    on authenticated TCP) through one bounded listener."""

    def __init__(
        self,
        path: str,
        handlers: Mapping[str, Handler],
        *,
        key: FleetKey | None = None,
        tcp_host: str | None = None,
        tcp_port: int = 0,
        limits: Limits | None = None,
    ) -> None:
        if tcp_host is not None and key is None:
            raise ConfigError(
                f"the lookup RPC will not listen on TCP ({tcp_host}) without a fleet key: set fleet_key_file"
            )
        self.path = path
        self.handlers = {"ping": lambda: "pong", **handlers}
        self.key = key
        self._tcp = (tcp_host, tcp_port) if tcp_host is not None else None
        self.tcp_address: tuple[str, int] | None = None
        # Few peers (the scheduler's clients), each waiting on its answer: a thread apiece.
        lim = limits or RPC_LIMITS
        self.listener = Listener("kvmesh-rpc", self._handle, key, RPC_AUTH, lim, dedicated=True)

    def start(self) -> RpcServer:
        if os.path.exists(self.path):
            if self._alive(self.path):
                raise ConfigError(
                    f"another kvmesh worker already serves {self.path}; two vLLM instances share "
                    "an engine_id: give each its own kv_transfer_config.engine_id"
                )
            os.unlink(self.path)  # left over from a crashed process
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(self.path)
        os.chmod(self.path, 0o600)
        unix.listen(16)
        self.listener.add(unix, authenticate=False)  # the file mode admits this user only
        if self._tcp is not None:
            host, port = self._tcp
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            tcp = socket.socket(family, socket.SOCK_STREAM)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                tcp.bind((host, port))
                tcp.listen(16)
            except OSError as exc:
                tcp.close()
                self.listener.close()
                why = f"the lookup RPC cannot listen on {host}:{port} (rpc_host/rpc_port): {exc}"
                raise ConfigError(why) from None
            self.tcp_address = (host, int(tcp.getsockname()[1]))
            self.listener.add(tcp, authenticate=True)
        self.listener.start()
        return self

    def address(self) -> RpcAddress:
        tcp = self.tcp_address
        return RpcAddress(node_id(), self.path, tcp[0] if tcp else None, tcp[1] if tcp else 0)

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

    def _handle(self, conn: socket.socket, msg: dict[str, Any]) -> bool:
        send_msg(conn, self._dispatch(msg))  # the client may have given up (timeout): OSError
        return True

    def _dispatch(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.pop("op", None)
        if not isinstance(op, str):
            return {"ok": False, "error": "a request is a map with a string 'op'"}
        handler = self.handlers.get(op)
        if handler is None:
            return {"ok": False, "error": f"unknown op {op!r}; known: {', '.join(sorted(self.handlers))}"}
        try:
            return {"ok": True, "result": handler(**msg)}
        except Exception as exc:  # a bad request must not kill the connection
            log.exception("kvmesh rpc %s failed", op)
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    def close(self) -> None:
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class RpcClient:
    """Calls an :class:`RpcServer` at ``address`` (a unix socket path, or ``(host, port)``
    over TCP, authenticated with ``key``); returns ``None`` on any failure instead of raising."""

    def __init__(
        self,
        address: Address,
        timeout_s: float = 2.0,
        retry_after_s: float = 1.0,
        *,
        key: FleetKey | None = None,
        label: str = "",
    ) -> None:
        self.address: Address = address
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.key = key
        self.label = label or "worker"
        self.failures = 0
        self._sock: socket.socket | None = None
        self._quiet_until = 0.0
        self._lock = threading.Lock()
        self._failing_since: float | None = None  # first failure of the current run of them
        self._reported: float | None = None  # when the last error was logged
        self._failed_since_report = 0

    @property
    def path(self) -> str:
        """The unix socket path (for a TCP address, its ``host:port``)."""
        return self.address if isinstance(self.address, str) else f"{self.address[0]}:{self.address[1]}"

    def retarget(self, address: Address, key: FleetKey | None = None) -> None:
        """Call ``address`` from now on (vLLM's handshake told where the rank listens)."""
        with self._lock:
            self._close()
            self.address, self.key = address, key if key is not None else self.key
            self._quiet_until = 0.0

    def call(self, op: str, **args: Any) -> Any:
        with self._lock:
            if time.monotonic() < self._quiet_until:
                self._count_failure(op, "still quiet after a timeout")
                return None
            deadline = time.monotonic() + self.timeout_s
            try:
                reply = self._exchange({"op": op, **args}, deadline)
            except (OSError, WireError, msgspec.EncodeError) as exc:
                self._close()  # a late reply must never be read as the answer to the next call
                if isinstance(exc, TimeoutError):
                    self._quiet_until = time.monotonic() + self.retry_after_s
                self._count_failure(op, repr(exc))
                return None
            if not reply.get("ok"):
                self._count_failure(op, str(reply.get("error"))[:300])
                return None
            self._recovered()
            return reply.get("result")

    def _exchange(self, msg: dict[str, Any], deadline: float) -> dict[str, Any]:
        reused = self._sock is not None
        sock = self._connect(deadline)
        try:
            send_msg(sock, msg)
            return recv_msg(sock, MAX_MESSAGE, deadline)
        except (ConnectionResetError, BrokenPipeError, WireError) as exc:
            # The worker closed a connection that sat idle (its idle limit, a restart): the
            # request never reached it, so one fresh connection may carry it.
            if not reused or isinstance(exc, TimeoutError) or time.monotonic() >= deadline:
                raise
            self._close()
            sock = self._connect(deadline)
            send_msg(sock, msg)
            return recv_msg(sock, MAX_MESSAGE, deadline)

    def _connect(self, deadline: float) -> socket.socket:
        if self._sock is not None:
            return self._sock
        addr = self.address
        if isinstance(addr, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                sock.connect(addr)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection(addr, timeout=max(0.01, deadline - time.monotonic()))
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.key is None:
                    raise WireError(f"{addr[0]}:{addr[1]}: the lookup RPC over TCP needs the fleet key")
                client_handshake(sock, self.key, RPC_AUTH, deadline)
            except BaseException:
                sock.close()
                raise
        self._sock = sock
        return sock

    def _count_failure(self, op: str, why: str) -> None:
        """Loud for a rank that does not answer: an error on the first failure, then one a
        minute while failures go on (every failed lookup is a miss for the whole prompt)."""
        self.failures += 1
        self._failed_since_report += 1
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if self._reported is not None and now - self._reported < REPORT_EVERY_S:
            return
        log.error(
            "kvmesh: %s at %s does not answer: rpc %s failed (%s); %d call(s) failed in the last %.0f s, "
            "each counted as a miss",
            self.label,
            self.path,
            op,
            why,
            self._failed_since_report,
            min(now - self._failing_since, REPORT_EVERY_S),
        )
        self._reported = now
        self._failed_since_report = 0

    def _recovered(self) -> None:
        if self._failing_since is not None:
            log.warning("kvmesh: %s at %s answers again", self.label, self.path)
            self._failing_since = None
            self._failed_since_report = 0
            self._reported = None

    def _close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()
