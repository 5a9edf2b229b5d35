"""Local services for tests, benchmarks and the demo: a throwaway Redis, the shared tier the
replicas use, and cold page caches. Everything listens on loopback only."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

from kvmesh.errors import ProcessError
from kvmesh.harness.ports import free_port

_REDIS_CANDIDATES = ("/usr/bin/redis-server", "/usr/local/bin/redis-server")


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS server on loopback: its certificate and key, and the CA that
    signed them (which clients must be given: it is in no system store)."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def make(
        cls, directory: str | os.PathLike[str], names: Sequence[str] = ("127.0.0.1", "localhost")
    ) -> TlsFiles:
        from kvmesh.epp.tls import make_certificate

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        ca = make_certificate(["kvmesh-test-ca"], ca=True)
        cert, key = make_certificate(list(names), issuer=ca)
        files = cls(cert=d / "server.pem", key=d / "server.key", ca=d / "ca.pem")
        files.ca.write_bytes(ca[0])
        files.cert.write_bytes(cert)
        files.key.write_bytes(key)
        files.key.chmod(0o600)
        return files

    def server_options(self, port: int) -> list[tuple[str, str]]:
        """``redis-server`` options serving TLS only, on ``port`` (clients need no certificate)."""
        return [("port", "0"), ("tls-port", str(port)), ("tls-cert-file", str(self.cert)),
                ("tls-key-file", str(self.key)), ("tls-ca-cert-file", str(self.ca)),
                ("tls-auth-clients", "no")]  # fmt: skip

    def server_args(self, port: int) -> list[str]:
        """:meth:`server_options` as command-line arguments."""
        return [arg for name, value in self.server_options(port) for arg in (f"--{name}", value)]

    def client_kwargs(self) -> dict[str, Any]:
        """What a ``redis.Redis`` client needs to reach such a server and verify it."""
        return {"ssl": True, "ssl_ca_certs": str(self.ca)}


def drop_page_cache() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` for cold reads; ``False`` where refused."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class RedisServer:
    """A throwaway ``redis-server`` on a loopback port (a free one unless given), without
    persistence: it can be killed and restarted on the same port, and comes back empty.

    ``unix_socket=True`` also listens on ``unix_socket`` (TCP stays on for the readiness
    check); ``workdir`` (default: a temporary directory removed by :meth:`stop`) holds its
    log and socket.
    """

    def __init__(
        self,
        port: int | None = None,
        maxmemory: str | None = None,
        unix_socket: bool = False,
        workdir: str | os.PathLike[str] | None = None,
        executable: str | None = None,
        password: str | None = None,
        extra_args: Sequence[str] = (),
        tls: TlsFiles | None = None,
    ) -> None:
        """``executable``: another server binary speaking Redis (a ``valkey-server``);
        ``password``: ``requirepass`` (the default user's password; :meth:`client` uses it);
        ``extra_args``: more ``--option value`` arguments (``--replicaof h p``); ``tls``: serve
        TLS only, with these files (:attr:`url` is then ``rediss://`` naming the CA)."""
        self.tls = tls
        self.executable = executable
        self.password = password
        self.extra_args = list(extra_args)
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self._own_dir = workdir is None
        self.workdir = (
            Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="kvmesh-redis-"))
        )
        self.log_path = self.workdir / f"redis-{self.port}.log"
        self.unix_socket = self.workdir / "redis.sock" if unix_socket else None
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def binary() -> str | None:
        """The ``redis-server`` executable (PATH, then /usr/bin, /usr/local/bin), or None."""
        return shutil.which("redis-server") or next(
            (p for p in _REDIS_CANDIDATES if os.access(p, os.X_OK)), None
        )

    @classmethod
    def available(cls) -> bool:
        return cls.binary() is not None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://{self.host}:{self.port}/0?ssl_ca_certs={quote(str(self.tls.ca))}"
        return f"redis://{self.host}:{self.port}/0"

    def client(self, timeout: float = 5.0) -> Any:
        """A ``redis.Redis`` client of this server (the caller closes it)."""
        import redis

        return redis.Redis(
            host=self.host,
            port=self.port,
            password=self.password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            **({} if self.tls is None else self.tls.client_kwargs()),
        )

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self, binary: str) -> list[str]:
        listen = ["--port", str(self.port)] if self.tls is None else self.tls.server_args(self.port)
        args = [binary, *listen, "--bind", self.host, "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--protected-mode", "yes"]  # fmt: skip
        if self.unix_socket is not None:
            args += ["--unixsocket", str(self.unix_socket), "--unixsocketperm", "700"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory]
        if self.password is not None:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        return args + self.extra_args

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start it (a no-op while it runs) and wait until it answers PING."""
        if self.is_running():
            return self
        binary = self.executable or self.binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install -y redis-server)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(binary), stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        import redis

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ProcessError(
                    f"redis-server exited with {self.proc.returncode}; log:\n{self.log_text()}"
                )
            client = self.client(timeout=0.5)
            try:
                if client.ping():
                    return
            except redis.RedisError as exc:
                last = exc
            finally:
                client.close()
            time.sleep(0.02)
        self.kill()
        raise TimeoutError(
            f"redis-server on port {self.port} did not answer PING in {timeout:.0f} s ({last}); "
            f"log:\n{self.log_text()}"
        )

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever, as in a crash."""
        if self.is_running():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self, timeout: float = 10.0) -> None:
        self.kill()
        self.start(timeout)

    def stop(self) -> None:
        if self.is_running():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def flushall(self) -> None:
        client = self.client()
        try:
            client.flushall()
        finally:
            client.close()

    def log_text(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class RedisSentinel(RedisServer):
    """A throwaway ``redis-server --sentinel`` watching ``master`` under ``service`` (quorum 1,
    down after ``down_after_ms``): for tests of the ``redis-sentinel://`` tier. Sentinel
    rewrites its config file, so it gets one of its own in ``workdir``."""

    def __init__(
        self,
        master: RedisServer,
        service: str,
        down_after_ms: int = 1000,
        workdir: str | os.PathLike[str] | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        """``tls``: the sentinel serves TLS only, and speaks TLS to the servers it watches."""
        super().__init__(workdir=workdir, tls=tls)
        self.master = master
        self.service = service
        self.down_after_ms = down_after_ms

    def command(self, binary: str) -> list[str]:
        conf = self.workdir / f"sentinel-{self.port}.conf"
        if self.tls is None:
            listen = [f"port {self.port}"]
        else:  # and TLS to the servers it watches
            listen = [f"{k} {v}" for k, v in self.tls.server_options(self.port)] + ["tls-replication yes"]
        lines = [
            *listen,
            f"bind {self.host}",
            f"dir {self.workdir}",
            f"sentinel monitor {self.service} {self.master.host} {self.master.port} 1",
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
            f"sentinel failover-timeout {self.service} 10000",
        ]
        if self.master.password is not None:
            lines.append(f"sentinel auth-pass {self.service} {self.master.password}")
        conf.write_text("\n".join(lines) + "\n")
        return [binary, str(conf), "--sentinel"]

    def flushall(self) -> None:
        raise NotImplementedError("a sentinel holds no data")


@contextlib.contextmanager
def shared_tier(workdir: str) -> Iterator[str]:
    """The URL of a tier every local replica can reach: a Redis started here when
    redis-server is installed, else a directory under ``workdir`` (``fs://``)."""
    if RedisServer.available():
        with RedisServer() as server:
            yield server.url
    else:
        path = os.path.join(workdir, "shared")
        os.makedirs(path, exist_ok=True)
        yield "fs://" + os.path.abspath(path)
