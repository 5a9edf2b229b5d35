"""The throwaway Redis of tests and benchmarks (a real redis-server) and the shared tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.harness.services import RedisServer, shared_tier


@pytest.mark.redis
def test_redis_server_starts_answers_restarts_empty_and_cleans_up() -> None:
    if not RedisServer.available():
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    server = RedisServer(maxmemory="64mb")
    workdir = server.workdir
    with server:
        assert server.is_running() and server.url == f"redis://127.0.0.1:{server.port}/0"
        client = server.client()
        try:
            client.set("k", b"v")
            assert client.get("k") == b"v"
            assert int(client.config_get("maxmemory")["maxmemory"]) == 64 << 20
        finally:
            client.close()
        server.restart()  # same port, no persistence: empty
        client = server.client()
        try:
            assert client.get("k") is None
        finally:
            client.close()
        server.kill()
        assert not server.is_running()
        server.start()
        assert server.is_running()
    assert not server.is_running() and not workdir.exists()  # its own temporary directory


@pytest.mark.redis
def test_redis_server_on_a_unix_socket_keeps_a_given_workdir(tmp_path: Path) -> None:
    if not RedisServer.available():
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    import redis

    with RedisServer(unix_socket=True, workdir=tmp_path / "r") as server:
        assert server.unix_socket is not None and server.unix_socket.is_socket()
        client = redis.Redis(unix_socket_path=str(server.unix_socket))
        try:
            assert client.ping()
        finally:
            client.close()
    assert (tmp_path / "r").exists()  # the caller's directory stays


def test_redis_server_that_cannot_start_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RedisServer, "binary", staticmethod(lambda: None))
    with pytest.raises(FileNotFoundError, match="apt-get install -y redis-server"):
        RedisServer(workdir=tmp_path).start()


def test_shared_tier_is_a_directory_without_redis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RedisServer, "binary", staticmethod(lambda: None))
    with shared_tier(str(tmp_path)) as url:
        assert url == "fs://" + str(tmp_path / "shared") and (tmp_path / "shared").is_dir()


@pytest.mark.redis
def test_shared_tier_is_redis_when_installed(tmp_path: Path) -> None:
    if not RedisServer.available():
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    with shared_tier(str(tmp_path)) as url:
        assert url.startswith("redis://127.0.0.1:")
