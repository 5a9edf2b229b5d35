"""A hostile server behind a ``redis://`` URL: replies of the wrong shape to the tier's reads.

The Redis tier reads a batch of chunks with one ``HGETALL`` per chunk, each reply decoded as
it arrives (:func:`kvmesh.tiers.redis_wire.each_hash`). A real Redis answers ``HGETALL`` with
a map (an even-length array); anything else is what a hostile or broken server sends. Fault
injection: the server is the test's own (a socket thread answering RESP), since no real
Redis sends these; the client's requests are parsed with hiredis, not by hand. Each
malformed reply must be that key's miss, counted as an error, with nothing raised and the
connection in step for the next batch. A reply that never ends (dripped, or endless) is cut at
the operation's budget or at the tier's reply bound, whichever comes first. The same holds for
the answers of a ``redis-sentinel://`` URL's sentinels and a ``redis-cluster://`` seed's
slot map."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import hiredis
import numpy as np
import pytest

from kvmesh.core.keys import KeyBuilder, KVLayout
from kvmesh.core.serde import ChunkFormat
from kvmesh.harness.ports import free_port
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

    def __init__(
        self,
        answers: list[bytes | Callable[[socket.socket], None]],
        replies: dict[bytes, bytes | Callable[[socket.socket], None]] | None = None,
    ) -> None:
        self.answers = answers
        self.replies = replies or {}  # other commands' answers (CLUSTER, SENTINEL)
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
                        answer = self.answers[self.hgetalls % len(self.answers)]
                        self.hgetalls += 1
                        try:
                            answer(conn) if callable(answer) else conn.sendall(answer)
                        except OSError:  # the client hung up on it
                            return
                    elif name in self.replies:
                        reply = self.replies[name]
                        try:
                            reply(conn) if callable(reply) else conn.sendall(reply)
                        except OSError:
                            return
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


class _Endless:
    """A reply that never ends: ``head``, then ``piece`` after ``piece`` (every ``gap_s``) until
    the client hangs up; counts the bytes it got out."""

    def __init__(self, head: bytes, piece: bytes, gap_s: float = 0.0) -> None:
        self.head, self.piece, self.gap_s, self.sent = head, piece, gap_s, 0

    def __call__(self, conn: socket.socket) -> None:
        conn.sendall(self.head)
        while True:
            self.sent += conn.send(self.piece)
            if self.gap_s:
                time.sleep(self.gap_s)


def _options(timeout_s: float) -> TierOptions:
    fmt = ChunkFormat(layout=KB.layout)  # as the engine opens its tiers: the reply bound is the layout's
    return TierOptions(name="remote", metrics=TierMetrics("remote"), timeout_s=timeout_s, retries=0,
                       probe_interval_s=0.1, chunk_size=16, chunk_format=fmt)  # fmt: skip


def _open(server: _HostileRedis, timeout_s: float) -> RedisTier:
    tier = open_tier(f"redis://127.0.0.1:{server.port}/0", _options(timeout_s))
    assert isinstance(tier, RedisTier)
    return tier


def _get_within(tier: RedisTier, keys: list, limit_s: float) -> tuple[list, float]:
    """``tier.get(keys)`` in a thread, failing the test if it takes over ``limit_s`` (the old
    code held such a read for ever)."""
    out: list = []
    raised: list[BaseException] = []

    def read() -> None:
        try:
            out.append(tier.get(keys))
        except BaseException as exc:  # the load would get it
            raised.append(exc)

    t0 = time.monotonic()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(limit_s)
    took = time.monotonic() - t0
    assert not reader.is_alive(), f"the read still hangs after {took:.1f} s"
    assert not raised, f"the read raised {raised[0]!r}"
    return out[0], took


def test_a_dripped_reply_costs_one_budget_and_the_tier_recovers() -> None:
    """A server that sends a chunk's reply a few bytes every 20 ms never lets one socket read
    time out: redis-py capped only each read, and the load waited as long as the drip went on.
    Every read now waits at most the operation's time left."""
    drip = _Endless(b"%1\r\n$1\r\nh\r\n$1000000\r\n", b"x" * 8, gap_s=0.02)
    server = _HostileRedis([drip, *MALFORMED[-1:]])
    tier = _open(server, timeout_s=1.0)
    try:
        keys = KB.keys(np.arange(16, dtype=np.uint32))
        got, took = _get_within(tier, keys, 10.0)
        assert got == [None] and took < 1.0 + 1.0, took  # slack for a loaded machine; the old code: for ever
        assert tier.metrics.snapshot()["timeouts"] == 1
        time.sleep(0.5)  # the probe's PING is answered at once: the breaker closes
        assert tier.health() == "up"
        got, took = _get_within(tier, keys, 5.0)  # the next reply is read on a new connection
        assert got == [None] and took < 1.0 and server.hgetalls == 2
    finally:
        tier.close()
        server.close()


