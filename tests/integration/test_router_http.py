"""The router over real loopback HTTP, in front of two fake vLLM servers (no mocked HTTP library)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from kvmesh.events import BlockStored, EventPublisher
from kvmesh.harness.ports import free_port
from kvmesh.router import RouterConfig
from kvmesh.router.server import Router
from kvmesh.router.testing import _WORDS, FakeVLLM
from kvmesh.routing.config import ReplicaConfig
from kvmesh.routing.tokenize import PromptTokenizer
from tests.waiting import wait_for

MakeRouter = Callable[..., Router]


@pytest.fixture
def fakes() -> Iterator[dict[str, FakeVLLM]]:
    servers = {name: FakeVLLM(name).start() for name in ("a", "b")}
    try:
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture
def make_router(tok_dir: Path, fakes: dict[str, FakeVLLM]) -> Iterator[MakeRouter]:
    started: list[Router] = []

    def make(**overrides: Any) -> Router:
        data: dict[str, Any] = {
            "model": str(tok_dir),
            "replicas": [ReplicaConfig(url=f.url, name=n) for n, f in fakes.items()],
            "port": 0,
            "health_interval_s": 0.2,
            "metrics_interval_s": 0.05,
            "replica_header": True,  # the tests read which replica answered (served_by)
        }
        data.update(overrides)
        router = Router(RouterConfig.from_dict(data)).start()
        started.append(router)
        return router

    try:
        yield make
    finally:
        for r in started:
            r.stop()


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as c:
        yield c


def words(seed: int, n: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), n))


def complete(client: httpx.Client, router: Router, prompt: str, **kw: Any) -> httpx.Response:
    return client.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": prompt}, **kw)


def served_by(resp: httpx.Response) -> str:
    return resp.headers["x-kvmesh-replica"]


def assert_openai_error(resp: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_ and err["code"] == status and err["message"]
    return dict(err)


# -- pass-through ---------------------------------------------------------------------------------


def test_non_streaming_pass_through(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM], client: httpx.Client
) -> None:
    router = make_router()
    raw = json.dumps(
        {"model": "tiny", "prompt": words(1, 50), "max_tokens": 3, "extra_field": [1, 2]}
    ).encode()
    resp = client.post(
        router.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 200
    fake = fakes[served_by(resp)]
    assert fake.requests[-1][1] == raw  # forwarded byte for byte
    assert resp.content == fake.responses[-1]
    assert resp.headers["content-type"].startswith("application/json")

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    resp = client.post(router.url + "/v1/chat/completions", json=chat)
    assert resp.status_code == 200 and resp.content == fakes[served_by(resp)].responses[-1]
    assert resp.json()["choices"][0]["message"]["role"] == "assistant"


def test_debug_log_explains_each_decision(
    make_router: MakeRouter, client: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    router = make_router()
    with caplog.at_level(logging.DEBUG, logger="kvmesh.router.app"):
        body = {"model": "tiny", "prompt": words(2, 40), "max_tokens": 2}
        resp = client.post(router.url + "/v1/completions", json=body, headers={"x-session-id": "s-7"})
        assert resp.status_code == 200
        wait_for(lambda: any("route " in r.getMessage() for r in caplog.records))
    line = next(r.getMessage() for r in caplog.records if "route " in r.getMessage())
    assert "(session s-7)" in line
    assert f"-> ['{served_by(resp)}'" in line  # the ranking, winner first
    for scorer in ("prefix", "queue", "kv_util", "session", "prefill"):
        assert f"'{scorer}'" in line


def test_streaming_arrives_chunk_by_chunk(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM], client: httpx.Client
) -> None:
    for f in fakes.values():
        f.chunk_delay_s, f.chunks = 0.3, 3
    router = make_router()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "stream please"}], "stream": True}
    t0 = time.monotonic()
    arrivals: list[float] = []
    got = b""
    with client.stream("POST", router.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for chunk in resp.iter_raw():
            arrivals.append(time.monotonic() - t0)
            got += chunk
        name = served_by(resp)
    assert got == fakes[name].responses[-1]
    assert got.endswith(b"data: [DONE]\n\n")
    assert arrivals[0] < arrivals[-1] - 0.4  # the first chunk did not wait for the last


def test_openai_client_through_the_router(make_router: MakeRouter) -> None:
    router = make_router()
    oai = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in oai.models.list()] == ["tiny"]
    comp = oai.completions.create(model="tiny", prompt=words(2, 20), max_tokens=3)
    assert comp.choices[0].text.endswith(":2 ")
    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}])
    assert chat.choices[0].message.content
    stream = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text.count(":") == 3
    pieces = [c.choices[0].text for c in oai.completions.create(model="tiny", prompt="x", stream=True)]
    assert len(pieces) == 3
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-model", prompt="x")


# -- errors ---------------------------------------------------------------------------------------


def test_errors_have_openai_shape(make_router: MakeRouter, client: httpx.Client) -> None:
    router = make_router(max_body_bytes=4096)
    url = router.url + "/v1/completions"
    assert_openai_error(client.post(url, content=b'{"model": "tiny", "prompt": '), 400, "BadRequestError")
    assert_openai_error(client.post(url, content=b"[1, 2]"), 400, "BadRequestError")
    err = assert_openai_error(client.post(url, json={"model": "gpt-9", "prompt": "x"}), 404, "NotFoundError")
    assert err["param"] == "model" and "gpt-9" in err["message"]
    big = {"model": "tiny", "prompt": "x" * 5000}
    assert_openai_error(client.post(url, json=big), 413, "RequestTooLargeError")
    metrics = client.get(router.url + "/metrics").text
    assert 'kvmesh_router_errors_total{kind="NotFoundError"} 1.0' in metrics


def test_no_healthy_replica_is_503_with_retry_after(make_router: MakeRouter, client: httpx.Client) -> None:
    dead = [ReplicaConfig(url=f"http://127.0.0.1:{free_port()}") for _ in range(2)]
    router = make_router(replicas=dead, retry_after_s=3)
    resp = complete(client, router, "x")
    assert_openai_error(resp, 503, "ServiceUnavailableError")
    assert resp.headers["Retry-After"] == "3"
    assert client.get(router.url + "/health").status_code == 503
    assert client.get(router.url + "/v1/models").status_code == 503


# -- failures -------------------------------------------------------------------------------------


def test_killed_replica_connect_failure_goes_to_the_next(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM], client: httpx.Client
) -> None:
    router = make_router(health_interval_s=60)  # only the proxy itself can notice the death
    fakes["a"].stop()
    for i in range(12):
        resp = complete(client, router, words(100 + i, 30))
        assert resp.status_code == 200 and served_by(resp) == "b"
    state = client.get(router.url + "/kvmesh/state").json()
    a = next(r for r in state["replicas"] if r["name"] == "a")
    assert not a["healthy"] and "POST /v1/completions failed" in a["last_error"]
    assert "kvmesh_router_retries_total 1.0" in client.get(router.url + "/metrics").text


@pytest.mark.parametrize("where", ["body", "head"])
def test_an_answer_broken_off_before_the_client_saw_it_goes_to_the_next(
    where: str, make_router: MakeRouter, fakes: dict[str, FakeVLLM], client: httpx.Client
) -> None:
    """A replica killed after its answer's headers but before the end of its body, or
    mid-way through its headers (the windows a SIGKILL mid-answer leaves): nothing of it
    reached the client, so the router sends the request to the next replica instead of
    answering 502."""
    if where == "body":
        fakes["a"].abort_body_after = 20
    else:
        fakes["a"].abort_in_head = True
    router = make_router(health_interval_s=60)  # only the proxy itself can notice the death
    i = 0
    while i < 6 or not fakes["a"].requests:  # until a has been tried (its prompt ranked it first)
        assert i < 40, "no prompt was routed to a first"
        resp = complete(client, router, words(200 + i, 30))
        assert resp.status_code == 200, resp.text
        assert served_by(resp) == "b" and resp.json()["choices"][0]["text"].startswith("b:0")
        i += 1
    state = client.get(router.url + "/kvmesh/state").json()
    a = next(r for r in state["replicas"] if r["name"] == "a")
    assert not a["healthy"] and "the answer broke off" in a["last_error"]
    metrics = client.get(router.url + "/metrics").text
    assert "kvmesh_router_retries_total 1.0" in metrics
    assert 'kvmesh_router_errors_total{kind="upstream_broken"} 1.0' in metrics
    pool = router.service.pool
    wait_for(lambda: all(r.state.in_flight == 0 for r in pool.replicas.values()))


def test_a_stream_broken_off_before_its_first_chunk_goes_to_the_next(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM], client: httpx.Client
) -> None:
    """A stream's headers reach the client only with its first chunk: a replica that dies
    during the prefill (headers sent, no token yet) leaves the request to the next one."""
    fakes["a"].abort_after_chunks = 0
    router = make_router(health_interval_s=60)
    i = 0
    while i < 6 or not fakes["a"].requests:  # until a has been tried (its prompt ranked it first)
        assert i < 40, "no prompt was routed to a first"
        i += 1
        body = {"model": "tiny", "prompt": words(300 + i, 30), "stream": True}
        with client.stream("POST", router.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200 and served_by(resp) == "b"
            got = resp.read()
        events = [e for e in got.split(b"\n\n") if e]
        assert len(events) == 4 and events[-1] == b"data: [DONE]", got  # 3 chunks and [DONE]
        assert all(b'"error"' not in e for e in events)
    assert "kvmesh_router_retries_total 1.0" in client.get(router.url + "/metrics").text


def test_answers_broken_off_by_every_replica_are_a_502(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM], client: httpx.Client
) -> None:
    for f in fakes.values():
        f.abort_body_after = 5
    router = make_router(health_interval_s=60)
    err = assert_openai_error(complete(client, router, words(400, 30)), 502, "BadGatewayError")
    assert "broke off its answer" in err["message"] and "2 replica(s) tried" in err["message"]
    pool = router.service.pool
    wait_for(lambda: all(r.state.in_flight == 0 for r in pool.replicas.values()))


def test_an_answer_over_max_answer_bytes_is_a_502_and_the_replica_stays(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM], client: httpx.Client
) -> None:
    """The router holds a whole answer in memory before relaying it, so it is bounded; one
    over the bound is a 502 naming it, not retried elsewhere (every replica would answer
    the same) and not a replica failure. A stream's chunks under the bound still flow."""
    for f in fakes.values():
        f.chunks = 40  # a whole answer of ~600 bytes; a stream's chunks ~200 bytes each
    router = make_router(max_answer_bytes=300)
    err = assert_openai_error(complete(client, router, words(500, 30)), 502, "BadGatewayError")
    assert "max_answer_bytes (300)" in err["message"], err
    assert sum(len(f.requests) for f in fakes.values()) == 1  # not retried
    assert all(r.healthy for r in router.service.pool.replicas.values())
    body = {"model": "tiny", "prompt": words(501, 30), "stream": True}
    with client.stream("POST", router.url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = [e for e in resp.read().split(b"\n\n") if e]
    assert len(events) == 41 and events[-1] == b"data: [DONE]"


def test_health_checks_remove_and_readd(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM], client: httpx.Client
) -> None:
    router = make_router()
    pool = router.service.pool
    fakes["b"].healthy = False
    wait_for(lambda: not pool.replicas["b"].healthy)
    for i in range(6):
        resp = complete(client, router, words(200 + i, 30))
        assert served_by(resp) == "a"
    fakes["b"].healthy = True
    wait_for(lambda: pool.replicas["b"].healthy)
    seen = {served_by(complete(client, router, words(300 + i, 30))) for i in range(20)}
    assert seen == {"a", "b"}


