"""Finding 4: the PD transfer server without authentication. A hostile peer on the network
(plain sockets, speaking the wire format) tries to fetch a held prompt's chunks (tokens and
KV) and to confirm (unpin) another request's transfer, without the fleet key, with a wrong
proof, and by replaying a genuine client's proof. And the other direction: an impostor
listening where a signed transfer points (the producer died, the port was taken) serves
forged chunks to the consumer. Every attempt must get nothing and change nothing."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvmesh.core import serde
from kvmesh.core.fleetkey import TRANSFER_AUTH, TRANSFER_PARAMS
from kvmesh.integrations.vllm.pd import PdWorker, response_params
from kvmesh.transport.wire import recv_msg
from tests.security.pd_peers import CS, LAYOUT, Silent, frame, pair, prompt, read_all


def _export(prod: PdWorker, toks: list[int]) -> dict[str, Any]:
    answer = prod.export("p", toks)
    assert answer is not None
    return response_params("engine-p", [answer], key=prod.key, ttl_s=60)


def _fetch_and_confirm(s: socket.socket, tid: str, keys: list[str]) -> bytes:
    """Ask for the chunks and unpin them, in both request shapes (``keys``: the wire format
    before the fix; ``first``/``count``); whatever comes back. The server may hang up
    first: sends that fail are part of the answer."""
    fetch = {"op": "fetch", "req": tid, "keys": keys, "first": 0, "count": len(keys)}
    with contextlib.suppress(OSError):
        s.sendall(frame(fetch) + frame({"op": "confirm", "req": tid}))
    return read_all(s, 1.5)


def test_fetch_and_confirm_without_the_key_get_nothing(tmp_path: Path) -> None:
    with pair(tmp_path) as (prod, _):
        toks, kv = prompt(3 * CS)
        prod.engine.store(toks, kv)
        ours = _export(prod, toks)["kvmesh"]
        tid, keys = ours["transfer_id"], ours["keys"]
        payload = kv[:, :, :CS].contiguous().numpy().tobytes()[:64]  # bytes of chunk 0's KV
        port = prod.server.port  # type: ignore[union-attr]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # no handshake at all
            got = _fetch_and_confirm(s, tid, keys)
        assert payload not in got and b"KVMC" not in got, "chunk bytes went to an unauthenticated peer"
        assert prod.stats()["pd_pinned_requests"] == 1, "an unauthenticated confirm unpinned a transfer"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # a hello, then a made-up proof
            s.sendall(frame({"op": "hello", "v": 1, "nonce": os.urandom(32)}))
            challenge = recv_msg(s, deadline=time.monotonic() + 2)
            assert challenge.get("t") == "challenge"
            s.sendall(frame({"op": "auth", "mac": os.urandom(40)}))
            got = _fetch_and_confirm(s, tid, keys)
        assert payload not in got and b"KVMC" not in got
        assert prod.stats()["pd_pinned_requests"] == 1
        assert prod.stats()["pd_server_auth_failures"] >= 1


def test_a_recorded_proof_does_not_replay(tmp_path: Path) -> None:
    with pair(tmp_path) as (prod, _):
        toks, kv = prompt(2 * CS, seed=2)
        prod.engine.store(toks, kv)
        ours = _export(prod, toks)["kvmesh"]
        key, port = prod.key, prod.server.port  # type: ignore[union-attr]
        assert key is not None
        nonce = os.urandom(32)
        hello = frame({"op": "hello", "v": 1, "nonce": nonce})
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # a genuine client
            s.sendall(hello)
            ch = recv_msg(s, deadline=time.monotonic() + 2)
            proof = frame({"op": "auth", "mac": key.mac(TRANSFER_AUTH, b"client", nonce, ch["nonce"])})
            s.sendall(proof + frame({"op": "ping"}))
            assert recv_msg(s, deadline=time.monotonic() + 2) == {"t": "ok"}
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # the same bytes again
            s.sendall(hello)
            ch2 = recv_msg(s, deadline=time.monotonic() + 2)
            assert ch2["nonce"] != ch["nonce"]
            s.sendall(proof)
            got = _fetch_and_confirm(s, ours["transfer_id"], ours["keys"])
        assert b"KVMC" not in got and prod.stats()["pd_pinned_requests"] == 1


class Impostor(Silent):
    """Listens where a transfer points and answers like a producer, without the key: a
    challenge with a made-up proof, then well-formed chunks of forged KV (right keys, right
    tokens, consistent checksums) for whatever is fetched."""

    def __init__(self, keys: list[str], toks: list[int]) -> None:
        self.keys, self.toks = keys, np.asarray(toks, dtype=np.uint32)
        self.served = 0
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        try:
            with c:
                while True:
                    msg = recv_msg(c, limit=1 << 20, deadline=time.monotonic() + 5)
                    if msg.get("op") == "hello":
                        c.sendall(
                            frame({"t": "challenge", "v": 1, "nonce": os.urandom(32), "mac": os.urandom(40)})
                        )
                    elif msg.get("op") == "fetch":
                        for i, text in enumerate(self.keys):
                            t = self.toks[i * CS : (i + 1) * CS]
                            body = torch.zeros(LAYOUT.shape(CS)).numpy().tobytes()
                            head, _ = serde.encode(text, LAYOUT, t, body, "raw")
                            c.sendall(
                                frame({"t": "chunk", "i": i, "hlen": len(head), "plen": len(body)})
                                + head
                                + body
                            )
                            self.served += 1
                        c.sendall(frame({"t": "end"}))
                    elif msg.get("op") in ("confirm", "ping"):
                        c.sendall(frame({"t": "ok"}))
        except OSError:
            return


def test_consumer_refuses_a_producer_that_cannot_prove_the_key(tmp_path: Path) -> None:
    with pair(tmp_path) as (prod, cons):
        toks, kv = prompt(2 * CS, seed=3)
        prod.engine.store(toks, kv)
        params = _export(prod, toks)
        impostor = Impostor(params["kvmesh"]["keys"], toks)
        try:
            # The producer's address now answers as the impostor (signed params, genuine key).
            key = prod.key
            assert key is not None
            params["remote_port"] = impostor.port
            params["kvmesh"]["ports"] = [impostor.port]
            params["kvmesh"].pop("sig")
            signed = {k: params[k] for k in ("remote_host", "remote_port", "remote_engine_id")}
            params["kvmesh"]["sig"] = key.sign_value(
                TRANSFER_PARAMS, {**signed, "kvmesh": dict(params["kvmesh"])}
            )
            got = cons.pull("d", toks, params)
            assert got["tokens"] == 0 and impostor.served == 0, got
            assert cons.engine.lookup(toks) == 0, "the consumer took forged KV from an impostor"
        finally:
            impostor.close()
