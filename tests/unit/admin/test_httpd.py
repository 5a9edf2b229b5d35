"""Hostile clients against the engine admin API (real loopback sockets, a real CacheEngine):
slowloris heads, idle connections, oversized and malformed bodies, wrong tokens. Each gets a
4xx or a closed connection, and a legitimate call still answers within 1 s meanwhile. Also
the tenant boundary of ``lookup`` (``cache_salt``) and the ``held`` page."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from kvmesh import CacheConfig, CacheEngine, KVLayout
from kvmesh.admin.httpd import BoundedHandler, BoundedHTTPServer, Limits
from kvmesh.admin.server import AdminServer
from kvmesh.tiers.testing import reset_memory_stores

LAYOUT = KVLayout(2, 2, 8, torch.float32)
CS = 16
TOKEN = "limits-token"
PREFIX = "/kvmesh/admin/v1/"
LIMITS = Limits(max_connections=8, head_timeout_s=1.0, body_timeout_s=1.0, max_head_bytes=4096)


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 32000 for i in range(n)]


def kv_for(tokens: list[int]) -> torch.Tensor:
    base = torch.tensor(np.cumsum(np.asarray(tokens, dtype=np.int64)) % 9973, dtype=torch.float32)
    return base.view(1, 1, len(tokens), 1, 1).expand(LAYOUT.shape(len(tokens))).clone()


def engine(tmp: Path, remote: str, **cfg: Any) -> CacheEngine:
    conf = {
        "chunk_size": CS,
        "max_local_cpu_size": 64 * CS * LAYOUT.bytes_per_token / 1024**3,
        "remote_url": remote,
        **cfg,
    }
    return CacheEngine(CacheConfig.from_dict(conf), layout=LAYOUT, model_id="m")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[AdminServer, CacheEngine]]:
    reset_memory_stores()
    eng = engine(tmp_path, f"mem://l{uuid.uuid4().hex[:8]}")
    toks = prompt(32, 1)
    eng.store(toks, kv_for(toks))
    assert eng.wait_for_writes(10)
    server = AdminServer(eng, token=TOKEN, limits=LIMITS).start()
    try:
        yield server, eng
    finally:
        server.stop()
        eng.close(timeout=10)
        reset_memory_stores()


def legit(server: AdminServer) -> float:
    """Seconds a real lookup takes; asserts it answered correctly."""
    t0 = time.monotonic()
    resp = httpx.post(
        server.url + PREFIX + "lookup",
        json={"tokens": prompt(32, 1)},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=5,
    )
    assert resp.status_code == 200 and resp.json()["hit_tokens"] == 32, resp.text
    return time.monotonic() - t0


def connect(server: AdminServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    return s


def closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closes ``s`` within ``seconds``; what it sent before."""
    s.settimeout(seconds)
    got = b""
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return True, got
            got += chunk
    except ConnectionResetError:
        return True, got
    except TimeoutError:
        return False, got


def raw_request(server: AdminServer, head: str, body: bytes = b"") -> tuple[int, bytes]:
    s = connect(server)
    try:
        s.sendall(head.encode() + body)
        _, got = closed_within(s, 5.0)
    finally:
        s.close()
    status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/") else 0
    return status, got


def test_slowloris_heads_are_cut_off_and_a_real_call_still_answers(
    served: tuple[AdminServer, CacheEngine],
) -> None:
    server, _ = served
    stop = threading.Event()
    socks = [connect(server) for _ in range(LIMITS.max_connections + 4)]  # more than the slots

    def drip(s: socket.socket) -> None:
        line = b"POST /kvmesh/admin/v1/lookup HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
        for b in line:
            if stop.is_set():
                return
            try:
                s.send(bytes([b]))
            except OSError:
                return
            time.sleep(0.1)

    threads = [threading.Thread(target=drip, args=(s,), daemon=True) for s in socks]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        worst = max(legit(server) for _ in range(5))
        assert worst < 1.0, f"a legitimate call took {worst:.2f}s beside slowloris clients"
        t0 = time.monotonic()
        for s in socks:
            closed, _ = closed_within(s, LIMITS.head_timeout_s + 2.0 - (time.monotonic() - t0))
            assert closed, "a slowloris connection outlived the head deadline"
    finally:
        stop.set()
        for s in socks:
            s.close()
    assert legit(server) < 1.0


