"""Attack: probe through the EPP whether another tenant's prompt is cached, by asking with a
different ``cache_salt`` and watching where the request goes (and how fast it answers).

vLLM keys a salted prompt's first block by its salt, so tenants with different salts never
share KV; a router that matched a salted prompt without its salt would still steer it to
whoever holds the unsalted (or other-salted) blocks, telling the prober that someone sent
that prompt. Here everything is real but the model servers: the EPP on a loopback gRPC port,
spoken to as Envoy does, its index fed by KV events over a real ZMQ socket with the salt in
the first block's ``extra_keys`` as vLLM publishes it; the endpoints are FakeVLLM servers on
loopback sockets. One endpoint holds the prompt's blocks and carries one request more than
the other, so only a prefix match can send a request there.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.epp.scoring import endpoint_name
from kvmesh.epp.server import EppThread
from kvmesh.events import EventPublisher
from kvmesh.events.codec import BlockStored
from kvmesh.router.testing import FakeVLLM
from kvmesh.routing.config import ReplicaConfig
from kvmesh.routing.tokenize import PromptTokenizer
from tests.unit.epp.test_protocol import completion, dest, make_epp, route

BLOCK = 16
PROMPT = "the tenant's private system prompt names rivers stones and quiet harbours " * 12


@pytest.fixture
def cluster(tok_dir: Path) -> Iterator[tuple[EppThread, list[FakeVLLM], EventPublisher]]:
    fakes = [FakeVLLM(f"s{i}").start() for i in range(2)]
    pub = EventPublisher("tcp://127.0.0.1:0")
    # the holder publishes its KV events; speculative entries off, so only events count
    replicas = (ReplicaConfig(url=fakes[0].url), ReplicaConfig(url=fakes[1].url, events=pub.endpoint))
    epp = make_epp(fakes, tok_dir, speculative_ttl_s=0.0, replicas=replicas)
    try:
        yield epp, fakes, pub
    finally:
        epp.stop()
        pub.close()
        for f in fakes:
            f.stop()


def _store(epp: EppThread, pub: EventPublisher, tokens: list[int], salt: str | None) -> None:
    """The holder stores the prompt's whole blocks (salted as vLLM keys them) and the EPP's
    index has them; PUB/SUB drops what is sent before the subscription is up, so resend."""
    n = len(tokens) // BLOCK
    extra = None if salt is None else ((salt,), *([None] * (n - 1)))
    ev = BlockStored(tuple(range(1, n + 1)), None, tuple(tokens[: n * BLOCK]), BLOCK, extra_keys=extra)
    before = epp.picker.index.stats()["stored_blocks"]
    deadline = time.monotonic() + 10
    while epp.call(lambda: epp.picker.index.stats()["stored_blocks"]) < before + n:
        assert time.monotonic() < deadline, "the KV events never reached the EPP's index"
        pub.publish([ev])
        time.sleep(0.05)


def _routed_to(epp: EppThread, salt: str | None) -> str:
    (h, _), s = route(epp, completion(PROMPT, **({"cache_salt": salt} if salt else {})))
    s.close()
    return dest(h)[0]


@pytest.mark.parametrize("stored_salt", [None, "tenant-a"])
def test_a_salted_request_is_not_steered_by_another_salts_blocks(
    cluster: tuple[EppThread, list[FakeVLLM], EventPublisher], tok_dir: Path, stored_salt: str | None
) -> None:
    epp, fakes, pub = cluster
    holder, other = endpoint_name(fakes[1].url), endpoint_name(fakes[0].url)
    tokens = [int(t) for t in PromptTokenizer.from_dir(tok_dir).encode(PROMPT, True)]
    _store(epp, pub, tokens, stored_salt)
    epp.call(lambda: epp.picker.pool.hold(holder))  # the holder is busier: only a match goes there
    # the owner of the blocks (same salt, or none) is sent to them ...
    assert _routed_to(epp, stored_salt) == holder
    # ... a prober with another salt is not: its blocks are keyed by its own salt
    assert _routed_to(epp, "prober") == other
    if stored_salt is not None:
        assert _routed_to(epp, None) == other  # nor is an unsalted request
