"""``kvmesh router --pd`` over real loopback HTTP, in front of fake producer/consumer servers.

The fakes (:class:`PDFake`, a :class:`~kvmesh.router.testing.FakeVLLM` that answers a
prefill request with ``kv_transfer_params``) are fault injection: a prefill that answers
500, one that hangs, one without transfer parameters, a producer that is gone. Every test
asserts the body each upstream received.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from kvmesh.errors import ConfigError
from kvmesh.router import RouterConfig
from kvmesh.router.cli import add_router_parser, config_from_args
from kvmesh.router.pd import decode_body, prefill_body
from kvmesh.router.server import Router
from kvmesh.router.testing import _WORDS, FakeVLLM, cut_answer, cut_head
from kvmesh.routing.config import ReplicaConfig
from tests.waiting import eventually

PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_host": "127.0.0.1",
    "remote_port": 5999,
    "kvmesh": {"request_id": "r1", "keys": ["ab", "cd"], "num_tokens": 700},
}


class PDFake(FakeVLLM):
    """A fake vLLM that acts as a producer: a prefill request (``kv_transfer_params.
    do_remote_decode``) is answered per ``mode``: ``ok`` (with :data:`PARAMS`), ``500``,
    ``hang`` (answers after ``hang_s``), ``none`` (a normal answer, no transfer parameters),
    ``cut`` (the answer's headers and a few bytes, then the connection cut: a crash),
    ``cut_head`` (the connection cut mid-way through the answer's headers), ``big`` (a
    Content-Length over the router's ``max_answer_bytes``, 256 MiB, and a byte of it)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.mode = "ok"
        self.hang_s = 3.0

    async def _answer(self, request: web.Request, body: dict[str, Any], chat: bool) -> web.StreamResponse:
        ktp = body.get("kv_transfer_params")
        if not (isinstance(ktp, dict) and ktp.get("do_remote_decode")):
            return await super()._answer(request, body, chat)
        if self.mode == "500":
            err = {"message": "engine died", "type": "InternalServerError", "param": None, "code": 500}
            return web.json_response({"error": err}, status=500)
        if self.mode == "hang":
            await asyncio.sleep(self.hang_s)
        if self.mode == "cut_head":
            return await cut_head(request)
        if self.mode == "big":
            big = web.StreamResponse(headers={"Content-Type": "application/json"})
            big.content_length = 300 << 20
            await big.prepare(request)
            with contextlib.suppress(ConnectionResetError):
                await big.write(b"{")
                await asyncio.sleep(1.0)  # the router refuses it on its Content-Length alone
            return big
        if self.mode == "none":
            return await super()._answer(request, body, chat)
        choice = {"index": 0, "text": "x", "finish_reason": "length"}
        out = {"id": "cmpl-p", "object": "text_completion", "choices": [choice], "kv_transfer_params": PARAMS}
        if self.mode == "cut":
            return await cut_answer(request, json.dumps(out).encode(), 10)
        return web.json_response(out)


def bodies(fake: FakeVLLM) -> list[dict[str, Any]]:
    return [json.loads(raw) for path, raw, _ in fake.requests if path.startswith("/v1/")]


def words(n: int, seed: int = 0) -> str:
    return " ".join(_WORDS[(i * 7 + seed * 13) % len(_WORDS)] for i in range(n))


@pytest.fixture
def fakes() -> Iterator[dict[str, PDFake]]:
    servers = {name: PDFake(name).start() for name in ("p", "d")}
    try:
        yield servers
    finally:
        for s in servers.values():
            s.stop()


MakeRouter = Callable[..., Router]


def pd_config(tok_dir: Path, fakes: dict[str, PDFake], **pd: Any) -> RouterConfig:
    """A ``--pd`` router over the producer ``p`` and the consumer ``d``."""
    return RouterConfig(
        model=str(tok_dir),
        replicas=(
            ReplicaConfig(url=fakes["p"].url, name="p", role="prefill"),
            ReplicaConfig(url=fakes["d"].url, name="d", role="decode"),
        ),
        port=0,
        health_interval_s=0.2,
        metrics_interval_s=0.05,
        pd={"enabled": True, "pd_threshold_tokens": 64, **pd},
        replica_header=True,  # the tests read which replica answered
    )


@pytest.fixture
def make_router(tok_dir: Path, fakes: dict[str, PDFake]) -> Iterator[MakeRouter]:
    started: list[Router] = []

    def make(**pd: Any) -> Router:
        router = Router(pd_config(tok_dir, fakes, **pd)).start()
        started.append(router)
        return router

    try:
        yield make
    finally:
        for r in started:
            r.stop()


def metric(router: Router, name: str, **labels: str) -> float:
    value = router.service.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def long_body(stream: bool = True, seed: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": words(300, seed), "max_tokens": 5, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def test_long_prompt_prefills_on_the_producer_then_streams_from_the_consumer(
    make_router: MakeRouter, fakes: dict[str, PDFake]
) -> None:
    router = make_router()
    body = long_body()
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        assert resp.headers["x-kvmesh-replica"] == "d"
        text = "".join(resp.iter_text())
    assert "d:0" in text and "[DONE]" in text
    (pre,) = bodies(fakes["p"])
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "stream_options" not in pre
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert pre["prompt"] == body["prompt"]
    (dec,) = bodies(fakes["d"])
    assert dec == {**body, "kv_transfer_params": PARAMS}  # the client's body, the params as returned
    assert metric(router, "kvmesh_router_pd_requests_total", path="pd") == 1
    assert metric(router, "kvmesh_router_pd_prefill_seconds_count") == 1
    # The decode replica loaded the whole prompt: counted as transferred, not recomputed.
    assert (
        metric(router, "kvmesh_router_prefix_hit_tokens_total", medium="PD")
        == metric(router, "kvmesh_router_prompt_tokens_total")
        > 250
    )
    state = router.service.pool.replicas
    # The router's thread lets go of the stream's ticket after the stream's last byte.
    eventually(lambda: not state["d"].state.in_flight, 5)
    assert (state["p"].state.in_flight, state["d"].state.in_flight, state["d"].state.prefill_tokens) == (
        0,
        0,
        0,
    )


def test_chat_prefill_caps_max_completion_tokens(make_router: MakeRouter, fakes: dict[str, PDFake]) -> None:
    router = make_router()
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": words(300)}],
        "max_completion_tokens": 9,
    }
    resp = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=10)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"].startswith("d:0")
    (pre,) = bodies(fakes["p"])
    assert (pre["max_tokens"], pre["max_completion_tokens"], pre["messages"]) == (1, 1, body["messages"])
    assert bodies(fakes["d"]) == [{**body, "kv_transfer_params": PARAMS}]


