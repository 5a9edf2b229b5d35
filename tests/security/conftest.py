"""Fixtures of the security tests (issue #23): real stores, real processes, real sockets.

Stored-chunk attacks (findings 2, 3, 8, 10):

* ``key_file(*keys)`` — writes a fleet key file (mode 600) listing ``keys`` (first signs).
* ``shared_store`` — parametrized over the shared tiers: a real directory (``fs://``), the
  session ``redis-server`` (emptied), a bucket on a ``moto_server`` process (S3), a
  ``mooncake_master`` (Mooncake Store); its value is the tier URL.
* ``make_engine(url, key=None, encrypt=False, codec="raw")`` — a ``CacheEngine`` whose
  remote tier is ``url`` and whose cpu tier keeps nothing (``local_cpu: false``): every
  retrieve reads the shared tier, as a fresh replica does. Closed at teardown.
* ``attacker(url, key=None)`` — the same tier opened by a writer without the fleet key (or
  with another key), as any pod that can reach the store can.

Client-facing attacks (findings 1, 5, 6, 7, 9), a hostile client against real kvmesh processes:

* ``capture`` — a :class:`~kvmesh.router.testing.FakeVLLM` on a real loopback socket that
  records every request it receives (what reached "the replica").
* ``start_router(**config)`` — a real ``kvmesh router`` in a process of its own
  (:class:`~kvmesh.harness.router.RouterProcess`) in front of ``capture``; stopped at teardown.
* ``epp_behind_envoy(**config)`` — ``kvmesh epp`` (its ext_proc over TLS, with the
  certificate a test CA issued) behind a real Envoy that verifies it, in front of ``capture``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from kvmesh import CacheConfig, CacheEngine
from kvmesh.core.fleetkey import FleetKey
from kvmesh.harness.ports import free_port
from kvmesh.harness.router import RouterProcess
from kvmesh.harness.services import RedisServer
from kvmesh.harness.stores import S3_CREDS, MooncakeMaster, MotoServer
from kvmesh.metrics import TierMetrics
from kvmesh.router import RouterConfig
from kvmesh.router.testing import FakeVLLM
from kvmesh.routing.config import ReplicaConfig
from kvmesh.tiers.base import Tier, TierOptions, open_tier
from tests.security.chunks import CHUNK, LAYOUT

if TYPE_CHECKING:
    from kvmesh.epp.server import EppThread
    from kvmesh.harness.envoy import Envoy, EppTls


@pytest.fixture
def capture() -> Iterator[FakeVLLM]:
    fake = FakeVLLM("capture").start()
    try:
        yield fake
    finally:
        fake.stop()


StartRouter = Callable[..., RouterProcess]


@pytest.fixture
def start_router(tok_dir: Path, capture: FakeVLLM, tmp_path: Path) -> Iterator[StartRouter]:
    started: list[RouterProcess] = []

    def start(**overrides: Any) -> RouterProcess:
        data: dict[str, Any] = {
            "model": str(tok_dir),
            "replicas": [ReplicaConfig(url=capture.url, name="capture")],
            "port": 0,
            "health_interval_s": 0.2,
        }
        data.update(overrides)
        router = RouterProcess(RouterConfig.from_dict(data), str(tmp_path / f"router{len(started)}.log"))
        started.append(router)
        return router.start(60)

    try:
        yield start
    finally:
        for r in started:
            r.stop()


@dataclass
class Gateway:
    """Envoy (``url``: its FailClose listener) asking ``epp`` over verified TLS."""

    envoy: Envoy
    epp: EppThread
    tls: EppTls

    @property
    def url(self) -> str:
        return self.envoy.url("fail_close")


StartGateway = Callable[..., Gateway]


@pytest.fixture
def epp_behind_envoy(tok_dir: Path, capture: FakeVLLM, tmp_path: Path) -> Iterator[StartGateway]:
    # Imported here: the router's tests need none of the EPP's (grpc, Envoy).
    from kvmesh.epp.config import EppConfig
    from kvmesh.epp.server import EppThread
    from kvmesh.harness.envoy import Envoy, envoy_binary, make_epp_tls

    envoy_binary()  # a missing binary fails the test: the EPP's exposure is tested behind Envoy
    made: list[Gateway] = []

    def start(**overrides: Any) -> Gateway:
        work = tmp_path / f"gateway{len(made)}"
        work.mkdir()
        tls = make_epp_tls(work)
        routing = RouterConfig(
            model=str(tok_dir), replicas=(ReplicaConfig(url=capture.url),), health_interval_s=0.2
        )
        data: dict[str, Any] = {"routing": routing, "grpc_port": free_port(), "health_port": free_port(),
                                "metrics_port": 0, "cert_path": str(tls.cert_dir)}  # fmt: skip
        data.update(overrides)
        cfg = EppConfig.model_validate(data)
        epp = EppThread(cfg).start()
        gw = Gateway(Envoy(cfg.grpc_port, [capture.url.split("://")[1]], work, epp_tls=tls,
                           epp_health_port=cfg.health_port, message_timeout_s=5), epp, tls)  # fmt: skip
        made.append(gw)
        gw.envoy.start()
        wait_routed(gw.url)
        return gw

    try:
        yield start
    finally:
        for gw in made:
            gw.envoy.stop()
            gw.epp.stop()


def wait_routed(url: str, timeout_s: float = 20.0) -> None:
    """Until Envoy's health check of the EPP passes and a request is answered through it."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "ready?"}, timeout=10)
        if r.status_code == 200:
            return
        assert time.monotonic() < deadline, f"Envoy never routed through the EPP: {r.status_code} {r.text}"
        time.sleep(0.2)