@pytest.mark.parametrize(
    "head, piece",
    [
        (b"%1\r\n$1\r\nh\r\n$400000000\r\n", b"\0" * 65536),  # one string of 400 MB
        (b"*100000000\r\n", b":1\r\n" * 16384),  # an array of 100 million integers
    ],
    ids=["string", "array"],
)
def test_an_endless_reply_is_cut_at_the_largest_chunk_of_the_layout(head: bytes, piece: bytes) -> None:
    """An endless reply (a string or array of hundreds of MB, sent as fast as the socket
    takes it) is cut once it passes the largest chunk the layout allows: the old code read it
    whole into memory, and a few such fields would have had the worker killed."""
    endless = _Endless(head, piece)
    server = _HostileRedis([endless])
    tier = _open(server, timeout_s=5.0)
    bound = RedisTier.max_reply_bytes(_options(5.0))
    try:
        got, took = _get_within(tier, KB.keys(np.arange(16, dtype=np.uint32)), 20.0)
        assert got == [None] and took < 5.0
        time.sleep(0.2)  # the server notices the hang-up
        # What got out: the bound, plus what the two kernels' socket buffers held.
        assert bound < 2 << 20 and endless.sent < bound + (16 << 20), (endless.sent, bound)
        snap = tier.metrics.snapshot()
        assert snap["errors"] == 1 and snap["hits"] == 0 and snap["corrupt"] == 0
    finally:
        tier.close()
        server.close()


SLOT_MAPS = {
    "not-a-list": b":5\r\n",
    "past-the-slots": b"*1\r\n*3\r\n:0\r\n:1000000000\r\n*2\r\n$9\r\n127.0.0.1\r\n:7000\r\n",
    "reversed": b"*1\r\n*3\r\n:9\r\n:3\r\n*2\r\n$9\r\n127.0.0.1\r\n:7000\r\n",
    "no-port": b"*1\r\n*3\r\n:0\r\n:5\r\n*1\r\n$9\r\n127.0.0.1\r\n",
    "bad-port": b"*1\r\n*3\r\n:0\r\n:5\r\n*2\r\n$9\r\n127.0.0.1\r\n:70000\r\n",
    "string-slots": b"*1\r\n*3\r\n$1\r\n0\r\n$1\r\n5\r\n*2\r\n$9\r\n127.0.0.1\r\n:7000\r\n",
}


@pytest.mark.parametrize("reply", SLOT_MAPS.values(), ids=SLOT_MAPS.keys())
def test_a_node_whose_slot_map_is_malformed_is_passed_over(
    reply: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """``redis-cluster://`` asks a seed for ``CLUSTER SLOTS``. An answer of the wrong shape
    raised out of the tier's constructor (the replica failed to start), and a range past the
    slot count built a list of 10^9 entries (15 GB in 40 s, then the OOM killer). Now such a
    node is said and passed over for the next seed, whose valid map is installed."""
    hostile = _HostileRedis([], {b"CLUSTER": reply})
    good_port = free_port()
    good = _HostileRedis([], {b"CLUSTER": _one_shard_map(good_port)})
    opts = TierOptions(name="remote", metrics=TierMetrics("remote"), timeout_s=1.0, probe_interval_s=0.1)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="kvmesh.tiers.redis_cluster"):
        tier = open_tier(f"redis-cluster://127.0.0.1:{hostile.port},127.0.0.1:{good.port}", opts)
    try:
        assert time.monotonic() - t0 < 2.0
        assert any("not a slot map" in r.getMessage() for r in caplog.records), caplog.text
        assert set(tier._slots) == {("127.0.0.1", good_port)}  # type: ignore[attr-defined]
    finally:
        tier.close()
        hostile.close()
        good.close()