def test_short_prompt_and_cached_prefix_decode_alone(
    make_router: MakeRouter, fakes: dict[str, PDFake]
) -> None:
    router = make_router(pd_threshold_tokens=64)
    short = {"model": "tiny", "prompt": words(10), "max_tokens": 3}
    assert httpx.post(router.url + "/v1/completions", json=short, timeout=10).status_code == 200
    assert bodies(fakes["p"]) == [] and bodies(fakes["d"]) == [short]
    # A client's own transfer parameters do not reach the consumer (the router owns them).
    forged = {**short, "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9"}}
    assert httpx.post(router.url + "/v1/completions", json=forged, timeout=10).status_code == 200
    assert bodies(fakes["d"])[-1] == short
    # A long prompt goes the pd way; the same prompt plus a few words then finds its prefix
    # on the decode replica (the router's speculative entry) and stays there.
    first = long_body(stream=False, seed=3)
    assert httpx.post(router.url + "/v1/completions", json=first, timeout=10).status_code == 200
    follow = {**first, "prompt": first["prompt"] + " and one more"}
    assert httpx.post(router.url + "/v1/completions", json=follow, timeout=10).status_code == 200
    assert len(bodies(fakes["p"])) == 1
    assert bodies(fakes["d"])[-1] == follow
    assert metric(router, "kvmesh_router_pd_requests_total", path="decode_only") == 3
    assert metric(router, "kvmesh_router_pd_requests_total", path="pd") == 1


@pytest.mark.parametrize(
    ("mode", "reason"), [("500", "error"), ("big", "error"), ("none", "no_params"), ("hang", "timeout")]
)
def test_failed_prefill_falls_back_to_decode_only(
    make_router: MakeRouter, fakes: dict[str, PDFake], mode: str, reason: str
) -> None:
    fakes["p"].mode = mode
    router = make_router(prefill_timeout_s=0.5)
    body = long_body()
    t0 = time.monotonic()
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        text = "".join(resp.iter_text())
    elapsed = time.monotonic() - t0
    assert "d:0" in text and "[DONE]" in text
    assert len(bodies(fakes["p"])) == 1
    assert bodies(fakes["d"]) == [body]  # exactly the client's body: no transfer parameters
    assert metric(router, "kvmesh_router_pd_requests_total", path="fallback") == 1
    assert metric(router, "kvmesh_router_pd_fallbacks_total", reason=reason) == 1
    if mode == "hang":
        assert elapsed < fakes["p"].hang_s  # the timeout, not the producer, decided