def test_replica_going_down_drops_its_entries_but_not_shared_ones(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM], tok_dir: Path, client: httpx.Client
) -> None:
    router = make_router(speculative_ttl_s=0)
    pt = PromptTokenizer.from_dir(tok_dir)
    own, shared = (pt.encode(words(seed, 300), True) for seed in (21, 22))
    _hold(router, "b", own)
    _hold(router, "a", shared, medium="REMOTE")
    assert "b" in router.index.match(own)
    assert {"a", "b"} <= set(router.index.match(shared))
    fakes["b"].healthy = False
    pool = router.service.pool
    wait_for(lambda: not pool.replicas["b"].healthy)
    # Its KV may be gone (a restarted vLLM does not say so until its next event): forgotten,
    # by the router's thread just after it marks the replica down.
    wait_for(lambda: "b" not in router.index.match(own))
    assert {"a", "b"} <= set(router.index.match(shared))  # shared blocks still count for it
    fakes["b"].healthy = True
    wait_for(lambda: pool.replicas["b"].healthy)
    assert "b" not in router.index.match(own)


def test_prefill_work_is_counted_until_the_first_chunk(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM], client: httpx.Client
) -> None:
    for f in fakes.values():
        f.delay_s, f.chunks, f.chunk_delay_s = 0.6, 3, 0.6
    router = make_router()
    states = router.service.pool.replicas

    def queued() -> dict[str, float]:
        return {n: r.state.prefill_tokens for n, r in states.items() if r.state.prefill_tokens}

    body = {"model": "tiny", "prompt": words(31, 200), "stream": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Before the replica answers, the whole prompt counts as work queued on it.
        pending = pool.submit(lambda: complete(client, router, words(30, 200)))
        wait_for(lambda: len(queued()) == 1, timeout_s=0.5)
        assert next(iter(queued().values())) > 100
        assert pending.result().status_code == 200
    assert queued() == {}
    with client.stream("POST", router.url + "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        name = served_by(resp)
        assert queued() == {} and states[name].state.in_flight == 1  # prefill done, still decoding
        list(lines)
    # A non-streamed answer counts until it is whole, and nothing is left after either.
    fakes["a"].delay_s = fakes["b"].delay_s = 0.0
    assert complete(client, router, words(32, 50)).status_code == 200
    assert queued() == {}


def test_client_leaving_mid_stream_releases_the_replica(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM], client: httpx.Client
) -> None:
    for f in fakes.values():
        f.chunk_delay_s, f.chunks = 0.5, 4
    router = make_router()
    body = {"model": "tiny", "prompt": "x", "stream": True}
    with client.stream("POST", router.url + "/v1/completions", json=body) as resp:
        next(resp.iter_raw())
    states = router.service.pool.replicas.values()
    wait_for(lambda: all(r.state.in_flight == 0 for r in states), timeout_s=5)
    assert complete(client, router, "y").status_code == 200


# -- routing --------------------------------------------------------------------------------------


def test_session_affinity(make_router: MakeRouter, client: httpx.Client) -> None:
    router = make_router()
    for s in range(6):
        headers = {"x-session-id": f"user-{s}"}
        homes = {
            served_by(complete(client, router, words(1000 * s + t, 40), headers=headers)) for t in range(4)
        }
        assert len(homes) == 1


def _hold(router: Router, replica: str, tokens: np.ndarray, medium: str = "GPU", bs: int = 16) -> None:
    n = len(tokens) // bs
    ev = BlockStored(tuple(range(1, n + 1)), None, tuple(int(t) for t in tokens[: n * bs]), bs, medium=medium)
    router.index.store(replica, ev)


def test_follow_up_goes_where_the_prefix_is(
    make_router: MakeRouter, tok_dir: Path, client: httpx.Client
) -> None:
    router = make_router()
    pt = PromptTokenizer.from_dir(tok_dir)
    prefixes = {"a": words(7, 400), "b": words(8, 400)}
    for holder, text in prefixes.items():
        _hold(router, holder, pt.encode(text, add_special_tokens=True))
    for holder, text in prefixes.items():
        for tail in ("and then some", "a different ending entirely"):
            resp = client.post(
                router.url + "/v1/completions", json={"model": "tiny", "prompt": f"{text} {tail}"}
            )
            assert served_by(resp) == holder
    metrics = client.get(router.url + "/metrics").text
    assert 'kvmesh_router_prefix_hit_tokens_total{medium="GPU"}' in metrics
    assert 'kvmesh_router_decisions_total{policy="kvmesh",replica="a"} 2.0' in metrics


def test_burst_is_pinned_by_speculative_entries_until_load_says_no(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM], tok_dir: Path, client: httpx.Client
) -> None:
    router = make_router(speculative_ttl_s=30)
    pt = PromptTokenizer.from_dir(tok_dir)
    text = words(9, 400)
    first = served_by(complete(client, router, text))
    # No KV event has arrived, yet the index already points the prefix at the first replica.
    assert first in router.index.match(pt.encode(text, True))
    for i in range(5):
        resp = client.post(
            router.url + "/v1/completions", json={"model": "tiny", "prompt": f"{text} {words(i, 5)}"}
        )
        assert served_by(resp) == first
    # That replica's queue gets much longer than the other's: the load term wins.
    fakes[first].waiting = 40
    pool = router.service.pool
    wait_for(lambda: pool.replicas[first].state.waiting == 40)
    resp = client.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": f"{text} later"})
    assert served_by(resp) != first


