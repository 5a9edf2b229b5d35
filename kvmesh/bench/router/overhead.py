"""Measure the router's added latency: the same streamed request sent directly and through it.

A fake vLLM (:mod:`kvmesh.router.testing`) and the router each run in their own process
(the client, the router and the upstream share no interpreter lock). The router's index is
live: this process publishes vLLM-format KV events to it (:class:`EventPublisher`), a
prefill of ``index_blocks`` blocks first, then ``event_rate`` batches a second throughout
the measurement, as a busy replica would. Requests stream (``"stream": true``) and the
figure is the time to the first streamed chunk (what a user's TTFT gains), sent
alternately direct / routed over persistent connections; the added latency is routed
minus direct, request by request. Text is realistic (:mod:`kvmesh.bench.common.corpus`: Zipf
word frequencies over 30,000 words, so the router's word cache misses as on real text).
Two prompt shapes of ``tokens`` tokens:

* ``completion-unique``: a new prompt every time (sentences of the corpus shuffled anew:
  nothing cached but common words);
* ``chat-shared-system``: a system message shared by all (3/4 of the tokens) and a new user
  turn each time.

``python -m kvmesh.bench.router.overhead --model DIR --tokens 2000``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvmesh.bench.common.corpus import zipf_words
from kvmesh.bench.runner import percentile
from kvmesh.errors import ProcessError
from kvmesh.events import BlockStored, EventBatch
from kvmesh.events.publisher import EventPublisher
from kvmesh.harness.ports import free_port
from kvmesh.harness.processes import Service, get_json


class _FakeVLLMProcess(Service):
    """:class:`kvmesh.router.testing.FakeVLLM` as a process of its own."""

    name = "fake vLLM"

    def __init__(self) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", "kvmesh.router.testing", "--port", str(self.port)]
        super().__init__(args, {**os.environ, "PYTHONUNBUFFERED": "1"}, None)

    def ready(self) -> bool:
        return get_json(f"http://127.0.0.1:{self.port}/health", 1.0)[0] == 200


class _Feeder:
    """Publishes BlockStored batches (16-token blocks of random prompts) on a thread."""

    def __init__(self, pub: EventPublisher, rate: float, blocks_per_batch: int = 16) -> None:
        self.pub, self.rate, self.per = pub, rate, blocks_per_batch
        self._rng = random.Random(7)
        self._next_hash = 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="overhead-feeder", daemon=True)
        self.sent_blocks = 0

    def batch(self, blocks: int) -> EventBatch:
        h = self._next_hash
        self._next_hash += blocks
        toks = tuple(self._rng.randrange(4096) for _ in range(16 * blocks))
        self.sent_blocks += blocks
        return EventBatch(time.time(), (BlockStored(tuple(range(h, h + blocks)), None, toks, 16),))

    def prefill(self, blocks: int) -> None:
        for _ in range(blocks // 500):
            self.pub.publish(self.batch(500))
        self.pub.flush(30.0)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        period = 1.0 / self.rate
        nxt = time.perf_counter()
        while not self._stop.is_set():
            self.pub.publish(self.batch(self.per))
            nxt += period
            self._stop.wait(max(0.0, nxt - time.perf_counter()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@contextmanager
def _processes(model_dir: str, events: str) -> Iterator[tuple[int, int, str]]:
    """The fake upstream and the router over it (its index fed from ``events``)."""
    from kvmesh.harness.router import RouterProcess
    from kvmesh.router import RouterConfig
    from kvmesh.routing.config import ReplicaConfig

    with _FakeVLLMProcess() as fake:
        fake.start()
        replica = ReplicaConfig(url=f"http://127.0.0.1:{fake.port}", events=events, name="up")
        with RouterProcess(RouterConfig(model=model_dir, replicas=(replica,), port=0)) as router:
            router.start()
            yield fake.port, router.port, router.url


def _pool(tokens_per_word: float, tokens: int, seed: int) -> tuple[list[str], int]:
    """Sentences of the corpus (~2 x ``tokens`` of text in all) and words per prompt."""
    rng = random.Random(seed)
    n_words = int(tokens / tokens_per_word)
    text = zipf_words(rng, 2 * n_words)
    sentences = [s.strip() + "." for s in text.replace("?", ".").replace("!", ".").split(".") if s.strip()]
    return sentences, n_words


def _take(rng: random.Random, sentences: list[str], n_words: int) -> str:
    out: list[str] = []
    count = 0
    while count < n_words:
        s = rng.choice(sentences)
        out.append(s)
        count += s.count(" ") + 1
    return " ".join(out)


def _shapes(tokenize: Callable[[str], int], tokens: int, seed: int) -> dict[str, Callable[[int], bytes]]:
    sample = zipf_words(random.Random(seed), 3000)
    per_word = tokenize(sample) / 3000
    sentences, n_words = _pool(per_word, tokens, seed)
    system = _take(random.Random(seed + 1), sentences, n_words * 3 // 4)
    stream = {"stream": True, "max_tokens": 1, "model": "tiny"}

    def unique(i: int) -> bytes:
        return json.dumps(
            {**stream, "prompt": f"{i} " + _take(random.Random(seed * 1_000_003 + i), sentences, n_words)}
        ).encode()

    def chat(i: int) -> bytes:
        user = f"{i} " + _take(random.Random(seed * 7 + i), sentences, n_words // 4)
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return json.dumps({**stream, "messages": msgs}).encode()

    return {"completion-unique": unique, "chat-shared-system": chat}


def _first_chunk(conn: http.client.HTTPConnection, path: str, body: bytes) -> float:
    """Seconds to the first streamed ``data:`` line; the rest of the stream is drained."""
    t = time.perf_counter()
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise ProcessError(f"POST {path} answered {resp.status}: {resp.read()[:200]!r}")
    ttft = None
    while True:
        line = resp.readline()
        if not line:
            break
        if ttft is None and line.startswith(b"data:"):
            ttft = time.perf_counter() - t
    if ttft is None:
        raise ProcessError(f"POST {path} streamed no data line")
    return ttft


def measure(
    model_dir: str | None = None,
    tokens: int = 2000,
    n: int = 200,
    warmup: int = 10,
    index_blocks: int = 200_000,
    event_rate: float = 50.0,
) -> dict[str, Any]:
    """Added time to first streamed chunk per prompt shape (see the module docstring)."""
    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:
            from kvmesh.router.testing import write_test_tokenizer

            model_dir = str(write_test_tokenizer(Path(tmp) / "tok"))
        tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        shapes = _shapes(lambda s: len(tok.encode(s).ids), tokens, seed=1)
        out: dict[str, Any] = {"tokens": tokens, "n": n, "model": model_dir, "event_rate_per_s": event_rate,
                               "shapes": {}}  # fmt: skip
        with EventPublisher("tcp://127.0.0.1:0") as pub, _processes(model_dir, pub.endpoint) as (up, rt, url):
            feeder = _Feeder(pub, event_rate)
            time.sleep(1.0)  # PUB/SUB: let the router's subscription arrive before the prefill
            feeder.prefill(index_blocks)
            out["index_before"] = _wait_indexed(url, feeder.sent_blocks)
            feeder.start()
            try:
                direct = http.client.HTTPConnection("127.0.0.1", up, timeout=60)
                routed = http.client.HTTPConnection("127.0.0.1", rt, timeout=60)
                for si, (name, make) in enumerate(shapes.items()):
                    path = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
                    d: list[float] = []
                    r: list[float] = []
                    lens: list[int] = []
                    for i in range(warmup + n):
                        body = make(i + 10_000 * si)
                        td = _first_chunk(direct, path, body)
                        tr = _first_chunk(routed, path, body)
                        if i >= warmup:
                            d.append(td)
                            r.append(tr)
                            if len(lens) < 5:
                                lens.append(len(tok.encode(_prompt_text(body)).ids))
                    added = [(b - a) * 1e3 for a, b in zip(d, r, strict=True)]
                    out["shapes"][name] = {
                        "direct_ttft_ms_p50": round(statistics.median(d) * 1e3, 3),
                        "routed_ttft_ms_p50": round(statistics.median(r) * 1e3, 3),
                        "added_ms_p50": round(statistics.median(added), 3),
                        "added_ms_p90": round(percentile(added, 90), 3),
                        "added_ms_p99": round(percentile(added, 99), 3),
                        "prompt_tokens": round(statistics.mean(lens)),
                    }
            finally:
                feeder.stop()
            status, state = get_json(url + "/kvmesh/state", 5.0)
            out["index_after"] = state.get("index") if status == 200 and isinstance(state, dict) else None
            out["events_blocks_sent"] = feeder.sent_blocks
        return out


def _wait_indexed(url: str, blocks: int, timeout: float = 120.0) -> int:
    """Wait until the router's index holds the prefill (else its ingestion backlog would be
    timed as overhead); returns the blocks it holds."""
    deadline = time.monotonic() + timeout
    held = 0
    while time.monotonic() < deadline:
        status, state = get_json(url + "/kvmesh/state", 5.0)
        if status == 200 and isinstance(state, dict):
            held = int((state.get("index") or {}).get("blocks", 0))
            if held >= blocks:
                break
        time.sleep(0.2)
    return held


def _prompt_text(body: bytes) -> str:
    data = json.loads(body)
    return str(data.get("prompt") or " ".join(m["content"] for m in data["messages"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model directory with tokenizer.json (default: a small test tokenizer)")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("-n", type=int, default=200)
    p.add_argument("--json", help="write the result here too")
    args = p.parse_args()
    result = measure(args.model, args.tokens, args.n)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
