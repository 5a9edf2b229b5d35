"""Speculative index entries are expired by a timer of their own, not by the next request.

Real loopback HTTP: a router in front of a :class:`~kvmesh.router.testing.FakeVLLM`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.router import RouterConfig
from kvmesh.router.server import Router
from kvmesh.router.testing import _WORDS, FakeVLLM
from kvmesh.routing.config import ReplicaConfig
from tests.waiting import eventually


@pytest.fixture
def router(tok_dir: Path) -> Iterator[Router]:
    fake = FakeVLLM("up").start()
    cfg = RouterConfig(
        model=str(tok_dir),
        replicas=(ReplicaConfig(url=fake.url, name="up"),),
        port=0,
        health_interval_s=0.2,
        speculative_ttl_s=0.3,
        replica_header=True,  # the tests read which replica answered
    )
    r = Router(cfg).start()
    try:
        yield r
    finally:
        r.stop()
        fake.stop()


def test_speculative_entries_expire_without_another_request(router: Router) -> None:
    prompt = " ".join(_WORDS[i % len(_WORDS)] for i in range(400))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    resp = httpx.post(router.url + "/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200
    index = router.service.index
    # stats() expires nothing itself: only the router's timer can empty the table.
    assert eventually(lambda: index.stats()["speculative_blocks"] > 0, 2.0)
    assert eventually(lambda: index.stats()["speculative_blocks"] == 0, 3.0)
    # and the next request still gets its own entry, with the same routing as before
    resp = httpx.post(router.url + "/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200 and resp.headers["x-kvmesh-replica"] == "up"
    assert eventually(lambda: index.stats()["speculative_blocks"] > 0, 2.0)