def test_producer_gone_falls_back(make_router: MakeRouter, fakes: dict[str, PDFake]) -> None:
    router = make_router()
    fakes["p"].stop()  # refused connections from now on; the health loop has not noticed yet
    body = {**long_body(stream=False), "kv_transfer_params": {"client": "sent this"}}
    resp = httpx.post(router.url + "/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200 and resp.headers["x-kvmesh-replica"] == "d"
    expected = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    assert bodies(fakes["d"]) == [expected]  # the router owns kv_transfer_params in pd mode
    reasons = ("unreachable", "no_prefill_replica")  # connect refused, or health already saw it
    assert sum(metric(router, "kvmesh_router_pd_fallbacks_total", reason=r) for r in reasons) == 1


@pytest.mark.parametrize("mode", ["cut", "cut_head"])
def test_a_prefill_answer_broken_off_goes_to_the_next_producer(
    mode: str, tok_dir: Path, fakes: dict[str, PDFake]
) -> None:
    """A producer killed between its answer's headers and the end of its body, or mid-way
    through its headers: the prefill goes to the next producer (as after a connect
    failure), not to a decode-only fallback."""
    fakes["p"].mode = mode
    q = PDFake("q").start()
    try:
        base = pd_config(tok_dir, fakes)
        replicas = (*base.replicas, ReplicaConfig(url=q.url, name="q", role="prefill"))
        router = Router(RouterConfig.from_dict({**base.model_dump(), "replicas": replicas})).start()
        try:
            sent = 0
            while sent < 4 or not bodies(fakes["p"]):  # until p has been tried (up to 20)
                assert sent < 20, "the producer p was never tried"
                resp = httpx.post(router.url + "/v1/completions", json=long_body(False, sent), timeout=10)
                assert resp.status_code == 200 and resp.headers["x-kvmesh-replica"] == "d"
                sent += 1
            cut = len(bodies(fakes["p"]))
            assert metric(router, "kvmesh_router_pd_requests_total", path="pd") == sent
            assert metric(router, "kvmesh_router_pd_requests_total", path="fallback") == 0
            assert len(bodies(q)) == sent  # every prefill ended on q
            assert metric(router, "kvmesh_router_errors_total", kind="upstream_broken") == cut
            assert all(b["kv_transfer_params"] == PARAMS for b in bodies(fakes["d"]))
        finally:
            router.stop()
    finally:
        q.stop()


def test_no_decode_replica_is_a_503(make_router: MakeRouter, fakes: dict[str, PDFake]) -> None:
    router = make_router()
    fakes["d"].healthy = False
    eventually(lambda: not router.service.pool.replicas["d"].healthy, 5)
    resp = httpx.post(router.url + "/v1/completions", json=long_body(stream=False), timeout=10)
    assert resp.status_code == 503 and "decode replica" in resp.json()["error"]["message"]
    assert bodies(fakes["p"]) == []


# -- pure helpers and configuration ------------------------------------------------------------


def test_bodies() -> None:
    client = {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
    assert prefill_body(client) == {
        "prompt": "x",
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert client["max_tokens"] == 50  # the client's body is not touched
    assert decode_body(client, PARAMS) == {**client, "kv_transfer_params": PARAMS}
    assert decode_body({**client, "kv_transfer_params": {}}, None) == client


def parse(*argv: str) -> Any:
    import argparse

    parser = argparse.ArgumentParser(prog="kvmesh")
    add_router_parser(parser.add_subparsers(dest="command", required=True))
    return config_from_args(parser.parse_args(["router", *argv]))


def test_cli_roles_and_pd_flags(tmp_path: Path) -> None:
    cfg = parse(
        "--replica", "http://h:1,role=prefill", "--replica", "http://h:2,role=decode,name=d",
        "--pd", "--pd-threshold-tokens", "300", "--prefill-timeout-s", "5",
    )  # fmt: skip
    assert [(r.url, r.role) for r in cfg.replicas] == [("http://h:1", "prefill"), ("http://h:2", "decode")]
    assert (cfg.pd.enabled, cfg.pd.pd_threshold_tokens, cfg.pd.prefill_timeout_s) == (True, 300, 5.0)
    assert not parse("--replica", "http://h:1").pd.enabled  # off unless asked for
    f = tmp_path / "r.yaml"
    f.write_text(
        "replicas: ['http://h:1,role=prefill', {url: 'http://h:2', role: both}]\npd: {enabled: true}\n"
    )
    cfg = parse("--config", str(f), "--pd-threshold-tokens", "128")
    assert (cfg.pd.enabled, cfg.pd.pd_threshold_tokens, cfg.replicas[1].role) == (True, 128, "both")


def test_bad_pd_config_names_the_problem() -> None:
    with pytest.raises(ConfigError, match="'prefill', 'decode' or 'both'"):
        ReplicaConfig.parse("http://h:1,role=producer")
    with pytest.raises(ConfigError, match="no replica has role=decode"):
        RouterConfig.from_dict({"replicas": ["http://h:1,role=prefill"], "pd": {"enabled": True}})
    with pytest.raises(ConfigError, match="pd_threshold_tokens"):
        RouterConfig.from_dict({"pd": {"pd_threshold_tokens": -1}})
    with pytest.raises(ConfigError, match="valid keys"):
        RouterConfig.from_dict({"pdd": {}})
