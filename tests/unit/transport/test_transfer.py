"""The direct KV transfer over real loopback sockets: a producer engine's TransferServer,
a consumer engine pulling from it, pins held until confirm or timeout, both ends holding a
fleet key (and, in one test, neither: the insecure opt-in). Faults are injected by a
forwarding proxy (it flips a byte or cuts the stream), a silent listener, and a producer in
a child process killed mid-transfer. Attacks on the server are in tests/security/."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvmesh.core.engine import CacheEngine
from kvmesh.core.fleetkey import FleetKey
from kvmesh.core.keys import ChunkKey, KVLayout
from kvmesh.transport import PinLedger, TransferServer, confirm, pull
from kvmesh.transport.client import (
    AUTH_FAILED,
    CORRUPT,
    DISCONNECTED,
    MAX_RESUMES,
    MISSING,
    TIMEOUT,
    UNREACHABLE,
    ping,
    stall_budget,
)
from kvmesh.transport.wire import frame
from tests.waiting import eventually

LAYOUT = KVLayout(2, 2, 8, torch.float32)
CS = 16
CFG = {"chunk_size": CS, "max_local_cpu_size": 0.01, "admin_enabled": False}


BIG = KVLayout(4, 8, 64, torch.float32)  # 256 KiB chunks: a stream larger than socket buffers
KEY = FleetKey([b"unit-test fleet key, 32 bytes or more"])


def keys_of(eng: CacheEngine, toks: np.ndarray) -> list[ChunkKey]:
    return eng.keys.keys_for_array(toks.astype(np.uint32))


def make_engine(layout: KVLayout = LAYOUT, gb: float = 0.01) -> CacheEngine:
    return CacheEngine({**CFG, "max_local_cpu_size": gb}, layout=layout, model_id="m")


def prompt(n_chunks: int, seed: int = 1, layout: KVLayout = LAYOUT) -> tuple[np.ndarray, torch.Tensor]:
    toks = np.arange(seed * 1000, seed * 1000 + n_chunks * CS, dtype=np.int64)
    kv = torch.randn(layout.shape(len(toks)), generator=torch.Generator().manual_seed(seed))
    return toks, kv


@pytest.fixture
def producer() -> Iterator[tuple[CacheEngine, PinLedger, TransferServer]]:
    eng = make_engine()
    pins = PinLedger(eng, timeout_s=30.0)
    srv = TransferServer(eng, pins, "127.0.0.1", 0, key=KEY).start()
    yield eng, pins, srv
    srv.close()
    pins.close()
    eng.close()


@pytest.fixture
def consumer() -> Iterator[CacheEngine]:
    eng = make_engine()
    yield eng
    eng.close()


def test_pull_copies_verified_chunks_and_confirm_unpins(producer, consumer) -> None:  # type: ignore[no-untyped-def]
    eng, pins, srv = producer
    toks, kv = prompt(8)
    eng.store(toks, kv)
    keys = eng.keys.keys_for_array(toks.astype(np.uint32))
    pins.hold("r1", keys)
    assert eng.cpu.pinned_count() == 8
    res = pull(consumer, "127.0.0.1", srv.port, "r1", keys_of(consumer, toks), toks, key=KEY)
    assert res.reason is None and res.chunks == 8 and res.tokens == 8 * CS
    assert res.nbytes == 8 * CS * LAYOUT.bytes_per_token
    n, got = consumer.retrieve(toks)
    assert n == 8 * CS and torch.equal(got, kv)
    assert eng.cpu.pinned_count() == 0  # the pull confirmed
    assert pins.stats()["pd_pins_confirmed"] == 1 and srv.stats()["pd_served_chunks"] == 8


def test_pull_skips_chunks_already_held(producer, consumer) -> None:  # type: ignore[no-untyped-def]
    eng, pins, srv = producer
    toks, kv = prompt(6)
    eng.store(toks, kv)
    pins.hold("r", keys_of(eng, toks))
    consumer.store(toks[: 2 * CS], kv[:, :, : 2 * CS].contiguous())
    keys = keys_of(consumer, toks)
    res = pull(consumer, "127.0.0.1", srv.port, "r", keys[2:], toks, first=2, key=KEY)
    assert res.reason is None and res.chunks == 4 and res.tokens == 6 * CS
    assert torch.equal(consumer.retrieve(toks)[1], kv)


def test_missing_chunk_ends_the_prefix(producer, consumer) -> None:  # type: ignore[no-untyped-def]
    eng, pins, srv = producer
    toks, kv = prompt(6)
    eng.store(toks, kv)
    eng.clear("cpu", tokens=toks[: 4 * CS], force=True)  # drops chunks 0..3 of 6
    eng.store(toks[: 2 * CS], kv[:, :, : 2 * CS].contiguous())  # chunks 0,1 back; 2,3 missing
    pins.hold("r", keys_of(eng, toks))
    res = pull(consumer, "127.0.0.1", srv.port, "r", keys_of(consumer, toks), toks, key=KEY)
    assert res.reason == MISSING and res.chunks == 2 and res.tokens == 2 * CS
    assert consumer.lookup(toks) == 2 * CS
    # A transfer id nothing is held under gets nothing, whatever the pool holds.
    other = make_engine()
    try:
        res = pull(other, "127.0.0.1", srv.port, "unknown", keys_of(other, toks[: 2 * CS]), toks, key=KEY)
        assert res.reason == MISSING and res.chunks == 0 and other.lookup(toks) == 0
    finally:
        other.close()


def test_producer_gone_is_unreachable_fast(consumer) -> None:  # type: ignore[no-untyped-def]
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    toks, _ = prompt(2)
    t0 = time.monotonic()
    res = pull(consumer, "127.0.0.1", port, "r", keys_of(consumer, toks), toks, key=KEY)
    assert res.reason == UNREACHABLE and res.tokens == 0
    assert time.monotonic() - t0 < 1.0
    assert not ping("127.0.0.1", port, key=KEY)


def test_hung_producer_costs_at_most_the_handshake_budget(consumer) -> None:  # type: ignore[no-untyped-def]
    """A listener that accepts and never answers (fault injection): the handshake's budget
    (connect_timeout_s), not the whole fetch timeout."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    toks, _ = prompt(2)
    port = lst.getsockname()[1]
    t0 = time.monotonic()
    res = pull(consumer, "127.0.0.1", port, "r", keys_of(consumer, toks), toks, timeout_s=5.0, key=KEY)
    took = time.monotonic() - t0
    assert res.reason == TIMEOUT and res.tokens == 0
    assert 0.9 < took < 2.0
    t0 = time.monotonic()  # without a key (insecure) only the fetch timeout bounds it
    res = pull(consumer, "127.0.0.1", port, "r", keys_of(consumer, toks), toks, timeout_s=0.5)
    lst.close()
    assert res.reason == TIMEOUT and 0.4 < time.monotonic() - t0 < 1.5
    assert res.detail.startswith("0 of 2 chunks in "), res.detail  # what a log line says of it


