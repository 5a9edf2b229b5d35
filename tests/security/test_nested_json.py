"""Finding 5: deeply nested JSON is a 400 that names the body on every JSON surface.

A hostile client sends bodies nested 100, 1,000 and 100,000 levels deep to a real ``kvmesh
router`` process (``/v1/completions``, ``/v1/chat/completions`` and its controller's
``/kvmesh/v1/lookup``), to a real engine admin API (``/kvmesh/admin/v1/lookup``) and to
``kvmesh epp`` behind a real Envoy.

Before: 1,000 levels and more were a 500 on the router, the controller and the admin API
(the decoder's ``RecursionError``), the EPP's stream failed (Envoy answered 500), and 100
levels went through to the replica.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvmesh.router.testing import FakeVLLM
from tests.security.conftest import StartGateway, StartRouter

DEPTHS = (100, 1000, 100_000)
TOKEN = "nested-json-token"


def nested(depth: int, key: str = "x", **fields: Any) -> bytes:
    """A JSON object whose field ``key`` is ``depth`` arrays deep, with ``fields`` beside it."""
    head = b"".join(f'"{k}": {json.dumps(v)}, '.encode() for k, v in fields.items())
    return b"{" + head + f'"{key}": '.encode() + b"[" * depth + b"]" * depth + b"}"


def assert_body_refused(resp: httpx.Response) -> None:
    assert resp.status_code == 400, (resp.status_code, resp.text[:300])
    err = resp.json()["error"]
    assert (err.get("param") or err.get("field")) == "body", err
    assert "body" in err["message"] and "nested" in err["message"], err


def post(url: str, raw: bytes, **headers: str) -> httpx.Response:
    return httpx.post(url, content=raw, headers={"content-type": "application/json", **headers}, timeout=30)


@pytest.mark.parametrize("depth", DEPTHS)
def test_router_and_controller(start_router: StartRouter, capture: FakeVLLM, depth: int) -> None:
    router = start_router(controller={"token": TOKEN})
    completion = nested(depth, model="tiny", prompt="hello")
    chat = nested(depth, model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert_body_refused(post(router.url + "/v1/completions", completion))
    assert_body_refused(post(router.url + "/v1/chat/completions", chat))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert_body_refused(post(router.url + "/kvmesh/v1/lookup", nested(depth, key="tokens"), **auth))
    assert not [r for r in capture.requests if r[0].startswith("/v1/")]  # nothing reached the replica
    # Real bodies still pass: chat content parts, a tool's JSON-schema parameters.
    item = {"type": "object", "properties": {"b": {"type": "string"}}}
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": item}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    content = [{"type": "text", "text": "hi"}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "tools": tools}
    assert httpx.post(router.url + "/v1/chat/completions", json=body, timeout=10).status_code == 200


@pytest.fixture
def admin_api() -> Iterator[str]:
    """A real engine admin API on a bare CPU-tier CacheEngine; its URL."""
    import torch

    from kvmesh import CacheConfig, CacheEngine, KVLayout
    from kvmesh.admin.server import AdminServer

    engine = CacheEngine(
        CacheConfig.from_dict({"chunk_size": 16, "max_local_cpu_size": 0.01}),
        layout=KVLayout(2, 2, 8, torch.float32),
        model_id="m",
    )
    try:
        with AdminServer(engine, port=0, token=TOKEN) as server:
            yield server.url
    finally:
        engine.close(timeout=10)


@pytest.mark.parametrize("depth", DEPTHS)
def test_engine_admin_api(admin_api: str, depth: int) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert_body_refused(post(admin_api + "/kvmesh/admin/v1/lookup", nested(depth, key="tokens"), **auth))
    url = admin_api + "/kvmesh/admin/v1/lookup"
    ok = httpx.post(url, json={"tokens": [1, 2, 3]}, headers=auth, timeout=10)
    assert ok.status_code == 200, ok.text


def test_epp_behind_envoy(epp_behind_envoy: StartGateway, capture: FakeVLLM) -> None:
    gw = epp_behind_envoy()
    before = len(capture.requests)
    for depth in DEPTHS:
        assert_body_refused(post(gw.url + "/v1/completions", nested(depth, model="tiny", prompt="hello")))
    assert len(capture.requests) == before
