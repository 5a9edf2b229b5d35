"""The engine admin API (kvmesh.admin.server) over real loopback HTTP, on a bare CacheEngine
with a disk tier (file://) and a shared remote tier (faulty://, a mem:// with fault hooks)."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from kvmesh import CacheConfig, CacheEngine, KVLayout
from kvmesh.admin.server import AdminServer, start_admin
from kvmesh.tiers.testing import reset_memory_stores

LAYOUT = KVLayout(2, 2, 8, torch.float32)
CS = 16
TOKEN = "s3cret-token"
PREFIX = "/kvmesh/admin/v1/"


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 32000 for i in range(n)]


def kv_for(tokens: list[int]) -> torch.Tensor:
    prefix = torch.tensor(np.cumsum(np.asarray(tokens, dtype=np.int64)) % 9973, dtype=torch.float32)
    n = len(tokens)
    kv = prefix.view(1, 1, n, 1, 1).expand(LAYOUT.shape(n)).clone()
    kv += torch.arange(8).view(1, 1, 1, 1, 8) / 64
    return kv


@pytest.fixture(autouse=True)
def _fresh_stores() -> Iterator[None]:
    reset_memory_stores()
    yield
    reset_memory_stores()


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator[Callable[..., CacheEngine]]:
    engines: list[CacheEngine] = []

    def make(disk: bool = True, remote: str | None = "faulty", **cfg: Any) -> CacheEngine:
        cfg.setdefault("chunk_size", CS)
        cfg.setdefault("max_local_cpu_size", 64 * CS * LAYOUT.bytes_per_token / 1024**3)
        if disk:
            cfg.setdefault("local_disk", str(tmp_path / f"disk-{len(engines)}"))
            cfg.setdefault("max_local_disk_size", 0)
        if remote:
            cfg.setdefault("remote_url", f"{remote}://r{uuid.uuid4().hex[:10]}")
        eng = CacheEngine(CacheConfig.from_dict(cfg), layout=LAYOUT, model_id="m")
        engines.append(eng)
        return eng

    yield make
    for e in engines:
        e.close(timeout=10)


@pytest.fixture
def engine(make_engine: Callable[..., CacheEngine]) -> CacheEngine:
    return make_engine()


@pytest.fixture
def admin(engine: CacheEngine) -> Iterator[AdminServer]:
    with AdminServer(engine, token=TOKEN) as server:
        yield server


def call(
    server: AdminServer, op: str, body: Any = None, token: str | None = TOKEN, method: str = "POST"
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, server.url + PREFIX + op, json=body, headers=headers, timeout=10)


def ok(server: AdminServer, op: str, body: Any = None) -> dict[str, Any]:
    resp = call(server, op, body)
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    return data


def stored(engine: CacheEngine, toks: list[int]) -> None:
    engine.store(toks, kv_for(toks))
    assert engine.wait_for_writes(10)


# -- operations ------------------------------------------------------------------------------------
def test_lookup_per_tier(engine: CacheEngine, admin: AdminServer) -> None:
    toks = prompt(40, 1)
    assert ok(admin, "lookup", {"tokens": toks})["hit_tokens"] == 0
    stored(engine, toks)
    engine.clear("disk", toks, force=True)  # disk loses both chunks
    data = ok(admin, "lookup", {"tokens": toks})
    assert data["tokens"] == 40
    assert data["hit_tokens"] == 32
    assert data["tiers"] == {"cpu": {"tokens": 32}, "disk": {"tokens": 0}, "remote": {"tokens": 32}}
    # a prompt sharing the first chunk only
    other = toks[:16] + prompt(24, 9)
    assert ok(admin, "lookup", {"tokens": other})["tiers"]["cpu"] == {"tokens": 16}


def test_lookup_reports_a_failing_tier_per_tier(engine: CacheEngine, admin: AdminServer) -> None:
    toks = prompt(32, 2)
    stored(engine, toks)
    engine.lower["remote"].down = True  # type: ignore[attr-defined]
    data = ok(admin, "lookup", {"tokens": toks})
    assert data["tiers"]["cpu"] == {"tokens": 32}
    assert "error" in data["tiers"]["remote"]
    assert ok(admin, "health")["tiers"]["remote"] == "down"


def test_clear_one_tier_leaves_the_others(engine: CacheEngine, admin: AdminServer) -> None:
    toks = prompt(48, 3)
    stored(engine, toks)
    assert ok(admin, "clear", {"tier": "cpu"})["cleared"] == {"cpu": 3}
    tiers = ok(admin, "lookup", {"tokens": toks})["tiers"]
    assert tiers == {"cpu": {"tokens": 0}, "disk": {"tokens": 48}, "remote": {"tokens": 48}}
    # only the chunks of given tokens
    other = prompt(32, 4)
    stored(engine, other)
    assert ok(admin, "clear", {"tokens": other, "tier": "disk"})["cleared"] == {"disk": 2}
    assert engine.lookup(toks) == 48
    # everything
    cleared = ok(admin, "clear", {})["cleared"]
    assert cleared["cpu"] == 2 and cleared["disk"] == 3 and cleared["remote"] >= 3
    assert engine.lookup(toks) == 0 and engine.lookup(other) == 0


def test_pin_survives_clear_unless_forced(engine: CacheEngine, admin: AdminServer) -> None:
    toks = prompt(32, 5)
    stored(engine, toks)
    assert ok(admin, "pin", {"tokens": toks}) == {"chunks": 2, "tiers": ["cpu", "disk"]}
    cleared = ok(admin, "clear", {"tier": "cpu"})["cleared"]
    assert cleared == {"cpu": 0}
    assert ok(admin, "clear", {"tier": "disk"})["cleared"] == {"disk": 0}
    assert ok(admin, "unpin", {"tokens": toks}) == {"chunks": 2, "tiers": ["cpu", "disk"]}
    assert ok(admin, "clear", {"tier": "cpu"})["cleared"] == {"cpu": 2}
    # pinned only in cpu; force drops it anyway
    stored(engine, toks)
    assert ok(admin, "pin", {"tokens": toks, "tier": "cpu"})["tiers"] == ["cpu"]
    assert ok(admin, "clear", {"tier": "cpu", "force": True})["cleared"] == {"cpu": 2}


def test_pin_in_a_tier_without_pins_or_absent(make_engine: Callable[..., CacheEngine]) -> None:
    eng = make_engine(disk=False)
    with AdminServer(eng, token=TOKEN) as server:
        assert ok(server, "pin", {"tokens": prompt(16, 1)})["tiers"] == ["cpu"]
        resp = call(server, "pin", {"tokens": prompt(16, 1), "tier": "disk"})
        assert resp.status_code == 422
        assert resp.json()["error"]["field"] == "tier"


def test_move_to_disk_and_back(engine: CacheEngine, admin: AdminServer) -> None:
    toks = prompt(32, 6)
    stored(engine, toks)
    engine.clear("disk", toks, force=True)
    data = ok(admin, "move", {"tokens": toks, "tier": "disk"})
    assert data == {"tier": "disk", "bytes_moved": 32 * LAYOUT.bytes_per_token}
    tiers = ok(admin, "lookup", {"tokens": toks})["tiers"]
    assert tiers["cpu"] == {"tokens": 0} and tiers["disk"] == {"tokens": 32}
    n, kv = engine.retrieve(toks)  # promotes back to cpu
    assert n == 32 and torch.equal(kv, kv_for(toks))
    engine.clear("cpu", force=True)
    assert ok(admin, "move", {"tokens": toks, "tier": "cpu"})["bytes_moved"] == 32 * LAYOUT.bytes_per_token
    assert ok(admin, "lookup", {"tokens": toks})["tiers"]["cpu"] == {"tokens": 32}


def test_compress_and_decompress_disk(engine: CacheEngine, admin: AdminServer) -> None:
    toks = prompt(64, 7)
    stored(engine, toks)
    data = ok(admin, "compress", {"tokens": toks, "codec": "zstd", "tier": "disk"})
    disk = data["tiers"]["disk"]
    assert disk["after"] < disk["before"]
    assert data["before"] == disk["before"] and data["after"] == disk["after"]
    engine.clear("cpu", force=True)
    n, kv = engine.retrieve(toks)
    assert n == 64 and torch.equal(kv, kv_for(toks))  # read back from the zstd files
    back = ok(admin, "decompress", {"tokens": toks, "tier": "disk"})["tiers"]["disk"]
    assert back["before"] == disk["after"] and back["after"] == disk["before"]
    engine.clear("cpu", force=True)
    assert torch.equal(engine.retrieve(toks)[1], kv_for(toks))


def test_compress_cpu_is_a_reported_no_op_and_mem_tier_says_it_cannot(
    engine: CacheEngine, admin: AdminServer
) -> None:
    toks = prompt(32, 8)
    stored(engine, toks)
    cpu = ok(admin, "compress", {"tokens": toks, "tier": "cpu"})["tiers"]["cpu"]
    assert cpu["before"] == cpu["after"] == 2 * CS * LAYOUT.bytes_per_token
    assert "raw" in cpu["note"]
    tiers = ok(admin, "compress", {"tokens": toks})["tiers"]  # every lower tier
    assert set(tiers) == {"disk", "remote"}
    assert "cannot re-encode" in tiers["remote"]["error"]
    assert tiers["disk"]["after"] < tiers["disk"]["before"]


def test_health(engine: CacheEngine, admin: AdminServer) -> None:
    stored(engine, prompt(32, 9))
    data = ok(admin, "health")
    assert data["tiers"] == {"cpu": "up", "disk": "up", "remote": "up"}
    assert data["pool"]["used_bytes"] == 2 * CS * LAYOUT.bytes_per_token
    assert 0 < data["pool"]["used_fraction"] < 1
    assert data["write_queue"] == {"disk": 0, "remote": 0}
    assert data["model_id"] == "m" and data["chunk_size"] == CS
    assert call(admin, "health", method="GET").status_code == 200


def test_check_finish_waits_for_queued_writes(engine: CacheEngine, admin: AdminServer) -> None:
    engine.lower["remote"].latency_s = 0.3  # type: ignore[attr-defined]
    toks = prompt(64, 10)
    t0 = time.monotonic()
    engine.store(toks, kv_for(toks))
    now = ok(admin, "check_finish", {})
    assert now["finished"] is False and now["tiers"]["remote"] is False
    short = ok(admin, "check_finish", {"wait": True, "timeout_s": 0.05})
    assert short["finished"] is False
    done = ok(admin, "check_finish", {"wait": True, "timeout_s": 30})
    assert done["finished"] is True and done["pending"] == {"disk": 0, "remote": 0}
    # it waited for the remote write, which cannot land before its 0.3 s (measured from the
    # store: on a loaded machine the calls before can take most of it, and did)
    assert time.monotonic() - t0 >= 0.3
    assert engine.lower["remote"].contains(engine.keys.keys(toks)) == [True] * 4


def test_stats(engine: CacheEngine, admin: AdminServer) -> None:
    toks = prompt(32, 11)
    stored(engine, toks)
    engine.lookup(toks)
    engine.retrieve(toks)
    tiers = ok(admin, "stats")["tiers"]
    assert {"cpu", "disk", "remote", "engine"} <= set(tiers)
    for name in ("cpu", "disk", "remote"):
        for counter in ("hits", "misses", "bytes_in", "evictions", "corrupt"):
            assert counter in tiers[name]
    assert tiers["cpu"]["hits"] >= 2
    assert tiers["disk"]["stores"] == 2


def test_stats_hooks_and_on_clear(engine: CacheEngine) -> None:
    cleared: list[int] = []
    with AdminServer(
        engine, token=TOKEN, on_clear=lambda: cleared.append(1), extra_stats=lambda: {"connector": {"x": 1}}
    ) as server:
        assert ok(server, "stats")["connector"] == {"x": 1}
        ok(server, "clear", {"tier": "cpu"})
        assert cleared == [1]


def test_openapi_lists_every_operation(admin: AdminServer) -> None:
    doc = call(admin, "openapi.json", method="GET").json()
    assert doc["openapi"].startswith("3.")
    ops = {p.removeprefix(PREFIX) for p in doc["paths"]}
    assert ops == {
        "lookup", "clear", "pin", "unpin", "move", "compress", "decompress", "health", "check_finish",
        "stats", "held",
    }  # fmt: skip


# -- auth --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["clear", "pin", "unpin", "move", "compress", "decompress"])
def test_mutating_ops_need_the_token(engine: CacheEngine, admin: AdminServer, op: str) -> None:
    toks = prompt(32, 12)
    stored(engine, toks)
    body = {"tokens": toks, "tier": "disk"}
    for token in (None, "wrong"):
        resp = call(admin, op, body, token=token)
        assert resp.status_code == 401
        assert resp.content == b""
    assert engine.lookup(toks) == 32


def test_no_token_configured_refuses_mutations(engine: CacheEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVMESH_ADMIN_TOKEN", raising=False)
    with AdminServer(engine) as server:
        assert call(server, "clear", {}, token=None).status_code == 401
        assert call(server, "clear", {}, token="anything").status_code == 401
        assert call(server, "health", token=None).status_code == 200


def test_token_from_config_and_env(
    make_engine: Callable[..., CacheEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    with AdminServer(make_engine(admin_token="from-config")) as server:
        assert call(server, "clear", {}, token="from-config").status_code == 200
    monkeypatch.setenv("KVMESH_ADMIN_TOKEN", "from-env")
    with AdminServer(make_engine()) as server:
        assert call(server, "clear", {}, token="from-env").status_code == 200


def _non_loopback_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            addr = str(s.getsockname()[0])
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def test_read_only_ops_need_the_token_off_loopback(engine: CacheEngine) -> None:
    with AdminServer(engine, host="0.0.0.0", token=TOKEN) as server:
        assert not server.loopback
        url = f"http://127.0.0.1:{server.port}"
        for op in ("health", "stats", "openapi.json", "no-such-op"):
            resp = httpx.post(url + PREFIX + op, json={}, timeout=10)
            assert resp.status_code == 401 and resp.content == b"", op
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.post(url + PREFIX + "health", json={}, headers=auth, timeout=10).status_code == 200
        assert httpx.post(url + PREFIX + "no-such-op", json={}, headers=auth, timeout=10).status_code == 404


def test_unknown_path_is_404_with_the_token_401_without(admin: AdminServer) -> None:
    assert call(admin, "nope", {}).status_code == 404
    assert call(admin, "nope", {}, token=None).status_code == 401
    assert (
        httpx.get(admin.url + "/elsewhere", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404
    )


def test_a_path_urlsplit_refuses_is_404_not_a_dropped_connection(admin: AdminServer) -> None:
    """An absolute-form target with an unclosed IPv6 bracket makes ``urlsplit`` raise: an
    answer, not a crash."""
    host, port = admin.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        head = f"GET http://[x/kvmesh HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
        s.sendall(head.encode())
        status_line = s.makefile("rb").readline()
    assert status_line.split()[1] == b"404", status_line


def test_every_op_needs_the_configured_token_even_on_loopback(
    engine: CacheEngine, admin: AdminServer
) -> None:
    """A loopback ``lookup`` used to answer without the token: any local user could test
    whether another tenant's prompt is cached."""
    toks = prompt(32, 21)
    stored(engine, toks)
    assert admin.loopback
    for op in ("lookup", "health", "stats", "check_finish", "held", "openapi.json"):
        for token in (None, "wrong"):
            resp = call(admin, op, {"tokens": toks} if op == "lookup" else {}, token=token)
            assert resp.status_code == 401 and resp.content == b"", (op, token)
    assert ok(admin, "lookup", {"tokens": toks})["hit_tokens"] == 32


