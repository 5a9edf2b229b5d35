"""The ext_proc protocol handler over a real gRPC channel, without Envoy.

The EPP runs on its own loop and ports (kvmesh.epp.server.EppThread); the endpoints are
FakeVLLM servers on loopback sockets (the router's test double; no vLLM needed), the
tokenizer a small trained BPE. The test drives the ``Process`` stream the way Envoy does
in FULL_DUPLEX_STREAMED mode and checks every reply, in order.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.epp.config import EppConfig
from kvmesh.epp.scoring import endpoint_name
from kvmesh.epp.server import EXT_PROC_SERVICE, EppThread
from kvmesh.router.testing import FakeVLLM, write_test_tokenizer
from kvmesh.routing.config import ReplicaConfig, RoutingConfig
from tests.waiting import wait_for

FULL = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


@pytest.fixture(scope="module")
def fakes() -> Iterator[list[FakeVLLM]]:
    servers = [FakeVLLM(f"f{i}").start() for i in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_tokenizer(tmp_path_factory.mktemp("tok"))


def make_epp(fakes: list[FakeVLLM], tok_dir: Path, **kw: Any) -> EppThread:
    routing = RoutingConfig(
        model=str(tok_dir),
        replicas=kw.pop("replicas", None) or tuple(ReplicaConfig(url=f.url) for f in fakes),
        health_interval_s=0.2,
        speculative_ttl_s=kw.pop("speculative_ttl_s", 2.0),
        replica_header=kw.pop("replica_header", True),
        policy=kw.pop("policy", "kvmesh"),
    )
    # The protocol in plaintext; its TLS (the default) is tested behind Envoy (test_envoy_fake.py).
    kw.setdefault("secure_serving", False)
    cfg = EppConfig(routing=routing, host="127.0.0.1", grpc_port=0, health_port=0, metrics_port=0, **kw)
    epp = EppThread(cfg).start()
    wait_for(lambda: len(epp.picker.pool.healthy()) >= len(fakes), 10, "fake endpoints never became healthy")
    return epp


@pytest.fixture(scope="module")
def epp(fakes: list[FakeVLLM], tok_dir: Path) -> Iterator[EppThread]:
    e = make_epp(fakes, tok_dir, max_body_bytes=64 << 10)
    yield e
    e.stop()


def headers_msg(
    path: str = "/v1/completions", eos: bool = False, extra: dict[str, str] | None = None, subset: Any = None
) -> pb.ProcessingRequest:
    hs = {":method": "POST", ":path": path, "content-type": "application/json", **(extra or {})}
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()]
    )
    req = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=hm, end_of_stream=eos),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=FULL, response_body_mode=FULL),
    )
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-subset": subset})
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return req


def body_msgs(raw: bytes, chunk: int = 1000) -> list[pb.ProcessingRequest]:
    parts = [raw[i : i + chunk] for i in range(0, len(raw), chunk)] or [b""]
    return [
        pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=i == len(parts) - 1))
        for i, p in enumerate(parts)
    ]


def response_msgs(
    served: str | None, status: int = 200, chunks: tuple[bytes, ...] = (b"data: x\n\n",)
) -> list[pb.ProcessingRequest]:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())])
    req = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm))
    if served:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-served": served})
        req.metadata_context.filter_metadata["envoy.lb"].CopyFrom(s)
    out = [req]
    for i, c in enumerate(chunks):
        out.append(
            pb.ProcessingRequest(response_body=pb.HttpBody(body=c, end_of_stream=i == len(chunks) - 1))
        )
    return out


class Stream:
    """One Process stream driven step by step: send a message, read what it answered."""

    def __init__(self, epp: EppThread) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{epp.server.grpc_port}")  # type: ignore[union-attr]
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        import queue

        self.q: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
        self.calls = self.stub.Process(iter(self.q.get, None), timeout=20)

    def send(self, *msgs: pb.ProcessingRequest) -> None:
        for m in msgs:
            self.q.put(m)

    def recv(self, n: int) -> list[pb.ProcessingResponse]:
        return [next(self.calls) for _ in range(n)]

    def close(self) -> list[pb.ProcessingResponse]:
        self.q.put(None)
        rest = list(self.calls)
        self.channel.close()
        return rest


def completion(prompt: str, **kw: Any) -> bytes:
    return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2, **kw}).encode()


def dest(resp: pb.ProcessingResponse) -> tuple[str, str]:
    """(header value, envoy.lb metadata value) of a routing headers response."""
    sets = resp.request_headers.response.header_mutation.set_headers
    header = next(
        h.header.raw_value.decode() for h in sets if h.header.key == "x-gateway-destination-endpoint"
    )
    meta = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    return header, meta.string_value


def route(epp: EppThread, raw: bytes, **hkw: Any) -> tuple[list[pb.ProcessingResponse], Stream]:
    s = Stream(epp)
    s.send(headers_msg(**hkw), *body_msgs(raw))
    return s.recv(2), s


def test_full_duplex_routes_with_header_and_metadata_in_order(epp: EppThread, fakes: list[FakeVLLM]) -> None:
    raw = completion("the quick brown fox " * 300)  # several body chunks
    (h, b), s = route(epp, raw)
    assert h.WhichOneof("response") == "request_headers"
    header, meta = dest(h)
    assert header == meta and header in {endpoint_name(f.url) for f in fakes}
    assert h.request_headers.response.clear_route_cache
    assert b.WhichOneof("response") == "request_body"
    streamed = b.request_body.response.body_mutation.streamed_response
    assert streamed.body == raw and streamed.end_of_stream
    assert epp.picker.pool.replicas[header].state.in_flight == 1
    s.send(*response_msgs(header, chunks=(b"data: 1\n\n", b"data: [DONE]\n\n")))
    rh, rb1, rb2 = s.recv(3)
    assert rh.WhichOneof("response") == "response_headers"
    echoed = [r.response_body.response.body_mutation.streamed_response for r in (rb1, rb2)]
    assert [e.body for e in echoed] == [b"data: 1\n\n", b"data: [DONE]\n\n"]
    assert [e.end_of_stream for e in echoed] == [False, True]
    assert s.close() == []
    assert epp.picker.pool.replicas[header].state.in_flight == 0


def test_same_prefix_goes_back_to_same_endpoint(epp: EppThread) -> None:
    raw = completion("a shared system prompt about rivers and stones " * 40)
    first, s = route(epp, raw)
    s.close()
    again, s2 = route(epp, raw)
    s2.close()
    assert dest(first[0])[0] == dest(again[0])[0]


def test_subset_hint_restricts_and_empty_or_unmatched_is_503(epp: EppThread, fakes: list[FakeVLLM]) -> None:
    names = [endpoint_name(f.url) for f in fakes]
    for target in names:
        for hint in ([target], target, f"10.9.9.9:1,{target}"):
            (h, _), s = route(epp, completion(f"subset {target} " * 20), subset=hint)
            s.close()
            assert dest(h)[0] == target
    for hint in ([], ["10.9.9.9:1"], ""):
        s = Stream(epp)
        s.send(headers_msg(subset=hint), *body_msgs(completion("x")))
        (r,) = s.recv(1)
        assert r.immediate_response.status.code == 503
        assert json.loads(r.immediate_response.body)["error"]["type"] == "ServiceUnavailableError"
        assert s.close() == []


@pytest.mark.parametrize(
    ("raw", "status", "etype"),
    [
        (b"{not json", 400, "BadRequestError"),
        (b"[1, 2]", 400, "BadRequestError"),
        (json.dumps({"model": "nope", "prompt": "hi"}).encode(), 404, "NotFoundError"),
        (completion("x" * (70 << 10)), 413, "RequestTooLargeError"),
    ],
)
def test_refusals_are_immediate_openai_errors(epp: EppThread, raw: bytes, status: int, etype: str) -> None:
    s = Stream(epp)
    s.send(headers_msg(), *body_msgs(raw, chunk=16 << 10))
    (r,) = s.recv(1)
    assert r.WhichOneof("response") == "immediate_response"
    assert r.immediate_response.status.code == status
    err = json.loads(r.immediate_response.body)["error"]
    assert err["type"] == etype and err["code"] == status and err["message"]
    ctype = [
        h.header.raw_value for h in r.immediate_response.headers.set_headers if h.header.key == "content-type"
    ]
    assert ctype == [b"application/json"]
    assert s.close() == []  # the EPP ends the stream after an immediate response


def test_bodyless_request_is_routed_from_headers(epp: EppThread) -> None:
    s = Stream(epp)
    s.send(headers_msg(path="/v1/models", eos=True))
    (h,) = s.recv(1)
    assert dest(h)[0]
    s.close()


def test_served_endpoint_gets_the_accounting(epp: EppThread, fakes: list[FakeVLLM]) -> None:
    (h, _), s = route(epp, completion("fallback accounting " * 10, stream=True))
    primary = dest(h)[0]
    other = next(endpoint_name(f.url) for f in fakes if endpoint_name(f.url) != primary)
    state = epp.picker.pool.replicas
    assert (state[primary].state.in_flight, state[other].state.in_flight) == (1, 0)
    s.send(response_msgs(other, chunks=())[0])  # headers only, the body still to come
    s.recv(1)
    time.sleep(0.05)
    assert (state[primary].state.in_flight, state[other].state.in_flight) == (0, 1)
    s.close()
    time.sleep(0.1)
    assert state[other].state.in_flight == 0


def test_fallbacks_list_primary_first(fakes: list[FakeVLLM], tok_dir: Path) -> None:
    e = make_epp(fakes, tok_dir, fallbacks=1)
    try:
        (h, _), s = route(e, completion("two endpoints"))
        s.close()
        header, meta = dest(h)
        parts = header.split(",")
        assert header == meta and len(parts) == 2 and len(set(parts)) == 2
    finally:
        e.stop()


def test_shedding_gives_429_only_to_sheddable(fakes: list[FakeVLLM], tok_dir: Path) -> None:
    e = make_epp(fakes, tok_dir, shed_load=1)
    try:
        for name in e.picker.endpoints():
            e.call(lambda n=name: e.picker.pool.acquire(n))
        s = Stream(e)
        s.send(headers_msg(extra={"x-gateway-inference-priority": "-1"}), *body_msgs(completion("x")))
        (r,) = s.recv(1)
        assert r.immediate_response.status.code == 429
        assert json.loads(r.immediate_response.body)["error"]["type"] == "RateLimitError"
        s.close()
        (h, _), s = route(e, completion("critical"))  # no priority header: not sheddable
        s.close()
        assert dest(h)[0]
    finally:
        e.stop()


def test_health_services(epp: EppThread) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{epp.server.health_port}") as ch:  # type: ignore[union-attr]
        stub = health_pb2_grpc.HealthStub(ch)
        for svc in ("liveness", "readiness", EXT_PROC_SERVICE):
            got = stub.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
            assert got.status == health_pb2.HealthCheckResponse.SERVING, svc


def test_metrics_page(epp: EppThread) -> None:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{epp.server.metrics_port}/metrics", timeout=5).text  # type: ignore[union-attr]
    assert "kvmesh_epp_decisions_total" in text and "kvmesh_epp_decision_seconds_bucket" in text


def test_body_ended_by_trailers_is_routed_then_trailers_acknowledged(epp: EppThread) -> None:
    raw = completion("ends with trailers")
    s = Stream(epp)
    s.send(headers_msg(), pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=False)))
    s.send(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    h, b, t = s.recv(3)
    assert dest(h)[0]
    streamed = b.request_body.response.body_mutation.streamed_response
    assert streamed.body == raw and not streamed.end_of_stream  # the trailers end the stream
    assert t.WhichOneof("response") == "request_trailers"
    s.close()


def test_buffered_mode_acknowledges_headers_and_routes_on_the_body(epp: EppThread) -> None:
    buffered = processing_mode_pb2.ProcessingMode.BUFFERED
    req = headers_msg()
    req.protocol_config.request_body_mode = buffered
    s = Stream(epp)
    s.send(req)
    (ack,) = s.recv(1)
    assert ack.WhichOneof("response") == "request_headers"
    assert not ack.request_headers.response.header_mutation.set_headers
    s.send(*body_msgs(completion("buffered"), chunk=1 << 20))
    (b,) = s.recv(1)
    sets = b.request_body.response.header_mutation.set_headers
    assert [h.header.key for h in sets] == ["x-gateway-destination-endpoint"]
    assert (
        b.dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
    )
    s.close()


def test_speculative_entries_expire_on_a_timer_without_another_request(
    fakes: list[FakeVLLM], tok_dir: Path
) -> None:
    """As in the router: a speculative entry is removed when its ttl is up, not by the next
    match (which would pay for it on its request's critical path)."""
    e = make_epp(fakes, tok_dir, speculative_ttl_s=0.3)
    try:
        _, s = route(e, completion("speculative entries of the epp expire " * 30))
        s.close()
        index = e.picker.index
        # stats() expires nothing itself: only the timer can empty the table
        wait_for(
            lambda: e.call(lambda: index.stats()["speculative_blocks"]) > 0,
            2,
            "no speculative entry was made",
        )
        wait_for(
            lambda: e.call(lambda: index.stats()["speculative_blocks"]) == 0,
            3,
            "the speculative entries outlived their ttl",
        )
    finally:
        e.stop()


def test_cost_policy_counts_each_request_and_learns_from_its_first_byte(
    fakes: list[FakeVLLM], tok_dir: Path
) -> None:
    """policy cost in the EPP: sent / first byte / finished reach the model as in the router."""
    e = make_epp(fakes, tok_dir, policy="cost")
    try:
        costs = e.picker.costs
        assert costs is not None
        for i in range(3):
            (h, _), s = route(e, completion(f"cost {i} " * 20, stream=True))
            primary = dest(h)[0]
            assert costs.model.describe()[primary]["ledger"]["pending"] == 1
            s.send(*response_msgs(primary))
            s.recv(2)
            s.close()
        wait_for(
            lambda: sum(f["observations"] for f in costs.model.describe().values()) >= 3,
            5,
            "first bytes never reached the cost model",
        )
        ledgers = [f["ledger"] for f in costs.model.describe().values()]
        assert all(led["pending"] == 0 and led["in_flight"] == 0 for led in ledgers)
        assert len(costs.records) == 3
        assert "cost" in e.picker.describe()
    finally:
        e.stop()