def test_idle_connections_are_closed_and_do_not_starve_callers(
    served: tuple[AdminServer, CacheEngine],
) -> None:
    server, _ = served
    idle = [connect(server) for _ in range(3 * LIMITS.max_connections)]
    try:
        time.sleep(0.2)
        assert legit(server) < 1.0
        for s in idle:
            assert closed_within(s, LIMITS.head_timeout_s + 2.0)[0]
    finally:
        for s in idle:
            s.close()


def test_wrong_token_is_refused_before_the_body_is_read(served: tuple[AdminServer, CacheEngine]) -> None:
    """The old server read (up to 64 MiB of) the body first: a declared-but-unsent body hung it."""
    server, _ = served
    for auth in ("", "Authorization: Bearer wrong\r\n"):
        t0 = time.monotonic()
        head = f"POST {PREFIX}lookup HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 1000000000\r\n\r\n"
        status, _ = raw_request(server, head)
        assert status == 401 and time.monotonic() - t0 < 1.0
    assert legit(server) < 1.0


@pytest.mark.parametrize(
    ("extra", "body", "status"),
    [
        ("Content-Length: 1000000000\r\n", b"", 413),  # over max_body_bytes: refused unread
        ("Content-Length: nope\r\n", b"", 400),
        ("Content-Length: -5\r\n", b"", 400),
        ("Transfer-Encoding: chunked\r\n", b"5\r\n{}\r\n0\r\n\r\n", 411),
        ("Content-Length: 9\r\n", b"{not json", 422),
        ("Content-Length: 2\r\n", b"[]", 422),
        ("Content-Length: 22\r\n", b'{"tokens": [1, "two"]}', 422),
        ("X-Big: " + "h" * 5000 + "\r\n", b"", 431),  # over max_head_bytes
    ],
)
def test_bad_requests_get_a_4xx(
    served: tuple[AdminServer, CacheEngine], extra: str, body: bytes, status: int
) -> None:
    server, _ = served
    head = f"POST {PREFIX}lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n{extra}\r\n"
    got, raw = raw_request(server, head, body)
    assert got == status, raw[:300]
    if status in (400, 413, 422):
        assert b'"field"' in raw  # the rejection names what was wrong
    assert legit(server) < 1.0


def test_request_line_over_the_head_budget_is_431(served: tuple[AdminServer, CacheEngine]) -> None:
    server, _ = served
    status, _ = raw_request(server, f"GET {PREFIX}health?{'q' * 8000} HTTP/1.1\r\n\r\n")
    assert status == 431


def test_a_stalled_body_is_cut_off(served: tuple[AdminServer, CacheEngine]) -> None:
    server, _ = served
    s = connect(server)
    try:
        auth = f"Authorization: Bearer {TOKEN}\r\n"
        head = f"POST {PREFIX}lookup HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 100\r\n\r\n"
        s.sendall(head.encode() + b'{"tokens": [')
        t0 = time.monotonic()
        closed, _ = closed_within(s, LIMITS.body_timeout_s + 2.0)
        assert closed and time.monotonic() - t0 < LIMITS.body_timeout_s + 2.0
    finally:
        s.close()
    assert legit(server) < 1.0


def test_keep_alive_still_works(served: tuple[AdminServer, CacheEngine]) -> None:
    server, _ = served
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5) as client:
        for _ in range(5):
            assert client.post(server.url + PREFIX + "health", json={}).status_code == 200


