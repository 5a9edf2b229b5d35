"""Finding 1: a client's ``kv_transfer_params`` must never reach a replica.

The field tells a ``kv_both``/``kv_consumer`` engine which host and port to pull KV from; a
client who sets it makes the replica fetch (and cache) KV from a server of its choosing,
connect anywhere (SSRF), or pin chunks. A hostile client sends it, in the top level and in
vLLM's ``vllm_xargs`` passthrough, through a real ``kvmesh router`` process (plain and PD
mode) and through ``kvmesh epp`` behind a real Envoy; a capturing upstream
(:class:`~kvmesh.router.testing.FakeVLLM`, a real socket) records what arrived.

Before: the router outside PD mode and the EPP forwarded the field untouched (the PD-mode
test passed before too: that path already replaced the client's field).
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from kvmesh.harness.router import RouterProcess
from kvmesh.router.testing import FakeVLLM
from tests.security.conftest import StartGateway, StartRouter

HOSTILE = {
    "do_remote_prefill": True,
    "remote_host": "203.0.113.66",  # the attacker's KV server
    "remote_port": 6666,
    "remote_block_ids": [1, 2, 3],
    "kvmesh": {"request_id": "forged", "keys": ["00" * 16]},
}
PROMPT = "the quick brown fox jumps over the lazy dog " * 8


def received(fake: FakeVLLM) -> list[dict[str, Any]]:
    return [json.loads(raw) for path, raw, _ in fake.requests if path.startswith("/v1/")]


def hostile_bodies() -> list[tuple[str, dict[str, Any]]]:
    completion = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}
    return [
        ("/v1/completions", {**completion, "kv_transfer_params": HOSTILE}),
        ("/v1/completions", {**completion, "stream": True, "kv_transfer_params": HOSTILE}),
        ("/v1/chat/completions", {**chat, "kv_transfer_params": HOSTILE}),
        # vLLM copies vllm_xargs into the request's extra args, where kv_transfer_params live too
        ("/v1/completions", {**completion, "vllm_xargs": {"kv_transfer_params": "x", "keep": 1}}),
    ]


def assert_clean(bodies: list[dict[str, Any]], n: int) -> None:
    assert len(bodies) == n, bodies
    for body in bodies:
        assert "kv_transfer_params" not in body, body
        assert "kv_transfer_params" not in body.get("vllm_xargs", {}), body
        assert body["model"] == "tiny" and body["max_tokens"] == 3  # the rest arrives unchanged
    assert bodies[-1]["vllm_xargs"] == {"keep": 1}


def test_router_drops_client_transfer_params(start_router: StartRouter, capture: FakeVLLM) -> None:
    router = start_router()
    for path, body in hostile_bodies():
        resp = httpx.post(router.url + path, json=body, timeout=10)
        assert resp.status_code == 200, resp.text
    assert_clean(received(capture), len(hostile_bodies()))


def test_router_pd_mode_sends_only_its_own_transfer_params(tok_dir: Any, tmp_path: Any) -> None:
    """PD mode: the prefill carries the router's producer parameters, the decode request the
    producer's answer; the client's never."""
    from tests.unit.router.test_pd import PARAMS, PDFake, pd_config

    fakes = {name: PDFake(name).start() for name in ("p", "d")}
    cfg = pd_config(tok_dir, fakes, pd_threshold_tokens=16).merged(replica_header=False)
    try:
        with RouterProcess(cfg, str(tmp_path / "router.log")).start(60) as router:
            for path, body in hostile_bodies():
                resp = httpx.post(router.url + path, json=body, timeout=10)
                assert resp.status_code == 200, resp.text
        prefills, decodes = received(fakes["p"]), received(fakes["d"])
        assert prefills and all(b["kv_transfer_params"] == {"do_remote_decode": True} for b in prefills)
        assert len(decodes) == len(hostile_bodies())
        # The producer's parameters (a prefilled request) or none (its prefix is cached there).
        assert any(b.get("kv_transfer_params") == PARAMS for b in decodes)
        for body in decodes:
            assert body.get("kv_transfer_params") in (PARAMS, None), body
            assert "kv_transfer_params" not in body.get("vllm_xargs", {})
    finally:
        for f in fakes.values():
            f.stop()


def test_epp_strips_client_transfer_params_behind_envoy(
    epp_behind_envoy: StartGateway, capture: FakeVLLM
) -> None:
    gw = epp_behind_envoy()
    before = len(received(capture))
    for path, body in hostile_bodies():
        resp = httpx.post(gw.url + path, json=body, timeout=10)
        assert resp.status_code == 200, resp.text  # the mutated body's length is right, too
    assert_clean(received(capture)[before:], len(hostile_bodies()))
