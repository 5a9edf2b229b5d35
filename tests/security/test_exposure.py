"""Finding 9: exposure defaults. Every listener bounded: bind, caps, deadlines, TLS.

Each attack against the real thing on loopback:

* the EPP's three listeners must not be on every address by default (read from the kernel's
  socket table);
* a client opening more ext_proc streams than ``max_streams`` is refused, not queued;
* a stream that sends its request headers and then nothing, or drips its body, is closed
  at ``request_timeout_s``;
* ext_proc speaks only TLS, and an Envoy that does not trust the EPP's certificate does
  not route through it;
* a KV-event publisher announcing a 32 MiB message is disconnected before the router
  buffers it (``ZMQ_MAXMSGSIZE``), and its later sane batches still arrive;
* a client that opens a stream through ``kvmesh router`` and stops reading is dropped after
  ``write_timeout_s``, and the replica's stream with it;
* a controller client that declares a body and never sends it gets a 408 at
  ``body_timeout_s``.

Before: the EPP listened on 0.0.0.0 in plaintext with no stream cap and no deadline; the
subscriber took the 32 MiB message (and counted it malformed); the router held the stalled
stream (and the replica's generation) forever; the controller waited for the body forever.
"""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
import pytest
import zmq
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvmesh.epp.config import EppConfig
from kvmesh.epp.server import EppThread
from kvmesh.events import EventSubscriber
from kvmesh.events.codec import BlockStored, EventBatch, encode_batch
from kvmesh.harness.envoy import Envoy, EppTls, epp_channel, make_epp_tls
from kvmesh.router import RouterConfig
from kvmesh.router.testing import FakeVLLM
from kvmesh.routing.config import ReplicaConfig
from tests.security.conftest import StartGateway, StartRouter, wait_routed
from tests.waiting import wait_for

TOKEN = "exposure-token"


# -- the EPP ----------------------------------------------------------------------------------


def test_epp_listens_on_loopback_by_default(tok_dir: Path) -> None:
    cfg = EppConfig(routing=RouterConfig(model=str(tok_dir)), grpc_port=0, health_port=0, metrics_port=0)
    with EppThread(cfg) as epp:
        server = epp.server
        assert server is not None
        ports = {server.grpc_port, server.health_port, server.metrics_port}
        listening = {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.Process(os.getpid()).net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in ports
        }
    assert {port for _, port in listening} == ports
    # gRPC's sockets are dual-stack: 127.0.0.1 shows as ::ffff:127.0.0.1
    addresses = {ipaddress.ip_address(ip) for ip, _ in listening}
    assert all((getattr(a, "ipv4_mapped", None) or a).is_loopback for a in addresses), listening


@pytest.fixture
def epp_tls(tok_dir: Path, capture: FakeVLLM, tmp_path: Path) -> Iterator[tuple[EppThread, EppTls]]:
    """An EPP over TLS with small caps: 2 streams, 1 s to deliver a request."""
    tls = make_epp_tls(tmp_path)
    routing = RouterConfig(
        model=str(tok_dir), replicas=(ReplicaConfig(url=capture.url),), health_interval_s=0.2
    )
    cfg = EppConfig(routing=routing, grpc_port=0, health_port=0, metrics_port=0, cert_path=str(tls.cert_dir),
                    max_streams=2, request_timeout_s=1.0)  # fmt: skip
    with EppThread(cfg) as epp:
        yield epp, tls


def headers_message(end: bool = False) -> pb.ProcessingRequest:
    hs = [("x-gateway-test", "1"), (":path", "/v1/completions"), (":method", "POST")]
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]
            ),
            end_of_stream=end,
        )
    )


class HeldStream:
    """An ext_proc stream whose requests the test feeds by hand (None ends it)."""

    def __init__(self, stub: Any, timeout_s: float = 10.0) -> None:
        self.q: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
        self.responses = stub.Process(iter(self.q.get, None), timeout=timeout_s)

    def close(self) -> None:
        self.q.put(None)
        self.responses.cancel()


def test_epp_refuses_streams_over_the_cap(epp_tls: tuple[EppThread, EppTls]) -> None:
    epp, tls = epp_tls
    assert epp.server is not None
    with epp_channel(epp.server.grpc_port, tls) as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        held = [HeldStream(stub) for _ in range(2)]
        for s in held:
            s.q.put(headers_message())  # a request still coming: the stream stays open
        time.sleep(0.3)
        third = HeldStream(stub)
        third.q.put(headers_message())
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            next(third.responses)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert time.monotonic() - t0 < 0.9  # refused at once, not after the others' deadline
        for s in [*held, third]:
            s.close()