# -- stored chunks ---------------------------------------------------------------------------


@pytest.fixture
def key_file(tmp_path: Path) -> Callable[..., str]:
    made = [0]

    def write(*keys: str) -> str:
        made[0] += 1
        path = tmp_path / f"fleet-{made[0]}.key"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("# test fleet key\n" + "\n".join(keys) + "\n")
        return str(path)

    return write


@pytest.fixture(params=["fs", "redis", "s3", "mooncake"])
def shared_store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    kind = request.param
    if kind == "fs":
        yield f"fs://{tmp_path / 'shared'}"
    elif kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        server.start()
        server.flushall()
        yield server.url
    elif kind == "s3":
        moto: MotoServer = request.getfixturevalue("moto")
        for k, v in S3_CREDS.items():
            monkeypatch.setenv(k, v)
        bucket = f"kv-{request.node.name.split('[')[0][-30:].replace('_', '-').strip('-')}-{os.getpid()}"
        moto.client().create_bucket(Bucket=bucket)
        yield moto.tier_url(bucket)
    else:
        master = MooncakeMaster(tmp_path)
        master.start()
        try:
            yield master.url
        finally:
            master.kill()


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator[Callable[..., CacheEngine]]:
    engines: list[CacheEngine] = []

    def make(
        url: str | None, key: str | None = None, encrypt: bool = False, codec: str = "raw", **extra: Any
    ) -> CacheEngine:
        cfg: dict[str, Any] = {
            "chunk_size": CHUNK,
            "local_cpu": False,
            "max_local_cpu_size": 0.01,
            "remote_url": url,
            "remote_serde": codec,
            "fleet_key_file": key,
            "encrypt_at_rest": encrypt,
            **extra,
        }
        eng = CacheEngine(CacheConfig.from_dict(cfg), layout=LAYOUT, model_id="m")
        engines.append(eng)
        return eng

    yield make
    for e in engines:
        e.close(timeout=10)


@pytest.fixture
def attacker() -> Iterator[Callable[..., Tier]]:
    tiers: list[Tier] = []

    def make(url: str, key: str | None = None) -> Tier:
        # No key: the tier's default format, as kvmesh without a fleet key writes it (the
        # same call works on a kvmesh that has no fleet key at all).
        opts = TierOptions(name="attacker", chunk_size=CHUNK, metrics=TierMetrics("attacker"))
        if key is not None:
            from kvmesh.core.serde import ChunkFormat

            opts.chunk_format = ChunkFormat(FleetKey.load(key))
        tier = open_tier(url, opts)
        tiers.append(tier)
        return tier

    yield make
    for t in tiers:
        t.close()
