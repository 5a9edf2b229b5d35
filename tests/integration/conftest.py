"""Real-service fixtures for integration tests: a ``redis-server`` per test session.

Fixtures:

* ``redis_server`` (session) — a running :class:`RedisServer` on a free loopback port.
* ``redis_url`` (function) — that server emptied (``FLUSHALL``) for this test; its URL.
* ``redis_restartable`` (function) — the session server for a test that kills/restarts it
  (``kill()``, ``start()``, ``restart()``); it is running again and empty afterwards.
* ``redis_server_factory`` (function) — ``factory(unix_socket=False)`` returns a *not yet
  started* :class:`RedisServer` on a fresh free port (for "Redis not there yet" tests; with
  ``unix_socket=True`` it also listens on ``server.unix_socket``); every server it made is
  stopped at teardown.

A missing ``redis-server`` binary fails these tests loudly; it never skips them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

_CANDIDATES = ("/usr/bin/redis-server", "/usr/local/bin/redis-server")


def find_redis_server() -> str:
    path = shutil.which("redis-server") or next((p for p in _CANDIDATES if os.access(p, os.X_OK)), None)
    if path is None:
        pytest.fail(
            "redis-server not found on PATH or in /usr/bin, /usr/local/bin; "
            "install it (apt-get install -y redis-server) to run the integration tests",
            pytrace=False,
        )
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process on a fixed loopback port; can be killed and restarted
    on the same port (no persistence: a restart comes back empty)."""

    def __init__(self, binary: str, port: int, workdir: Path, unix_socket: bool = False) -> None:
        self.binary = binary
        self.host = "127.0.0.1"
        self.port = port
        self.workdir = workdir
        self.log_path = workdir / f"redis-{port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        # Also listen on a unix socket (for unix:// URLs); TCP stays on for readiness checks.
        self.unix_socket = workdir / "redis.sock" if unix_socket else None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def client(self) -> redis.Redis[bytes]:
        return redis.Redis(host=self.host, port=self.port, socket_timeout=5, socket_connect_timeout=5)

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        if self.is_running():
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        if self.unix_socket is not None:
            cmd += ["--unixsocket", str(self.unix_socket), "--unixsocketperm", "700"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(f"redis-server exited with {self.proc.returncode}; log:\n{self._log_tail()}")
            client = redis.Redis(
                host=self.host, port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5
            )
            try:
                if client.ping():
                    return
            except redis.RedisError as exc:
                last = exc
            finally:
                client.close()
            time.sleep(0.02)
        self.kill()
        pytest.fail(
            f"redis-server on port {self.port} did not answer PING in {timeout_s}s ({last}); "
            f"log:\n{self._log_tail()}"
        )

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def restart(self, timeout_s: float = 10.0) -> None:
        self.kill()
        self.start(timeout_s)

    def flushall(self) -> None:
        client = self.client()
        try:
            client.flushall()
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    binary = find_redis_server()
    with tempfile.TemporaryDirectory(prefix="kvmesh-redis-") as tmp:
        server = RedisServer(binary, free_port(), Path(tmp))
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    redis_server.start()  # no-op unless an earlier test left it dead
    redis_server.flushall()
    return redis_server.url


@pytest.fixture
def redis_restartable(redis_server: RedisServer) -> Iterator[RedisServer]:
    redis_server.start()
    redis_server.flushall()
    try:
        yield redis_server
    finally:
        redis_server.start()
        redis_server.flushall()


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    binary = find_redis_server()
    made: list[RedisServer] = []

    def factory(unix_socket: bool = False) -> RedisServer:
        server = RedisServer(binary, free_port(), tmp_path / f"redis-{len(made)}", unix_socket)
        made.append(server)
        return server

    try:
        yield factory
    finally:
        for server in made:
            server.kill()