def test_mutating_op_over_get_is_405(admin: AdminServer) -> None:
    assert call(admin, "clear", None, method="GET").status_code == 405


# -- bad bodies --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("op", "body", "field"),
    [
        ("lookup", {"tokens": [1, -2]}, "tokens.1"),
        ("lookup", {"tokens": [1, "2"]}, "tokens.1"),
        ("lookup", {"tokens": [1, 2**32]}, "tokens.1"),
        ("lookup", {"tokens": "1 2 3"}, "tokens"),
        ("lookup", {}, "tokens"),
        ("lookup", {"tokens": [1], "tokenz": [1]}, "tokenz"),
        ("lookup", [1, 2, 3], "body"),
        ("clear", {"tier": "gpu"}, "tier"),
        ("clear", {"force": "yes"}, "force"),
        ("move", {"tokens": [1, 2]}, "tier"),
        ("compress", {"tokens": [1], "codec": "lz4"}, "codec"),
        ("check_finish", {"wait": True, "timeout_s": -1}, "timeout_s"),
        ("check_finish", {"wait": True, "timeout_s": 1e9}, "timeout_s"),
        ("pin", {"tokens": [1], "tier": "remote"}, "tier"),
    ],
)
def test_bad_bodies_are_422_naming_the_field(admin: AdminServer, op: str, body: Any, field: str) -> None:
    resp = call(admin, op, body)
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["field"] == field