def test_kv_events_from_zmq_feed_the_index(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM], tok_dir: Path, client: httpx.Client
) -> None:
    pt = PromptTokenizer.from_dir(tok_dir)
    text = words(11, 300)
    tokens = pt.encode(text, True)
    with EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        replicas = [
            ReplicaConfig(url=fakes["a"].url, name="a"),
            ReplicaConfig(url=fakes["b"].url, name="b", events=pub.endpoint, replay=pub.replay_endpoint),
        ]
        router = make_router(replicas=replicas, speculative_ttl_s=0)
        n = len(tokens) // 16
        ev = BlockStored(tuple(range(1, n + 1)), None, tuple(int(t) for t in tokens[: n * 16]), 16)

        def arrived() -> bool:
            pub.publish([ev])  # PUB/SUB drops what is sent before the subscription is up
            time.sleep(0.05)
            return "b" in router.index.match(tokens)

        wait_for(arrived)
        for tail in ("one", "two", "three"):
            resp = client.post(
                router.url + "/v1/completions", json={"model": "tiny", "prompt": f"{text} {tail}"}
            )
            assert served_by(resp) == "b"


def test_remote_tokenizer_mode(make_router: MakeRouter, client: httpx.Client) -> None:
    router = make_router(tokenizer="remote", model=None)
    text = words(12, 100)
    resp = complete(client, router, text)
    assert resp.status_code == 200
    ids = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint32)  # the fake's /tokenize
    assert served_by(resp) in router.index.match(ids)