# -- tenants ----------------------------------------------------------------------------------------
def test_lookup_sees_only_the_callers_salt(tmp_path: Path) -> None:
    """The old lookup hashed with the engine's salt whatever the caller was: anyone could test
    whether a salted tenant's prompt was cached."""
    reset_memory_stores()
    remote = f"mem://s{uuid.uuid4().hex[:8]}"
    a = engine(tmp_path, remote, cache_salt="tenant-a")
    b = engine(tmp_path, remote, cache_salt="tenant-b")
    toks = prompt(32, 5)
    a.store(toks, kv_for(toks))
    other = prompt(48, 6)
    b.store(other, kv_for(other))
    assert a.wait_for_writes(10) and b.wait_for_writes(10)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with AdminServer(a, token=TOKEN) as server:

            def look(tokens: list[int], salt: str | None) -> dict[str, Any]:
                body: dict[str, Any] = {"tokens": tokens}
                if salt is not None:
                    body["cache_salt"] = salt
                resp = httpx.post(server.url + PREFIX + "lookup", json=body, headers=auth, timeout=5)
                assert resp.status_code == 200, resp.text
                data: dict[str, Any] = resp.json()
                return data

            assert look(toks, "tenant-a")["hit_tokens"] == 32
            for salt in (None, "tenant-b", "guess"):
                data = look(toks, salt)
                assert data["hit_tokens"] == 0 and data["tiers"]["cpu"] == {"tokens": 0}, salt
            # tenant b's own chunks, in the shared remote tier, are visible to tenant b only
            theirs = look(other, "tenant-b")
            assert theirs["hit_tokens"] == 48 and theirs["tiers"] == {
                "cpu": {"tokens": 0},
                "remote": {"tokens": 48},
            }
            assert look(other, "tenant-a")["hit_tokens"] == 0
            resp = httpx.post(
                server.url + PREFIX + "lookup",
                json={"tokens": toks, "cache_salt": 7},
                headers=auth,
                timeout=5,
            )
            assert resp.status_code == 422 and resp.json()["error"]["field"] == "cache_salt"
    finally:
        a.close(timeout=10)
        b.close(timeout=10)
        reset_memory_stores()


def test_held_pages_come_from_the_source_and_are_bounded(served: tuple[AdminServer, CacheEngine]) -> None:
    server, eng = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    url = server.url + PREFIX + "held"
    assert httpx.post(url, json={}, headers=auth).json()["events"] == []
    calls: list[tuple[int, int]] = []

    def source(cursor: int, limit: int) -> dict[str, Any]:
        calls.append((cursor, limit))
        return {"events": [{"i": i} for i in range(cursor, min(cursor + limit, 5))], "next": None}

    with AdminServer(eng, token=TOKEN, held=source) as other:
        data = httpx.post(other.url + PREFIX + "held", json={"cursor": 2, "limit": 2}, headers=auth).json()
        assert data["events"] == [{"i": 2}, {"i": 3}] and calls == [(2, 2)]
        resp = httpx.post(other.url + PREFIX + "held", json={"limit": 10**6}, headers=auth)
        assert resp.status_code == 422 and resp.json()["error"]["field"] == "limit"


class _Hello(BoundedHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"hi")


def test_a_stop_wakes_the_serving_loop_at_once() -> None:
    """shutdown() wakes the loop instead of waiting for its next look at the stop flag
    (socketserver's loop looks every 0.5 s: each admin server's stop cost up to that). With
    a 30 s poll interval, the server answers, and a stop still returns at once; a stop
    before the loop started leaves it nothing to run."""
    server = BoundedHTTPServer(("127.0.0.1", 0), _Hello, Limits())
    loop = threading.Thread(target=server.serve_forever, args=(30.0,), daemon=True)
    loop.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    assert httpx.get(url, timeout=5).text == "hi"
    t0 = time.monotonic()
    server.shutdown()
    stopped_s = time.monotonic() - t0
    server.server_close()
    loop.join(5)
    assert not loop.is_alive() and stopped_s < 5.0, stopped_s

    early = BoundedHTTPServer(("127.0.0.1", 0), _Hello, Limits())
    early.shutdown()  # returns: nothing is serving
    done = threading.Thread(target=early.serve_forever, args=(30.0,), daemon=True)
    done.start()
    done.join(5)
    early.server_close()
    assert not done.is_alive()
