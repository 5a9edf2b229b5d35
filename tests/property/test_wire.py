"""Properties of the PD transfer's wire format (kvmesh.transport.wire, auth, client): frames
split anywhere parse to the same messages; arbitrary bytes are messages or a WireError,
never another exception, and never buffer more than one frame past the cap; the server's
handshake never accepts a proof it did not ask for; and whatever a producer streams, a
consumer keeps only chunks that verify (over a real socket pair)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.core import serde
from kvmesh.core.engine import CacheEngine
from kvmesh.core.fleetkey import TRANSFER_AUTH, FleetKey
from kvmesh.core.keys import KVLayout
from kvmesh.errors import WireError
from kvmesh.transport.auth import ChunkMacCheck, ServerAuth, chunk_mac
from kvmesh.transport.client import PullResult, fetch_over
from kvmesh.transport.wire import FrameReader, frame

FUZZ = settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
KEY = FleetKey([b"property-test fleet key, 32 bytes+"])
LAYOUT = KVLayout(1, 1, 4, torch.float32)
CS = 8

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
messages = st.dictionaries(st.text(max_size=8), values, max_size=5)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@FUZZ
@given(st.lists(messages, max_size=6), st.lists(st.integers(0, 10_000), max_size=8))
def test_frames_split_anywhere_parse_alike(msgs: list[dict[str, Any]], cuts: list[int]) -> None:
    data = b"".join(frame(m) for m in msgs)
    reader = FrameReader(limit=1 << 16)
    got: list[dict[str, Any]] = []
    for piece in _split(data, cuts):
        got += reader.feed(piece)
    assert got == [msgspec.msgpack.decode(msgspec.msgpack.encode(m)) for m in msgs]
    assert not reader.pending and reader.started is None


@FUZZ
@given(st.binary(max_size=3000), st.lists(st.integers(0, 10_000), max_size=8), st.integers(4, 600))
def test_arbitrary_bytes_are_messages_or_a_wire_error(data: bytes, cuts: list[int], limit: int) -> None:
    reader = FrameReader(limit=limit)
    for piece in _split(data, cuts):
        try:
            for msg in reader.feed(piece):
                assert isinstance(msg, dict)
        except WireError:
            return
        assert len(reader._buf) <= limit + 4 + len(piece)


@FUZZ
@given(st.lists(messages, min_size=1, max_size=3))
def test_the_handshake_accepts_only_the_proof_it_asked_for(msgs: list[dict[str, Any]]) -> None:
    server = ServerAuth(KEY, TRANSFER_AUTH)
    hello = {"op": "hello", "v": 1, "nonce": b"c" * 32}
    challenge = server.challenge(hello)
    for m in msgs:  # whatever else a peer sends is not a proof
        assert not server.verify(m)
    good = KEY.mac(TRANSFER_AUTH, b"client", b"c" * 32, challenge["nonce"])
    assert not server.verify(
        {"op": "auth", "mac": KEY.mac(TRANSFER_AUTH, b"server", b"c" * 32, challenge["nonce"])}
    )
    assert server.verify({"op": "auth", "mac": good})
    with pytest.raises(WireError):
        ServerAuth(KEY, TRANSFER_AUTH).challenge(msgs[0] if msgs[0].get("op") != "hello" else {})


@FUZZ
@given(st.binary(max_size=4000), st.lists(st.integers(1, 4000), max_size=6))
def test_a_chunk_mac_fed_in_pieces_equals_the_whole(payload: bytes, cuts: list[int]) -> None:
    header = b"header bytes"
    tag = chunk_mac(KEY, TRANSFER_AUTH, header, payload)
    check = ChunkMacCheck(KEY, TRANSFER_AUTH, tag, header, len(payload))
    for piece in _split(payload, cuts):
        check.update(piece)
    assert check.ok()
    bad = ChunkMacCheck(KEY, TRANSFER_AUTH, tag, header + b"x", len(payload))
    bad.update(payload)
    assert not bad.ok()


# -- a consumer against arbitrary producer streams ---------------------------------------
_ENGINE: CacheEngine | None = None


def engine() -> CacheEngine:
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = CacheEngine(
            {"chunk_size": CS, "max_local_cpu_size": 0.001, "admin_enabled": False},
            layout=LAYOUT,
            model_id="m",
        )
    return _ENGINE


def _stream(eng: CacheEngine, toks: np.ndarray, kv: torch.Tensor, keyed: bool) -> bytes:
    out = bytearray()
    for i, k in enumerate(eng.keys.keys_for_array(toks)):
        body = kv[:, :, i * CS : (i + 1) * CS].contiguous().numpy().tobytes()
        head, _ = serde.encode(k, LAYOUT, toks[i * CS : (i + 1) * CS], body, "raw")
        ctrl: dict[str, Any] = {"t": "chunk", "i": i, "hlen": len(head), "plen": len(body)}
        if keyed:
            ctrl["mac"] = chunk_mac(KEY, TRANSFER_AUTH, head, body)
        out += frame(ctrl) + head + body
    return bytes(out + frame({"t": "end"}))


def consume(data: bytes, keyed: bool, toks: np.ndarray) -> tuple[PullResult, int]:
    """Feed ``data`` as a producer's answer to one fetch; the result and what entered."""
    eng = engine()
    eng.clear("cpu", force=True)
    a, b = socket.socketpair()
    try:
        writer = threading.Thread(target=lambda: _write(b, data), daemon=True)
        writer.start()
        res = PullResult()
        keys = eng.keys.keys_for_array(toks)
        fetch_over(
            a, eng, "t", keys, toks.astype(np.int64), time.monotonic() + 2, res, 0, KEY if keyed else None
        )
        a.close()  # ends the writer's read of our requests
        writer.join(3)
        return res, eng.lookup(toks.astype(np.int64))
    finally:
        a.close()
        b.close()


def _write(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 16):  # the fetch request (and a confirm): read and drop
            pass


@settings(deadline=None, max_examples=80, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.booleans(),
    st.integers(1, 3),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3),
    st.integers(0, 10**6),
)
def test_a_consumer_keeps_only_chunks_that_verify(
    keyed: bool, n: int, flips: list[tuple[int, int]], cut: int
) -> None:
    toks = np.arange(n * CS, dtype=np.uint32)
    kv = torch.arange(float(n * CS * LAYOUT.bytes_per_token // 4)).reshape(LAYOUT.shape(n * CS))
    data = bytearray(_stream(engine(), toks, kv, keyed))
    for pos, xor in flips:
        data[pos % len(data)] ^= xor
    data = data[: max(1, cut % (len(data) + 1))] if cut % 3 == 0 else data
    res, held = consume(bytes(data), keyed, toks)
    assert held == res.tokens  # whatever the stream said, what entered is exactly what verified
    if held:
        got = engine().retrieve(toks[:held].astype(np.int64))[1]
        assert torch.equal(got, kv[:, :, :held])