@pytest.mark.parametrize("drip", [False, True])
def test_epp_closes_a_stream_that_does_not_deliver_its_request(
    epp_tls: tuple[EppThread, EppTls], drip: bool
) -> None:
    epp, tls = epp_tls
    assert epp.server is not None
    with epp_channel(epp.server.grpc_port, tls) as ch:
        stream = HeldStream(pb_grpc.ExternalProcessorStub(ch))
        stream.q.put(headers_message())
        t0 = time.monotonic()
        if drip:  # a byte of body every 0.2 s: the deadline is the whole request's, not per message
            for _ in range(10):
                stream.q.put(pb.ProcessingRequest(request_body=pb.HttpBody(body=b" ")))
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream.responses:
                if drip:
                    time.sleep(0.2)
        took = time.monotonic() - t0
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
        assert "kvmesh epp" in (err.value.details() or "") and took < 5, (err.value.details(), took)
        stream.close()


def test_epp_speaks_only_tls_and_envoy_must_trust_it(
    epp_behind_envoy: StartGateway, tmp_path: Path, capture: FakeVLLM
) -> None:
    gw = epp_behind_envoy()  # routes through the EPP over TLS, verified (wait_routed passed)
    port = gw.epp.server.grpc_port if gw.epp.server is not None else 0
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # a plaintext ext_proc client
        with pytest.raises(grpc.RpcError) as err:
            next(pb_grpc.ExternalProcessorStub(ch).Process(iter([headers_message(end=True)]), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    # An Envoy given another CA: the EPP's certificate does not verify, nothing is routed.
    other = make_epp_tls(tmp_path / "other-ca")
    untrusting = EppTls(other.ca, gw.tls.cert_dir, gw.tls.name)
    envoy = Envoy(port, [capture.url.split("://")[1]], tmp_path, epp_tls=untrusting, message_timeout_s=5)
    with envoy:
        time.sleep(1.5)  # its health check of the EPP has run (and failed)
        resp = httpx.post(envoy.url("fail_close") + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert resp.status_code >= 500, resp.text
    wait_routed(gw.url)  # the trusting gateway still routes


# -- KV events ---------------------------------------------------------------------------------


def test_event_subscriber_drops_an_oversized_message() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    got: list[EventBatch] = []
    sub = EventSubscriber(f"tcp://127.0.0.1:{port}", lambda _r, b: got.append(b), "hostile")
    seq = 0

    def send(payload: bytes) -> None:
        nonlocal seq
        seq += 1
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    def sane(tokens: int) -> bytes:
        return encode_batch([BlockStored((tokens,), None, tuple(range(tokens)), 16)])

    def until_delivered(tokens: int) -> None:
        deadline = time.monotonic() + 10
        while not any(b.events[0].token_ids == tuple(range(tokens)) for b in got):  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the subscriber never received a sane batch"
            send(sane(tokens))
            time.sleep(0.05)

    try:
        until_delivered(16)  # connected and subscribed
        send(b"\x00" * (32 << 20))  # announced, and sent, as one 32 MiB frame
        until_delivered(32)  # reconnected; sane batches flow again
        stats = sub.stats()
        assert stats["malformed"] == 0, stats  # the 32 MiB frame never reached the decoder
        assert stats["reconnects"] >= 1, stats
        assert all(len(b.events) == 1 for b in got)
    finally:
        sub.close()
        pub.close(linger=0)


# -- the router and its controller ---------------------------------------------------------------


def test_router_drops_a_client_that_stops_reading(start_router: StartRouter, capture: FakeVLLM) -> None:
    capture.chunks = 200_000  # ~40 MB of SSE: far more than the socket buffers hold
    router = start_router(write_timeout_s=1.0)
    host, port = router.url.split("://")[1].split(":")
    body = json.dumps({"model": "tiny", "prompt": "stream to me", "stream": True}).encode()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect((host, int(port)))
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    client.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert client.recv(1024).startswith(b"HTTP/1.1 200")  # the stream began; now read nothing

    def in_flight() -> int:
        state = httpx.get(router.url + "/kvmesh/state", timeout=5).json()
        return int(state["replicas"][0]["in_flight"])

    wait_for(lambda: not in_flight(), 15, "the stalled client still holds the replica's stream")
    client.settimeout(10)
    received = 0
    with pytest.raises(ConnectionResetError):  # the router dropped it (the answer was never whole)
        while chunk := client.recv(1 << 16):
            received += len(chunk)
        raise ConnectionResetError("closed")
    assert received < 30 << 20
    client.close()


def test_controller_answers_408_to_a_body_that_never_comes(start_router: StartRouter) -> None:
    router = start_router(controller={"token": TOKEN, "body_timeout_s": 1.0})
    host, port = router.url.split("://")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        head = (f"POST /kvmesh/v1/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")  # fmt: skip
        s.sendall(head.encode() + b'{"tokens": [')
        t0 = time.monotonic()
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert time.monotonic() - t0 < 5
        assert b'"field": "body"' in answer or b'"field":"body"' in answer
