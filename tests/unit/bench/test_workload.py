"""The workload replayer against a fake OpenAI server: every request answered and measured,
first turns alone for the idle-miss floor."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from kvmesh.bench.common.workload import Workload, idle_ttfts, replay
from kvmesh.errors import ProcessError
from kvmesh.router.testing import FakeVLLM


@pytest.fixture
def fake() -> Iterator[FakeVLLM]:
    server = FakeVLLM("a").start()
    try:
        yield server
    finally:
        server.stop()


def test_replay_sends_every_turn_with_the_conversation_so_far(fake: FakeVLLM) -> None:
    wl = Workload.multi_tenant(tenants=3, users=2, turns=2, prefix_words=20, question_words=5, seed=1)
    result = replay(wl, fake.url, "tiny", concurrency=2)
    assert len(result.samples) == wl.num_requests == 12
    assert all(s.ok for s in result.samples), [s.error for s in result.samples if not s.ok]
    assert all(0 < s.ttft_s <= s.latency_s for s in result.samples)
    bodies = [json.loads(raw) for path, raw, _ in fake.requests if path == "/v1/chat/completions"]
    assert len(bodies) == 12
    # A second turn carries the first question and the first answer.
    lengths = sorted(len(b["messages"]) for b in bodies)
    assert lengths == [2] * 6 + [4] * 6
    assert result.summary()["requests"] == 12 and result.summary()["errors"] == 0


def test_replay_of_a_dead_server_reports_errors_not_a_crash() -> None:
    from kvmesh.harness.ports import free_port

    wl = Workload.multi_tenant(tenants=1, users=1, turns=2, prefix_words=5, seed=2)
    result = replay(wl, f"http://127.0.0.1:{free_port()}", "tiny", concurrency=1)
    assert len(result.samples) == 2 and not any(s.ok for s in result.samples)
    assert result.summary()["errors"] == 2


def test_idle_ttfts_sends_new_tenants_first_turns_one_at_a_time(fake: FakeVLLM) -> None:
    fake.delay_s = 0.05
    wl = Workload.multi_tenant(tenants=3, users=1, turns=3, prefix_words=20, seed=3)
    t0 = time.monotonic()
    ttfts = idle_ttfts(wl, fake.url, "tiny", settle_s=0.2)
    assert len(ttfts) == 3 and all(t >= 0.05 for t in ttfts)
    assert time.monotonic() - t0 >= 2 * 0.2 + 3 * 0.05  # settled between requests
    bodies = [json.loads(raw) for path, raw, _ in fake.requests if path == "/v1/chat/completions"]
    assert len(bodies) == 3
    systems = [b["messages"][0]["content"] for b in bodies]
    assert len(set(systems)) == 3  # three different tenants: each a first touch
    assert all([m["role"] for m in b["messages"]] == ["system", "user"] for b in bodies)


def test_idle_ttfts_raises_when_a_request_fails(fake: FakeVLLM) -> None:
    wl = Workload.multi_tenant(tenants=1, users=1, turns=1, prefix_words=5, seed=4)
    with pytest.raises(ProcessError, match="lone first turn failed"):
        idle_ttfts(wl, fake.url, "not-the-model")