END = frame({"t": "end"})


class Proxy:
    """Forwards connections to the producer; from byte ``at`` of the reply stream it
    either flips one byte (``mode="flip"``) or cuts the connection (``"cut"``); or it cuts
    the connection where the producer's end-of-stream marker would pass (``"cut_end"``); or
    (``"stall"``) it forwards nothing more, keeping the connection open, on the first
    ``stalls`` connections (those after are forwarded whole)."""

    def __init__(self, port: int, at: int, mode: str, stalls: int = 1) -> None:
        self.target, self.at, self.mode, self.stalls = port, at, mode, stalls
        self.connections = 0
        self.lst = socket.socket()
        self.lst.bind(("127.0.0.1", 0))
        self.lst.listen(4)
        self.port = self.lst.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                c, _ = self.lst.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.target))
            self.connections += 1
            stall = self.mode == "stall" and self.connections <= self.stalls
            threading.Thread(target=self._pipe, args=(c, up, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, c, True, stall), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, reply: bool, stall: bool = False) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if reply and stall and seen + len(data) > self.at:
                    dst.sendall(data[: max(0, self.at - seen)])
                    while dst.recv(65536):  # forwards nothing more until the consumer hangs up
                        pass
                    raise OSError("stalled")
                if reply and self.mode == "stall":
                    seen += len(data)
                    dst.sendall(data)
                    continue
                if reply and self.mode == "cut_end" and data.endswith(END):
                    dst.sendall(data[: -len(END)])
                    raise OSError("cut")
                if reply and self.mode != "cut_end" and seen + len(data) > self.at >= seen:
                    if self.mode == "cut":
                        dst.sendall(data[: self.at - seen])
                        raise OSError("cut")
                    buf = bytearray(data)
                    buf[self.at - seen] ^= 0xFF
                    data = bytes(buf)
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.lst.close()


