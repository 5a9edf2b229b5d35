"""The router matches LoRA requests per adapter (issue #26; llm-d's router never matched them,
llm-d-router#2927): a request whose ``model`` names an adapter matches only that adapter's
blocks, a base-model request never an adapter's.

Real loopback HTTP: a router in front of two :class:`~kvmesh.router.testing.FakeVLLM` that
serve the tiny model and two adapters; the router learns which names are adapters from
their ``/v1/models`` (vLLM lists LoRA modules there with ``parent`` = the base model).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvmesh.events.codec import BlockStored
from kvmesh.router import RouterConfig
from kvmesh.router.server import Router
from kvmesh.router.testing import FakeVLLM
from kvmesh.routing.config import ReplicaConfig
from kvmesh.routing.tokenize import PromptTokenizer
from tests.integration.test_router_http import served_by, words
from tests.waiting import wait_for

BS = 16


@pytest.fixture
def router(tok_dir: Path) -> Iterator[Router]:
    fakes = {name: FakeVLLM(name).start() for name in ("a", "b")}
    for f in fakes.values():
        f.adapters = {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    cfg = RouterConfig(
        model=str(tok_dir),
        replicas=tuple(ReplicaConfig(url=f.url, name=n) for n, f in fakes.items()),
        port=0,
        health_interval_s=0.2,
        speculative_ttl_s=0,
        replica_header=True,
    )
    r = Router(cfg).start()
    try:
        wait_for(lambda: r.service.pool.adapters() == {"sql", "chat"})
        yield r
    finally:
        r.stop()
        for f in fakes.values():
            f.stop()


def hold(router: Router, replica: str, tokens: np.ndarray, lora: str | None) -> None:
    """``replica`` holds ``tokens``' blocks for adapter ``lora`` (None: the base model), as
    vLLM (and kvmesh's connector) announce them."""
    n = len(tokens) // BS
    ev = BlockStored(
        tuple(range(1, n + 1)), None, tuple(int(t) for t in tokens[: n * BS]), BS, None, "GPU", lora_name=lora
    )
    router.index.store(replica, ev)


def test_fake_vllm_lists_adapters_with_their_parent(router: Router) -> None:
    url = router.service.pool.replicas["a"].url
    cards = httpx.get(url + "/v1/models").json()["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [("tiny", None), ("sql", "tiny"), ("chat", "tiny")]
    resp = httpx.post(url + "/v1/completions", json={"model": "sql", "prompt": "x"})
    assert resp.status_code == 200 and resp.json()["model"] == "sql"


def test_requests_match_only_the_blocks_of_their_adapter(router: Router, tok_dir: Path) -> None:
    pt = PromptTokenizer.from_dir(tok_dir)
    text = words(5, 400)
    tokens = pt.encode(text, add_special_tokens=True)
    hold(router, "a", tokens, "sql")  # a holds the prompt for adapter sql
    hold(router, "b", tokens, None)  # b holds it for the base model
    with httpx.Client(timeout=10) as client:
        for tail in ("and then some", "a different ending entirely"):
            body = {"prompt": f"{text} {tail}", "max_tokens": 1}
            assert (
                served_by(client.post(router.url + "/v1/completions", json={**body, "model": "sql"})) == "a"
            )
            assert (
                served_by(client.post(router.url + "/v1/completions", json={**body, "model": "tiny"})) == "b"
            )
    # adapter chat matches neither: not sql's blocks, not the base model's
    d = router.service.dispatcher
    for model, holders in (("chat", set()), ("sql", {"a"}), ("tiny", {"b"})):
        req = d.request(tokens, lora_name=model if model != "tiny" else None)
        d.match(req)
        assert set(req.matches or {}) == holders, model
