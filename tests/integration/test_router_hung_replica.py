"""A replica that hangs behind the router: its process SIGSTOPped (a wedged GPU, a stopped
container), its connections open, nothing broken. The replicas are fake vLLM servers
(``python -m kvmesh.router.testing``) in processes of their own, so the stop is a real one;
the router runs here with fast health checks.

What the router owes its clients: an answer that had not begun goes to the other replica once
the health checks take the hung one out (not after the 600 s read timeout); a stream already
begun ends with an error event."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvmesh.harness.ports import free_port, wait_for_port
from kvmesh.router import RouterConfig
from kvmesh.router.server import Router
from kvmesh.router.testing import FakeVLLM, write_test_tokenizer
from kvmesh.routing.config import ReplicaConfig
from tests.waiting import wait_for

Fake = Callable[..., tuple[str, subprocess.Popen[bytes]]]


@pytest.fixture
def fake() -> Iterator[Fake]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        cmd = [sys.executable, "-m", "kvmesh.router.testing", "--port", str(port), "--name", name, *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        wait_for_port(port, timeout=30)
        return f"http://127.0.0.1:{port}", proc

    yield start
    for proc in procs:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def router(tmp_path: Path, urls: dict[str, str]) -> Router:
    cfg = RouterConfig.from_dict(
        {
            "model": str(write_test_tokenizer(tmp_path / "tok")),
            "replicas": [ReplicaConfig(url=u, name=n) for n, u in urls.items()],
            "port": 0,
            "policy": "round-robin",
            "health_interval_s": 0.2,
            "health_timeout_s": 0.3,
            "health_failure_threshold": 2,
            "replica_header": True,
        }
    )
    r = Router(cfg).start()
    deadline = time.monotonic() + 10
    while len(r.service.pool.healthy()) < len(urls) and time.monotonic() < deadline:
        time.sleep(0.05)
    return r


def test_answers_owed_by_a_hung_replica_go_to_the_other_one(tmp_path: Path, fake: Fake) -> None:
    url_a, proc_a = fake("a", "--delay-s", "1.0")
    url_b, _ = fake("b", "--delay-s", "1.0")
    r = router(tmp_path, {"a": url_a, "b": url_b})
    try:

        def ask(i: int) -> tuple[int, str, float]:
            t0 = time.monotonic()
            body = {"model": "tiny", "prompt": f"hello {i}", "max_tokens": 3}
            resp = httpx.post(f"{r.url}/v1/completions", json=body, timeout=60)
            return resp.status_code, resp.headers.get("x-kvmesh-replica", ""), time.monotonic() - t0

        with ThreadPoolExecutor(4) as pool:
            asked = [pool.submit(ask, i) for i in range(4)]
            time.sleep(0.3)  # every request is in flight, two of them on a
            os.kill(proc_a.pid, signal.SIGSTOP)
            got = [f.result() for f in asked]
        assert [(status, served) for status, served, _ in got] == [(200, "b")] * 4, got
        # the health checks' ~0.5-1 s and b's answer, not the read timeout
        assert max(s for _, _, s in got) < 8, got
        stats = r.service.metrics.errors.labels("upstream_down")._value.get()
        assert stats == 2
    finally:
        r.stop()


def test_a_stream_whose_replica_hangs_ends_with_an_error_event(tmp_path: Path, fake: Fake) -> None:
    url_a, proc_a = fake("a", "--chunks", "200", "--chunk-delay-s", "0.05")
    r = router(tmp_path, {"a": url_a})
    try:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 200, "stream": True}
        events: list[str] = []
        t0 = time.monotonic()
        with httpx.stream("POST", f"{r.url}/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 3:
                    os.kill(proc_a.pid, signal.SIGSTOP)
        took = time.monotonic() - t0
        assert 3 <= len(events) < 200
        err = json.loads(events[-1])["error"]
        assert err["code"] == 502 and "was taken out" in err["message"], err
        assert took < 8
    finally:
        r.stop()


def test_a_replica_taken_out_keeps_its_flowing_streams_and_gives_up_its_quiet_answers(
    tmp_path: Path,
) -> None:
    """Taken out while it still answers (its /health says 503 here; late checks from a busy
    replica or router look the same): a stream it is sending keeps going to its end, while a
    whole answer it has been quiet on goes to the other replica."""
    fakes = {n: FakeVLLM(n).start() for n in ("a", "b")}
    for f in fakes.values():
        f.chunks, f.chunk_delay_s = 40, 0.05
    r = router(tmp_path, {n: f.url for n, f in fakes.items()})
    body = {"model": "tiny", "prompt": "x", "stream": True}

    def stream() -> tuple[str, list[str]]:
        with httpx.stream("POST", f"{r.url}/v1/completions", json=body, timeout=30) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
            return resp.headers["x-kvmesh-replica"], events

    try:
        with ThreadPoolExecutor(3) as ex:
            first = ex.submit(stream)  # round-robin: to x
            wait_for(lambda: sum(len(f.requests) for f in fakes.values()) == 1, 5, "the first stream sent")
            x = next(n for n, f in fakes.items() if f.requests)
            y = next(n for n in fakes if n != x)
            second = ex.submit(stream)  # to y
            wait_for(lambda: len(fakes[y].requests) == 1, 5, "the second stream sent")
            fakes[x].delay_s = 3.0  # the next whole answer: a long quiet
            quiet = ex.submit(
                httpx.post, f"{r.url}/v1/completions", json={"model": "tiny", "prompt": "y"}, timeout=30
            )
            wait_for(lambda: len(fakes[x].requests) == 2, 5, "the whole answer sent to x")
            time.sleep(0.4)  # quiet for longer than health_timeout_s, while x's stream flows
            fakes[x].healthy = False
            t0 = time.monotonic()
            answer = quiet.result()
            waited = time.monotonic() - t0
            (served, events), (_, other) = first.result(), second.result()
        assert served == x
        assert events[-1] == "[DONE]" and len(events) == 41  # 40 chunks, all of them
        assert other[-1] == "[DONE]" and len(other) == 41
        assert answer.status_code == 200 and answer.headers["x-kvmesh-replica"] == y
        assert waited < 2.0  # cut at the next health check, not x's answer after its 3 s
    finally:
        r.stop()
        for f in fakes.values():
            f.stop()