@pytest.mark.parametrize("mode", ["flip", "cut"])
def test_corrupt_or_cut_stream_keeps_only_verified_chunks(producer, consumer, mode: str) -> None:  # type: ignore[no-untyped-def]
    eng, pins, srv = producer
    toks, kv = prompt(4)
    eng.store(toks, kv)
    pins.hold("r", keys_of(eng, toks))
    chunk_bytes = CS * LAYOUT.bytes_per_token
    proxy = Proxy(srv.port, at=int(2.5 * (chunk_bytes + 600)), mode=mode)  # inside chunk 2's payload-ish
    try:
        res = pull(
            consumer, "127.0.0.1", proxy.port, "r", keys_of(consumer, toks), toks, timeout_s=2.0, key=KEY
        )
    finally:
        proxy.close()
    assert res.reason == (CORRUPT if mode == "flip" else DISCONNECTED), res
    assert 0 <= res.chunks < 4
    n, got = consumer.retrieve(toks)
    assert n == res.tokens and torch.equal(got, kv[:, :, :n])  # whatever entered is exact
    if mode == "flip":  # the producer is alive: the client confirmed on a new connection
        eventually(lambda: not pins.stats()["pd_pinned_requests"], 2)
        assert pins.stats()["pd_pinned_requests"] == 0


def stalled_pull(producer, consumer, proxy_at: int, stalls: int, timeout_s: float, connect_s: float):  # type: ignore[no-untyped-def]
    """A 4-chunk pull through a proxy whose first ``stalls`` connections stop forwarding at
    byte ``proxy_at`` of the reply: (result, proxy, seconds taken, the KV stored)."""
    eng, pins, srv = producer
    toks, kv = prompt(4)
    eng.store(toks, kv)
    pins.hold("r", keys_of(eng, toks))
    proxy = Proxy(srv.port, at=proxy_at, mode="stall", stalls=stalls)
    t0 = time.monotonic()
    try:
        res = pull(
            consumer, "127.0.0.1", proxy.port, "r", keys_of(consumer, toks), toks,
            timeout_s=timeout_s, connect_timeout_s=connect_s, key=KEY,
        )  # fmt: skip
    finally:
        proxy.close()
    return res, proxy, time.monotonic() - t0, kv


def test_a_stalled_stream_resumes_on_a_fresh_connection(producer, consumer) -> None:  # type: ignore[no-untyped-def]
    """The producer's stream stops inside chunk 2 (the connection stays open, nothing more
    arrives): after the stall budget the fetch resumes from chunk 2 on a fresh connection,
    gets every chunk, and confirms; the pull costs the budget, not its whole timeout."""
    at = int(2.5 * (CS * LAYOUT.bytes_per_token + 600))
    res, proxy, took, kv = stalled_pull(producer, consumer, at, stalls=1, timeout_s=6.0, connect_s=0.5)
    assert res.reason is None and res.chunks == 4 and res.resumes == 1 and res.confirmed is True, res
    assert proxy.connections == 2
    assert stall_budget(6.0, 0.5) == 2.0 and 2.0 <= took < 4.0, took
    assert torch.equal(consumer.retrieve(prompt(4)[0])[1], kv)
    assert producer[1].stats()["pd_pinned_requests"] == 0


def test_a_stream_that_stalls_on_every_connection_times_out_saying_where(producer, consumer) -> None:  # type: ignore[no-untyped-def]
    """Every connection stalls inside chunk 0's header: MAX_RESUMES fresh connections, then
    the pull ends as a timeout within its budget and says what it was waiting for."""
    res, proxy, took, _ = stalled_pull(producer, consumer, 200, stalls=99, timeout_s=1.5, connect_s=0.2)
    assert res.reason == TIMEOUT and res.chunks == 0 and res.resumes == MAX_RESUMES, res
    assert proxy.connections == MAX_RESUMES + 1 and took < 2.5
    assert res.detail.startswith("0 of 4 chunks in "), res.detail
    assert "waiting for chunk 0's header" in res.detail and "after 2 resumes" in res.detail, res.detail


