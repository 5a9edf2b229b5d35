"""Real PD peers for the security tests: a producer and a consumer PdWorker (two real
engines, the producer's TransferServer on loopback, one fleet key), and hostile peers made
of plain sockets. Imported by the tests of this folder (not a conftest, so that other
security tests' fixtures stay their own)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch

from kvmesh.core.engine import CacheEngine
from kvmesh.core.fleetkey import FleetKey
from kvmesh.core.keys import KVLayout
from kvmesh.integrations.vllm.options import ConnectorOptions
from kvmesh.integrations.vllm.pd import PdWorker

LAYOUT = KVLayout(2, 2, 8, torch.float32)
CS = 128
FETCH_TIMEOUT_S = 3.0  # what a stall on a silent server would cost


def key_file(folder: Path, name: str = "fleet.key", text: str | None = None) -> str:
    path = folder / name
    path.write_text((text or FleetKey.generate()) + "\n")
    path.chmod(0o600)
    return str(path)


def options(key_path: str | None, **extra: Any) -> ConnectorOptions:
    base = {
        "chunk_size": CS,
        "max_local_cpu_size": 0.02,
        "admin_enabled": False,
        "fleet_key_file": key_path,
        "pd_fetch_timeout_s": FETCH_TIMEOUT_S,
        # A genuine pull's handshake gets the whole fetch budget, not the 1 s default: on a
        # loaded CI host the first one in a long-lived pytest process once took over 1 s
        # (a timeout, so recompute, which the slow-peer tests would read as a failure). The
        # tests here measure refusals and delays, not the connect budget.
        "pd_connect_timeout_s": FETCH_TIMEOUT_S,
        "pd_pin_timeout_s": 60,
    }
    return ConnectorOptions.from_extra_config({**base, **extra}, environ={})


def worker(opts: ConnectorOptions, produce: bool) -> PdWorker:
    eng = CacheEngine(opts.cache, layout=LAYOUT, model_id="m")
    return PdWorker(eng, opts, produce=produce, port=0)


def close(*workers: PdWorker) -> None:
    for w in workers:
        w.close()
        w.engine.close()


@contextlib.contextmanager
def pair(folder: Path, **extra: Any) -> Iterator[tuple[PdWorker, PdWorker]]:
    """A producer and a consumer holding one fleet key."""
    path = key_file(folder)
    prod, cons = worker(options(path, **extra), True), worker(options(path, **extra), False)
    try:
        yield prod, cons
    finally:
        close(prod, cons)


def prompt(n: int, seed: int = 1) -> tuple[list[int], torch.Tensor]:
    toks = list(range(seed * 1000, seed * 1000 + n))
    kv = torch.randn(LAYOUT.shape(n), generator=torch.Generator().manual_seed(seed))
    return toks, kv


def frame(obj: Any) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return struct.pack(">I", len(body)) + body


def read_all(sock: socket.socket, wait_s: float) -> bytes:
    """Whatever the peer sends within ``wait_s`` (until it closes)."""
    sock.settimeout(wait_s)
    out = bytearray()
    deadline = time.monotonic() + wait_s
    with contextlib.suppress(OSError):
        while time.monotonic() < deadline:
            part = sock.recv(1 << 16)
            if not part:
                break
            out += part
    return bytes(out)


class Silent:
    """A hostile server: accepts connections and never answers (an SSRF target, or a stall).
    ``accepted`` counts who connected; subclasses answer in :meth:`handle`."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.accepted = 0
        self._held: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _run(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._held.append(c)
            self.handle(c)

    def handle(self, conn: socket.socket) -> None:
        """Says nothing."""

    def close(self) -> None:
        self.sock.close()
        for c in self._held:
            c.close()


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
