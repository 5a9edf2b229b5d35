"""A hostile or broken server behind an ``s3://`` URL: answers that never end.

botocore gives every socket read a fresh ``read_timeout``, so an answer dripped a few bytes at
a time never times out, and ``Body.read()`` reads whatever length the server declares. A read
must cost at most its budget (``remote_timeout_s``) whatever the server does, and take no more
than the range it asked for. Fault injection: the server is the test's own (an
``http.server`` thread), since no real S3 server answers this way; moto's real one covers
the rest (``tests/integration/test_s3_tier.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from kvmesh.core.keys import KeyBuilder, KVLayout
from kvmesh.core.serde import ChunkFormat
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import TierOptions, open_tier
from kvmesh.tiers.s3 import S3Tier

KB = KeyBuilder("m", KVLayout(2, 2, 8, "float32"), chunk_size=16)
BUDGET_S = 1.0
OBJECT = 400_000_000  # what the server says the object is


class _Hostile(BaseHTTPRequestHandler):
    """HEAD (the breaker's probe): 200 at once. GET: ``self.server.answer(handler)``."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self.server.gets += 1
        self.close_connection = True
        try:
            self.server.answer(self)
        except OSError:  # the client hung up on it
            return


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, answer: Callable[[_Hostile], None]) -> None:
        super().__init__(("127.0.0.1", 0), _Hostile)
        self.answer, self.gets, self.sent = answer, 0, 0
        self.stop = threading.Event()  # ends every answer still going (the test's teardown)


def _ranged(handler: _Hostile, length: int | None = None) -> None:
    """The head of a 206 for the range asked (or a ``length`` of the server's own)."""
    first, last = map(int, handler.headers["Range"].split("=", 1)[1].split("-"))
    handler.send_response(206)
    handler.send_header("Content-Range", f"bytes {first}-{last}/{OBJECT}")
    handler.send_header("Content-Length", str(length if length is not None else last - first + 1))
    handler.end_headers()
    handler.wfile.flush()


def drip_body(handler: _Hostile) -> None:
    _ranged(handler)
    while not handler.server.stop.is_set():
        handler.wfile.write(b"x" * 8)
        handler.wfile.flush()
        time.sleep(0.02)


def drip_headers(handler: _Hostile) -> None:
    handler.wfile.write(b"HTTP/1.1 206 Partial Content\r\n")
    while not handler.server.stop.is_set():
        handler.wfile.write(b"X-Padding: 1\r\n")
        handler.wfile.flush()
        time.sleep(0.05)


def whole_object(handler: _Hostile) -> None:
    """Ignores the range: the whole 400 MB object, as fast as the socket takes it."""
    _ranged(handler, OBJECT)
    piece = b"\0" * (1 << 20)
    while not handler.server.stop.is_set():
        handler.wfile.write(piece)
        handler.server.sent += len(piece)


@pytest.fixture
def hostile(request: pytest.FixtureRequest) -> Iterator[tuple[_Server, S3Tier]]:
    server = _Server(request.param)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    fmt = ChunkFormat(layout=KB.layout)
    opts = TierOptions(name="remote", metrics=TierMetrics("remote"), timeout_s=BUDGET_S, retries=0,
                       probe_interval_s=0.1, chunk_size=16, chunk_format=fmt)  # fmt: skip
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    url = f"s3://b/p?endpoint_url={endpoint}&access_key_id=a&secret_access_key=b&region=us-east-1"
    tier = open_tier(url, opts)
    assert isinstance(tier, S3Tier)
    yield server, tier
    server.stop.set()  # a request the read left behind ends with its answer (close waits for it)
    tier.close()
    server.shutdown()
    server.server_close()


def _get(tier: S3Tier) -> tuple[list[object], float]:
    """One chunk's read in a thread, failing if it outlives 10 budgets (the old code: for as
    long as the server went on)."""
    out: list[list[object]] = []
    t0 = time.monotonic()
    reader = threading.Thread(
        target=lambda: out.append(list(tier.get(KB.keys(np.arange(16, dtype=np.uint32)))))
    )
    reader.daemon = True
    reader.start()
    reader.join(10 * BUDGET_S)
    took = time.monotonic() - t0
    assert not reader.is_alive(), f"the read still hangs after {took:.1f} s"
    return out[0], took


@pytest.mark.parametrize("hostile", [drip_body, drip_headers], indirect=True, ids=["body", "headers"])
def test_a_dripped_answer_costs_one_budget_and_opens_the_breaker(hostile: tuple[_Server, S3Tier]) -> None:
    server, tier = hostile
    got, took = _get(tier)
    assert got == [None] and took < BUDGET_S + 1.0, took  # slack for a loaded machine; the old code: for ever
    snap = tier.metrics.snapshot()
    assert snap["timeouts"] == 1 and snap["hits"] == 0 and snap["up"] == 0.0
    assert server.gets == 1


@pytest.mark.parametrize("hostile", [whole_object], indirect=True, ids=["ignores-range"])
def test_an_answer_longer_than_the_range_asked_is_not_read(hostile: tuple[_Server, S3Tier]) -> None:
    server, tier = hostile
    got, took = _get(tier)
    assert got == [None] and took < 2 * BUDGET_S, took
    time.sleep(0.2)  # the server notices the hang-up
    assert server.sent < 16 << 20, server.sent  # what the sockets' buffers took, not 400 MB
    snap = tier.metrics.snapshot()
    assert snap["errors"] == 1 and snap["corrupt"] == 0 and snap["up"] == 1.0  # an answer, not an outage