def test_a_stream_cut_after_its_last_chunk_is_a_whole_pull_confirmed_anew(producer, consumer) -> None:  # type: ignore[no-untyped-def]
    """Every chunk arrived and verified, then the connection broke before the end marker:
    nothing is missing (not a fallback), and the confirm goes over a fresh connection."""
    eng, pins, srv = producer
    toks, kv = prompt(4)
    eng.store(toks, kv)
    pins.hold("r", keys_of(eng, toks))
    proxy = Proxy(srv.port, at=0, mode="cut_end")
    try:
        res = pull(
            consumer, "127.0.0.1", proxy.port, "r", keys_of(consumer, toks), toks, timeout_s=2.0, key=KEY
        )
    finally:
        proxy.close()
    assert res.reason is None and res.chunks == 4 and res.confirmed is True, res
    assert torch.equal(consumer.retrieve(toks)[1], kv)
    assert pins.stats()["pd_pinned_requests"] == 0 and pins.stats()["pd_pins_confirmed"] == 1


def test_other_model_keys_are_missing_not_loaded(producer) -> None:  # type: ignore[no-untyped-def]
    eng, pins, srv = producer
    toks, kv = prompt(2)
    eng.store(toks, kv)
    pins.hold("r", keys_of(eng, toks))
    other = CacheEngine(dict(CFG), layout=LAYOUT, model_id="other-weights")
    try:
        res = pull(other, "127.0.0.1", srv.port, "r", keys_of(other, toks), toks, key=KEY)
        assert res.reason == MISSING and res.tokens == 0 and other.lookup(toks) == 0
        assert pins.stats()["pd_pinned_requests"] == 0  # confirmed all the same: the producer is alive
    finally:
        other.close()


def test_pins_expire_after_the_timeout() -> None:
    eng = make_engine()
    pins = PinLedger(eng, timeout_s=0.3, tick_s=0.05)
    try:
        toks, kv = prompt(3)
        eng.store(toks, kv)
        pins.hold("r", keys_of(eng, toks))
        assert eng.cpu.pinned_count() == 3

        def gone() -> bool:  # the ledger's thread lets go at its first tick past 0.3 s
            return (eng.cpu.pinned_count(), pins.stats()["pd_pins_expired"]) == (0, 1)

        eventually(gone, 5)
        assert eng.cpu.pinned_count() == 0
        st = pins.stats()
        assert st["pd_pins_expired"] == 1 and st["pd_pinned_requests"] == 0
        assert not pins.release("r")  # a late confirm is harmless
    finally:
        pins.close()
        eng.close()


def _serve_forever(port_q: mp.Queue, n_chunks: int) -> None:  # child process
    eng = make_engine(BIG, 0.05)
    toks, kv = prompt(n_chunks, layout=BIG)
    eng.store(toks, kv)
    pins = PinLedger(eng, 30.0)
    pins.hold("r", keys_of(eng, toks))
    srv = TransferServer(eng, pins, "127.0.0.1", 0, key=KEY).start()
    port_q.put(srv.port)
    time.sleep(60)


def test_producer_killed_mid_transfer() -> None:
    """The producer process is SIGKILLed while the consumer reads its stream (10 MiB)."""
    consumer = make_engine(BIG, 0.05)
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    n = 40
    child = ctx.Process(target=_serve_forever, args=(q, n), daemon=True)
    child.start()
    try:
        port = q.get(timeout=60)
        toks, kv = prompt(n, layout=BIG)
        keys = keys_of(consumer, toks)
        # Read slowly: kill the producer after the first chunk arrived.
        orig_put = consumer.cpu.put
        calls = {"n": 0}

        def slow_put(key, obj):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 1:
                os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
                child.join(5)
            return orig_put(key, obj)

        consumer.cpu.put = slow_put  # type: ignore[method-assign]
        res = pull(consumer, "127.0.0.1", port, "r", keys, toks, timeout_s=3.0, key=KEY)
        consumer.cpu.put = orig_put  # type: ignore[method-assign]
        assert res.reason in (DISCONNECTED, TIMEOUT), res
        assert 1 <= res.chunks < n
        n_got, got = consumer.retrieve(toks)
        assert n_got == res.tokens and torch.equal(got, kv[:, :, :n_got])
        assert not confirm("127.0.0.1", port, "r", timeout_s=0.5, key=KEY)
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)
        consumer.close()