def _one_shard_map(port: int) -> bytes:
    """Every slot on 127.0.0.1:``port`` (nothing need listen there: the test reads the map)."""
    return b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" % port


def _resp_map(fields: dict[str, str]) -> bytes:
    out = b"%%%d\r\n" % len(fields)
    for k, v in fields.items():
        for s in (k.encode(), v.encode()):
            out += b"$%d\r\n%s\r\n" % (len(s), s)
    return out


def _masters(port: int | str, **extra: str) -> bytes:
    """A Sentinel's ``SENTINEL MASTERS`` answer naming one master, ``kvmaster``, at 127.0.0.1:``port``."""
    fields = {"name": "kvmaster", "ip": "127.0.0.1", "port": str(port), "flags": "master",
              "num-other-sentinels": "0", **extra}  # fmt: skip
    return b"*1\r\n" + _resp_map({k: v for k, v in fields.items() if v != "-"})


def _sentinel_tier(sentinel: _HostileRedis, timeout_s: float) -> RedisTier:
    url = f"redis-sentinel://127.0.0.1:{sentinel.port}?service_name=kvmaster"
    tier = open_tier(url, _options(timeout_s))
    assert isinstance(tier, RedisTier)
    return tier


SENTINEL_ANSWERS: dict[str, bytes | Callable[[socket.socket], None]] = {
    "dripped": _Endless(b"*1\r\n%5\r\n$4\r\nname\r\n$100000\r\n", b"x" * 8, gap_s=0.02),
    "endless": _Endless(b"*1\r\n%5\r\n$4\r\nname\r\n$400000000\r\n", b"\0" * 65536),
    "integer": b":5\r\n",
    "array-of-integers": b"*1\r\n:5\r\n",
    "no-flags": _masters(6379, flags="-"),
    "no-port": _masters("-"),
    "port-not-a-number": _masters("http"),
    "port-past-65535": _masters(70000),
    "no-num-other-sentinels": _masters(6379, **{"num-other-sentinels": "-"}),
    "num-other-sentinels-not-a-number": _masters(6379, **{"num-other-sentinels": "x"}),
}


@pytest.mark.parametrize("answer", SENTINEL_ANSWERS.values(), ids=SENTINEL_ANSWERS.keys())
def test_a_hostile_sentinel_costs_one_budget_and_is_a_miss(
    answer: bytes | Callable[[socket.socket], None],
) -> None:
    """``redis-sentinel://`` asks a sentinel for the master on every new connection, with
    plain redis-py clients: a dripped answer held the load for as long as the drip went on, an
    endless one was read whole into memory, and an answer of the wrong shape raised KeyError,
    TypeError or OverflowError out of the tier's read into the load. Now every sentinel query
    waits at most the operation's time left, its reply is bounded, and a malformed answer is
    that sentinel's failure: the read is a miss, counted as an error (the last two shapes
    raised out of redis-py's own check of the master's state).

    The sentinel answers well until the tier is up and connected, then turns; the pooled
    connections are dropped, as redis-py drops them when a sentinel names a new master."""
    master = _HostileRedis(MALFORMED[-1:])
    sentinel = _HostileRedis([], {b"SENTINEL": _masters(master.port)})
    tier = _sentinel_tier(sentinel, timeout_s=1.0)
    keys = KB.keys(np.arange(16, dtype=np.uint32))
    try:
        assert _get_within(tier, keys, 10.0)[0] == [None] and master.hgetalls == 1
        sentinel.replies[b"SENTINEL"] = answer
        tier._client.connection_pool.disconnect()  # type: ignore[attr-defined]
        got, took = _get_within(tier, keys, 10.0)
        assert got == [None] and took < 1.0 + 2.0, took  # slack for a loaded machine; the old code: for ever
        assert master.hgetalls == 1
        snap = tier.metrics.snapshot()
        assert snap.get("errors", 0) + snap.get("timeouts", 0) == 1 and snap["hits"] == 0, snap
        if isinstance(answer, _Endless) and not answer.gap_s:
            time.sleep(0.2)  # the server notices the hang-up
            assert answer.sent < (1 << 20) + (16 << 20), answer.sent  # the bound and the socket buffers
    finally:
        tier.close()
        sentinel.close()
        master.close()
