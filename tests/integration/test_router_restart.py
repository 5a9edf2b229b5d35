"""The router survives its own restart: a ``kvmesh router`` process is SIGKILLed mid-run and
started again, and within a few seconds its decisions credit the same prefixes as before.

Real processes and sockets: the router is a child process; the replicas are FakeVLLM servers
(router/testing.py) whose KV events come from real ZMQ publishers (one with a replay socket,
as vLLM's), and one replica's kvmesh admin API is a real AdminServer whose ``held`` source
returns the events its tracker would have recorded. The old router came back with an empty
index and routed by load alone until new events arrived.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kvmesh import CacheConfig, CacheEngine, KVLayout
from kvmesh.admin.server import AdminServer
from kvmesh.events import BlockStored, EventPublisher
from kvmesh.router.testing import FakeVLLM, corpus, write_test_tokenizer
from kvmesh.routing.tokenize import PromptTokenizer
from tests.waiting import wait_for

TOKEN = "restart-token"
BS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stored(tokens: Any, first_hash: int, medium: str) -> BlockStored:
    n = len(tokens) // BS
    hashes = tuple(range(first_hash, first_hash + n))
    return BlockStored(hashes, None, tuple(int(t) for t in tokens[: n * BS]), BS, medium=medium)


def as_json(ev: BlockStored) -> dict[str, Any]:
    return {
        "block_hashes": list(ev.block_hashes),
        "parent_block_hash": ev.parent_block_hash,
        "token_ids": list(ev.token_ids),
        "block_size": ev.block_size,
        "medium": ev.medium,
    }


class RouterProcess:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.argv, self.log = argv, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "KVMESH_ADMIN_TOKEN": TOKEN}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=env)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def tok_dir(tmp_path: Path) -> Path:
    return write_test_tokenizer(tmp_path / "tok")


@pytest.fixture
def fakes() -> Iterator[dict[str, FakeVLLM]]:
    out = {n: FakeVLLM(n).start() for n in ("r0", "r1")}
    yield out
    for f in out.values():
        f.stop()


def test_restarted_router_credits_the_same_prefixes(
    tmp_path: Path, tok_dir: Path, fakes: dict[str, FakeVLLM]
) -> None:
    pt = PromptTokenizer.from_dir(tok_dir)
    texts = [" ".join(corpus(40, seed=s)) for s in range(4)]  # ~400 tokens each
    home = {0: "r0", 1: "r0", 2: "r1", 3: "r1"}
    events = {
        i: stored(pt.encode(t, True), 1000 * (i + 1), "GPU" if home[i] == "r0" else "CPU")
        for i, t in enumerate(texts)
    }
    held_events = [as_json(events[i]) for i in (2, 3)]

    def held(cursor: int, limit: int) -> dict[str, Any]:
        page = held_events[cursor : cursor + limit]
        end = cursor + len(page)
        return {"events": page, "next": end if end < len(held_events) else None}

    layout = KVLayout(1, 1, 8, torch.float32)
    engine = CacheEngine(
        CacheConfig.from_dict({"chunk_size": BS, "max_local_cpu_size": 0.001}), layout=layout, model_id="m"
    )
    admin = AdminServer(engine, token=TOKEN, held=held).start()
    pub0 = EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    pub1 = EventPublisher("tcp://127.0.0.1:0")  # no replay socket: the admin API must fill in
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    r0 = f"{fakes['r0'].url},name=r0,events={pub0.endpoint},replay={pub0.replay_endpoint}"
    r1 = f"{fakes['r1'].url},name=r1,events={pub1.endpoint},admin={admin.url}"
    argv = [sys.executable, "-m", "kvmesh.cli", "router", "--model", str(tok_dir), "--port", str(port)]
    router = RouterProcess([*argv, "--replica", r0, "--replica", r1], tmp_path / "router.log")

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def served(i: int) -> str:
        body = {"model": "tiny", "prompt": texts[i] + " and one more", "max_tokens": 1}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert resp.status_code == 200, resp.text
        return str(resp.json()["choices"][0]["text"]).split(":")[0]

    def all_home() -> bool:
        return all(served(i) == home[i] for i in home)

    try:
        router.start()
        wait_for(up, 60)

        def indexed() -> bool:
            pub0.publish([events[0], events[1]])  # PUB/SUB drops what precedes the subscription
            pub1.publish([events[2], events[3]])
            time.sleep(0.2)
            blocks = httpx.get(url + "/kvmesh/state", timeout=5).json()["index"]
            return bool(blocks.get("blocks", 0) >= sum(len(e.block_hashes) for e in events.values()))

        wait_for(indexed, 20)
        assert all_home(), "before the kill, each prompt goes where its prefix is"
        # `kvmesh router` froze its start-up heap (kvmesh.routing.loop.freeze_heap)
        assert httpx.get(url + "/kvmesh/state", timeout=5).json()["gc"]["frozen"] > 10_000
        before = httpx.get(url + "/kvmesh/state", timeout=5).json()["index"]["blocks"]

        router.kill()
        router.start()  # mid-run: the replicas and their caches stay as they are
        wait_for(up, 60)
        took = wait_for(all_home, 5.0)
        after = httpx.get(url + "/kvmesh/state", timeout=5).json()["index"]["blocks"]
        assert after >= before, (before, after)
        print(f"decisions credit the held prefixes again {took:.2f}s after the restarted router is up")
    finally:
        router.kill()
        admin.stop()
        pub0.close()
        pub1.close()
        engine.close(timeout=5)