def test_concurrent_burst_of_one_prefix_spreads_by_load(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM]
) -> None:
    """llm-d's lesson: prefix-only routing piles a hot prefix onto one replica; the load term must not."""
    for f in fakes.values():
        f.delay_s = 0.5
    router = make_router(speculative_ttl_s=30)
    text = words(13, 400)

    async def burst() -> list[str]:
        async with httpx.AsyncClient(timeout=20) as c:
            sends = [
                c.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": f"{text} {i}"})
                for i in range(40)
            ]
            return [served_by(r) for r in await asyncio.gather(*sends)]

    got = asyncio.run(burst())
    assert min(got.count("a"), got.count("b")) >= 10, got
    pool = router.service.pool
    wait_for(lambda: all(r.state.in_flight == 0 for r in pool.replicas.values()))


def test_replica_dying_mid_stream_ends_the_stream_with_an_error_event(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM], client: httpx.Client
) -> None:
    for f in fakes.values():
        f.abort_after_chunks, f.chunks = 1, 3
    router = make_router()
    body = {"model": "tiny", "prompt": "x", "stream": True}
    with client.stream("POST", router.url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        got = resp.read()
    events = [e for e in got.split(b"\n\n") if e]
    assert len(events) == 2 and b"text_completion" in events[0]
    assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == 502
    assert (
        'kvmesh_router_errors_total{kind="upstream_broken"} 1.0' in client.get(router.url + "/metrics").text
    )


def test_a_replica_without_load_gauges_is_scraped_less_often(
    make_router: MakeRouter, fakes: dict[str, FakeVLLM]
) -> None:
    """vLLM with --disable-log-stats serves a /metrics page without its gauges: each scrape
    costs its API server CPU for nothing, so the router backs off, and resumes when they return."""
    fakes["b"].gauges = False
    fakes["a"].waiting = 3.0
    router = make_router()  # scrapes every 0.05 s
    states = router.service.pool.replicas
    wait_for(lambda: states["a"].state.waiting == 3.0)
    start = {n: f.metrics_requests for n, f in fakes.items()}
    time.sleep(1.0)
    got = {n: f.metrics_requests - start[n] for n, f in fakes.items()}
    assert got["a"] >= 10, got  # ~20 at 0.05 s
    assert got["b"] <= 2, got  # backed off to every 20 intervals (1 s)
    fakes["b"].gauges, fakes["b"].waiting = True, 5.0
    wait_for(lambda: states["b"].state.waiting == 5.0, timeout_s=3.0)
    start_b = fakes["b"].metrics_requests
    time.sleep(0.5)
    assert fakes["b"].metrics_requests - start_b >= 5  # back to the normal pace


def test_a_body_that_never_arrives_is_a_408_not_a_hang(make_router: MakeRouter) -> None:
    """A client that sends the headers and part of the body (a stalled upload, a slowloris)
    gets 408 with Retry-After once body_timeout_s passes; the handler never waits forever
    (it once held a rolling restart's drain for its whole timeout)."""
    import socket

    router = make_router(body_timeout_s=0.5)
    with socket.create_connection(("127.0.0.1", router.port), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"model": "tiny"'
        )
        t0 = time.monotonic()
        head = sock.recv(4096).decode(errors="replace")
        waited = time.monotonic() - t0
    assert head.startswith("HTTP/1.1 408"), head[:200]
    assert "retry-after:" in head.lower()
    assert 0.3 < waited < 3.0