def test_invalid_json_is_422(admin: AdminServer) -> None:
    resp = httpx.post(
        admin.url + PREFIX + "lookup",
        content=b"{not json",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    assert resp.status_code == 422
    assert resp.json()["error"]["field"] == "body"


def test_tier_the_engine_lacks_is_422(make_engine: Callable[..., CacheEngine]) -> None:
    eng = make_engine(disk=False, remote=None)
    with AdminServer(eng, token=TOKEN) as server:
        for op, body in (
            ("clear", {"tier": "disk"}),
            ("move", {"tokens": prompt(16, 1), "tier": "remote"}),
            ("compress", {"tokens": prompt(16, 1), "tier": "disk"}),
        ):
            resp = call(server, op, body)
            assert resp.status_code == 422 and resp.json()["error"]["field"] == "tier", op


# -- lifecycle ---------------------------------------------------------------------------------------
def test_start_admin_is_off_by_default_in_the_library(make_engine: Callable[..., CacheEngine]) -> None:
    assert start_admin(make_engine(), default_on=False) is None
    assert start_admin(make_engine(admin_enabled=False), default_on=True) is None
    server = start_admin(make_engine(admin_enabled=True), default_on=False)
    assert server is not None
    try:
        assert call(server, "health", method="GET", token=None).status_code == 200  # no token set
    finally:
        server.stop()


def test_start_admin_on_a_busy_port_does_not_raise(make_engine: Callable[..., CacheEngine]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert start_admin(make_engine(admin_port=port), default_on=True) is None


def test_config_keys_round_trip_from_env() -> None:
    cfg = CacheConfig.from_env(
        {"KVMESH_ADMIN_TOKEN": "123", "KVMESH_ADMIN_PORT": "9999", "KVMESH_CONTROLLER_URL": "http://r:8080"}
    )
    assert cfg.admin_token == "123" and cfg.admin_port == 9999 and cfg.controller_url == "http://r:8080"
    assert "123" not in repr(cfg)
