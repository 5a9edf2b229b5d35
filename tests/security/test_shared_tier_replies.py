"""A hostile server behind a ``redis://`` URL: replies of the wrong shape to the tier's reads.

The Redis tier reads a batch of chunks with one ``HGETALL`` per chunk, each reply decoded as
it arrives (:func:`kvmesh.tiers.redis_wire.each_hash`). A real Redis answers ``HGETALL`` with
a map (an even-length array); anything else is what a hostile or broken server sends. Fault
injection: the server is the test's own (a socket thread answering RESP), since no real
Redis sends these; the client's requests are parsed with hiredis, not by hand. Each
malformed reply must be that key's miss, counted as an error, with nothing raised and the
connection in step for the next batch."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import hiredis
import numpy as np
import pytest

from kvmesh.core.keys import KeyBuilder, KVLayout
from kvmesh.metrics import TierMetrics
from kvmesh.tiers.base import TierOptions, open_tier
from kvmesh.tiers.redis import RedisTier

KB = KeyBuilder("m", KVLayout(2, 2, 8, "float32"), chunk_size=16)
# HGETALL answers, one per key of a batch, none of them a hash.
MALFORMED = [
    b"*1\r\n$1\r\nh\r\n",  # an odd-length array: a field without its value
    b"$3\r\nabc\r\n",  # a string
    b":5\r\n",  # an integer
    b"*2\r\n*0\r\n*0\r\n",  # an array of arrays
    b"%1\r\n$1\r\nh\r\n:5\r\n",  # a map whose header is an integer
    b"%2\r\n$1\r\nh\r\n$3\r\nabc\r\n$1\r\nn\r\n*0\r\n",  # a map whose part count is an array
    b"%1\r\n:1\r\n:2\r\n",  # a map of integers
    b"*0\r\n",  # an empty hash: an absent key (a plain miss, no error)
]


class _HostileRedis:
    """Answers HELLO as a RESP3 server (redis-py 8's default), PING with PONG, HGETALL with the next of
    ``answers`` (cycling), anything else with OK; counts the HGETALLs it answered."""

    def __init__(self, answers: list[bytes]) -> None:
        self.answers = answers
        self.hgetalls = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = hiredis.Reader()
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                reader.feed(data)
                while (cmd := reader.gets()) is not False:
                    name = bytes(cmd[0]).upper()
                    if name == b"HGETALL":
                        conn.sendall(self.answers[self.hgetalls % len(self.answers)])
                        self.hgetalls += 1
                    elif name == b"HELLO":  # redis-py's handshake: a RESP3 map naming the protocol
                        conn.sendall(b"%1\r\n$5\r\nproto\r\n:3\r\n")
                    else:
                        conn.sendall(b"+PONG\r\n" if name == b"PING" else b"+OK\r\n")

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


@pytest.fixture
def hostile() -> Iterator[tuple[_HostileRedis, RedisTier]]:
    server = _HostileRedis(MALFORMED)
    opts = TierOptions(name="remote", metrics=TierMetrics("remote"), timeout_s=2.0, probe_interval_s=0.1)
    tier = open_tier(f"redis://127.0.0.1:{server.port}/0", opts)
    assert isinstance(tier, RedisTier)
    yield server, tier
    tier.close()
    server.close()


def test_replies_that_are_not_a_hash_are_misses_and_the_stream_stays_in_step(
    hostile: tuple[_HostileRedis, RedisTier],
) -> None:
    server, tier = hostile
    keys = KB.keys(np.arange(16 * len(MALFORMED), dtype=np.uint32))
    into = bytearray(1 << 20)
    for batch in (1, 2):  # the second batch reads its own replies: nothing was left unread
        assert tier.get(keys, into=lambda n: memoryview(into)[:n]) == [None] * len(keys)
        assert server.hgetalls == batch * len(MALFORMED)
    snap = tier.metrics.snapshot()
    assert snap["errors"] == 2 * (len(MALFORMED) - 1)  # every shape but the empty hash
    assert snap["hits"] == 0 and snap["corrupt"] == 0
    assert tier.health() == "up"  # wrong answers are not an outage