def test_prepared_headers_are_used_then_forgotten(producer, consumer) -> None:  # type: ignore[no-untyped-def]
    eng, pins, srv = producer
    toks, kv = prompt(3)
    eng.store(toks, kv)
    keys = keys_of(eng, toks)
    pins.hold("a", keys)
    pins.hold("b", keys[:1])  # two holds share chunk 0
    assert srv.prepare(keys) == 3 and srv.prepare(keys[:1]) == 1
    assert pull(consumer, "127.0.0.1", srv.port, "a", keys, toks, key=KEY).reason is None
    assert len(srv._heads) == 1  # a's confirm dropped its headers; b still holds chunk 0
    pins.release("b")
    assert srv._heads == {}


def test_loopback_measure_runs() -> None:
    from kvmesh.transport.loopback import transfer_vs_raw

    r = transfer_vs_raw(tokens=64, dims=(2, 2, 8), chunk_size=16, repeats=2)
    assert r["chunks"] == 4 and r["pull_gbps"] > 0 and r["raw_gbps"] > 0 and r["ratio"] > 0
    assert len(r["ratios"]) == len(r["pull_gbps_all"]) == len(r["raw_gbps_all"]) == 2


def test_insecure_opt_in_pulls_without_a_key_and_keys_must_match(consumer) -> None:  # type: ignore[no-untyped-def]
    """pd_allow_insecure: no key on either side still works (held chunks, checksums); a
    keyed consumer refuses such a producer, and a keyless consumer is refused by a keyed one."""
    eng = make_engine()
    pins = PinLedger(eng, timeout_s=30.0)
    srv = TransferServer(eng, pins, "127.0.0.1", 0).start()
    keyed = TransferServer(eng, pins, "127.0.0.1", 0, key=KEY).start()
    try:
        toks, kv = prompt(3)
        eng.store(toks, kv)
        pins.hold("r", keys_of(eng, toks))
        res = pull(
            consumer, "127.0.0.1", srv.port, "r", keys_of(consumer, toks), toks, confirm_after=False, key=KEY
        )
        assert res.reason == AUTH_FAILED and consumer.lookup(toks) == 0
        res = pull(consumer, "127.0.0.1", keyed.port, "r", keys_of(consumer, toks), toks, confirm_after=False)
        assert res.reason == DISCONNECTED and consumer.lookup(toks) == 0
        other = FleetKey([b"another fleet's key, also 32 bytes long"])
        res = pull(consumer, "127.0.0.1", keyed.port, "r", keys_of(consumer, toks), toks, key=other)
        assert res.reason == AUTH_FAILED and consumer.lookup(toks) == 0
        res = pull(consumer, "127.0.0.1", srv.port, "r", keys_of(consumer, toks), toks)
        assert res.reason is None and torch.equal(consumer.retrieve(toks)[1], kv)
        assert pins.stats()["pd_pinned_requests"] == 0
        assert ping("127.0.0.1", srv.port) and ping("127.0.0.1", keyed.port, key=KEY)
        assert not ping("127.0.0.1", keyed.port) and not ping("127.0.0.1", srv.port, key=KEY)
    finally:
        srv.close()
        keyed.close()
        pins.close()
        eng.close()


def test_pin_ledger_bounds_holds_oldest_first() -> None:
    eng = make_engine()
    pins = PinLedger(eng, timeout_s=30.0, max_requests=3, max_chunks=5)
    try:
        toks, kv = prompt(8)
        eng.store(toks, kv)
        keys = keys_of(eng, toks)
        assert pins.hold("big", keys) == keys[:5]  # alone over the bound: its leading chunks
        assert pins.hold("a", keys[:2]) == keys[:2]  # "big" ends: 5 + 2 > 5
        assert pins.keys_of("big") is None and pins.keys_of("a") == keys[:2]
        pins.hold("b", keys[2:3])
        pins.hold("c", keys[3:4])
        pins.hold("d", keys[4:5])  # a fourth hold: the oldest ("a") ends
        st = pins.stats()
        assert pins.keys_of("a") is None and st["pd_pinned_requests"] == 3 and st["pd_pinned_chunks"] == 3
        assert st["pd_pins_evicted"] == 2 and st["pd_pins_truncated"] == 1
        assert eng.cpu.pinned_count() == 3
    finally:
        pins.close()
        eng.close()
