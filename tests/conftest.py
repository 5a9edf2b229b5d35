"""Fixtures every test folder shares (the harness, :mod:`kvmesh.harness`, does the work).

* ``free_port`` — the harness's :func:`~kvmesh.harness.ports.free_port` (call it for each
  port: it never hands out the same port twice in a session).
* ``tok_dir`` (session) — a small tokenizer directory in the tiny models' format
  (:func:`kvmesh.router.testing.write_test_tokenizer`, trained in well under a second).
* ``tiny_model`` (session) — the ``tiny`` preset model in ``.cache/models/tiny`` (built
  once, reused across sessions; ``make models`` builds it too). Skips without vLLM: the
  model is only there to be served by it.
* ``redis_server`` (session) — a running :class:`~kvmesh.harness.services.RedisServer`.
* ``redis_url`` — that server emptied (``FLUSHALL``) for this test; its URL.
* ``redis_restartable`` — the session server for a test that kills/restarts it (``kill()``,
  ``start()``, ``restart()``); it is running again and empty afterwards.
* ``moto`` (module) — a running :class:`~kvmesh.harness.stores.MotoServer` (S3 on loopback).
* ``redis_server_factory`` — ``factory(unix_socket=False, password=None, extra_args=(), tls=None)``
  returns a *not yet started* server on a fresh port (for "Redis not there yet" tests; with
  ``unix_socket=True`` it also listens on ``server.unix_socket``; ``password`` is its
  ``requirepass``; ``extra_args`` more server options; ``tls`` serves TLS only, with those
  :class:`~kvmesh.harness.services.TlsFiles`); every one it made is killed at teardown.

A missing ``redis-server`` binary fails the Redis tests loudly; it never skips them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvmesh.harness import ports
from kvmesh.harness.services import RedisServer, TlsFiles
from kvmesh.harness.stores import MotoServer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _stall_dumps() -> Iterator[None]:
    """The test replicas write every thread's stack to their logs when their kvmesh threads
    all stop for 3 s (kvmesh.core.stallwatch): a CI stall is then on record, with its cause."""
    from kvmesh.harness import replicas

    replicas.STALL_DUMP_S = "3"
    yield
    replicas.STALL_DUMP_S = None


@pytest.fixture
def free_port() -> Callable[[], int]:
    return ports.free_port


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvmesh.router.testing import write_test_tokenizer

    return write_test_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    pytest.importorskip("vllm")
    from kvmesh.harness.model import DEFAULT_TINY_MODEL, PRESETS, make_tiny

    # Same arguments -> same files: a model an earlier session built is reused as is.
    return make_tiny(out_dir=ROOT / DEFAULT_TINY_MODEL, **PRESETS["tiny"]).resolve()


def _require_redis() -> None:
    if not RedisServer.available():
        pytest.fail(
            "redis-server not found on PATH or in /usr/bin, /usr/local/bin; "
            "install it (apt-get install -y redis-server) to run the Redis tests",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    _require_redis()
    server = RedisServer(workdir=tmp_path_factory.mktemp("redis"))
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
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    _require_redis()
    made: list[RedisServer] = []

    def factory(
        unix_socket: bool = False,
        password: str | None = None,
        extra_args: tuple[str, ...] = (),
        tls: TlsFiles | None = None,
    ) -> RedisServer:
        server = RedisServer(
            unix_socket=unix_socket,
            workdir=tmp_path / f"redis-{len(made)}",
            password=password,
            extra_args=extra_args,
            tls=tls,
        )
        made.append(server)
        return server

    try:
        yield factory
    finally:
        for server in made:
            server.kill()


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path_factory.mktemp("moto"))
    server.start()
    yield server
    server.kill()
