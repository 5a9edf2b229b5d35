"""Finding 7: no answer tells a client where other tenants' prefixes are cached.

A hostile client asks a real ``kvmesh router`` process and ``kvmesh epp`` behind a real
Envoy, and reads the answer's headers; then it asks the router's controller, bound to
loopback with a token set (a sidecar proxy makes loopback reachable), for a lookup without
the token.

Before: every router answer carried ``x-kvmesh-replica`` and every EPP-routed one
``x-kvmesh-endpoint``. (The controller part passed before: the token has been required for
every call once configured since the admin API hardening, 36d2c69.)
"""

from __future__ import annotations

import httpx

from kvmesh.router.testing import FakeVLLM
from tests.security.conftest import StartGateway, StartRouter

BODY = {"model": "tiny", "prompt": "a tenant's system prompt " * 20, "max_tokens": 2}
TOKEN = "placement-oracle-token"


def test_router_answers_do_not_name_the_replica(start_router: StartRouter) -> None:
    router = start_router()
    for stream in (False, True):
        resp = httpx.post(router.url + "/v1/completions", json={**BODY, "stream": stream}, timeout=10)
        assert resp.status_code == 200, resp.text
        assert "x-kvmesh-replica" not in resp.headers, dict(resp.headers)
    # Opt-in, for benchmarks and debugging.
    named = start_router(replica_header=True)
    resp = httpx.post(named.url + "/v1/completions", json=BODY, timeout=10)
    assert resp.headers["x-kvmesh-replica"] == "capture"


def test_epp_answers_do_not_name_the_endpoint(epp_behind_envoy: StartGateway, capture: FakeVLLM) -> None:
    gw = epp_behind_envoy()
    resp = httpx.post(gw.url + "/v1/completions", json=BODY, timeout=10)
    assert resp.status_code == 200, resp.text
    assert "x-kvmesh-endpoint" not in resp.headers, dict(resp.headers)


def test_controller_lookup_needs_the_token_on_loopback(start_router: StartRouter) -> None:
    router = start_router(host="127.0.0.1", controller={"token": TOKEN})
    lookup = router.url + "/kvmesh/v1/lookup"
    body = {"prompt": BODY["prompt"]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        resp = httpx.post(lookup, json=body, headers=headers, timeout=10)
        assert resp.status_code == 401, (headers, resp.status_code, resp.text)
    for path in ("replicas", "openapi.json"):
        assert httpx.get(router.url + "/kvmesh/v1/" + path, timeout=10).status_code == 401
    ok = httpx.post(lookup, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert ok.status_code == 200, ok.text
