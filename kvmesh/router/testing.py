"""Test doubles shipped with the router: a fake vLLM server and a small tokenizer.

:class:`FakeVLLM` speaks the part of vLLM's HTTP API the router touches (``/v1/completions``
and ``/v1/chat/completions`` with SSE streaming, ``/v1/models``, ``/health``, ``/metrics``
with the ``vllm:`` load gauges, ``/tokenize``) on a real loopback socket, in a thread, and
records what it received. Its answers name the replica, so a test sees where a request went.
Run it as a process (``python -m kvmesh.router.testing --port 8100``) to measure the
router's added latency without the two sharing one interpreter lock.

:func:`write_test_tokenizer` writes a tokenizer directory in the format of
``kvmesh.harness.model.make_tiny`` (byte-level BPE, BOS post-processor, the same chat
template; the one trainer of :mod:`kvmesh.harness.tokenizer`), trained on a small corpus in
well under a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web

WORDS = (
    "the", "cat", "dog", "sat", "on", "mat", "a", "quick", "brown", "fox", "jumps", "over", "lazy",
    "river", "stone", "cache", "block", "prefix", "token", "router", "replica", "request", "model",
    "answer", "question", "system", "user", "assistant", "hello", "world", "one", "two", "three",
    "four", "five", "six", "seven", "eight", "nine", "ten", "red", "green", "blue", "light", "dark",
    "fast", "slow",
)  # fmt: skip
_WORDS = WORDS  # its name before the benchmarks used it (tests import this one)


def corpus(n_sentences: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + rng.choice(".?!,")
        for _ in range(n_sentences)
    ]


def write_test_tokenizer(out_dir: str | Path, vocab: int = 600) -> Path:
    """Write a tokenizer directory (tokenizer.json + configs, the tiny models' format) to
    ``out_dir``; return the directory."""
    from kvmesh.harness.tokenizer import BOS, train_bpe, write_tokenizer_files

    return write_tokenizer_files(train_bpe(corpus(), vocab, bos=BOS), out_dir)


async def cut_answer(request: web.Request, body: bytes, keep: int) -> web.StreamResponse:
    """A JSON answer's headers (its full Content-Length) and ``keep`` bytes of ``body``,
    then the connection cut: a replica that dies mid-answer."""
    cut = web.StreamResponse(headers={"Content-Type": "application/json"})
    cut.content_length = len(body)
    await cut.prepare(request)
    await cut.write(body[:keep])
    if request.transport is not None:
        request.transport.abort()
    return cut


async def cut_head(request: web.Request) -> web.StreamResponse:
    """A status line and part of a header, then the connection cut: a replica that dies
    while it writes its answer's head."""
    if request.transport is not None:
        request.transport.write(b"HTTP/1.1 200 OK\r\nContent-Ty")
        request.transport.abort()
    return web.Response()  # never sent: the connection is gone


class FakeVLLM:
    """A fake vLLM OpenAI server on ``127.0.0.1:port`` (0: a free port), run on a thread.

    Settable at any time: ``waiting``, ``running``, ``kv_usage`` (the scraped gauges),
    ``healthy`` (``/health`` answers 503 when False), ``delay_s`` (before answering;
    ``tokenize_delay_s`` before ``/tokenize`` answers),
    ``prefill_s`` (a stream's headers go at once, as vLLM's do, its first chunk this much
    later), ``chunks`` (SSE chunks per streamed answer), ``chunk_delay_s`` (between them),
    ``abort_after_chunks`` (cut the connection after that many chunks, like a crash),
    ``abort_body_after`` (a whole answer: its headers and this many bytes of its body, then
    the connection cut), ``abort_in_head`` (the connection cut mid-way through the head),
    ``gauges`` (False: ``/metrics`` without vLLM's gauges; ``metrics_requests`` counts scrapes),
    ``max_model_len`` (what ``/v1/models`` reports, as vLLM does; None: not reported),
    ``extra_metrics`` (text appended to ``/metrics``: kvmesh's own ``kvmesh:*`` gauges),
    ``prefill_s_per_word`` (with it, prompts are "prefilled" one at a time, each taking its
    words times this: a queue with a prefill rate, like an engine's).
    ``adapters`` (LoRA adapter name -> path: served too, and listed by ``/v1/models`` with
    ``parent`` = the base model, as vLLM lists ``--lora-modules``).
    ``requests`` holds ``(path, raw body, headers)``; ``responses`` the bytes sent back.
    """

    def __init__(self, name: str, model: str = "tiny", port: int = 0) -> None:
        self.name = name
        self.model = model
        self.adapters: dict[str, str] = {}
        self.waiting = 0.0
        self.running = 0.0
        self.kv_usage = 0.0
        self.healthy = True
        self.delay_s = 0.0
        self.tokenize_delay_s = 0.0  # before /tokenize answers
        self.prefill_s = 0.0
        self.chunks = 3
        self.chunk_delay_s = 0.0
        self.abort_after_chunks: int | None = None  # drop the connection mid-stream (a crash)
        self.abort_body_after: int | None = None  # the same, mid-way through a whole answer
        self.abort_in_head = False  # the same, mid-way through the answer's head
        self.gauges = True  # False: /metrics without vLLM's gauges (--disable-log-stats)
        self.max_model_len: int | None = 131072
        self.extra_metrics = ""
        self.prefill_s_per_word = 0.0
        self._prefill: asyncio.Lock | None = None
        self.metrics_requests = 0
        self.requests: list[tuple[str, bytes, dict[str, str]]] = []
        self.responses: list[bytes] = []
        self._port = port
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        return app

    def start(self) -> FakeVLLM:
        self._thread = threading.Thread(target=self._run, name=f"fake-vllm-{self.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("fake vLLM did not start")
        return self

    def stop(self) -> None:
        """Close the listening socket and every connection: later connects are refused."""
        loop, runner = self._loop, self._runner
        if loop is None or runner is None or self._thread is None:
            return
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        self._loop = self._runner = None

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        runner = self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", self._port, reuse_address=True)
        loop.run_until_complete(site.start())
        self.port = int(runner.addresses[0][1])
        self._ready.set()
        loop.run_forever()
        loop.close()

    # -- handlers -----------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        self.requests.append((request.path, raw, dict(request.headers)))
        body: dict[str, Any] = json.loads(raw)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.prefill_s_per_word:
            if self._prefill is None:
                self._prefill = asyncio.Lock()
            words = len(str(body.get("prompt") or body.get("messages") or "").split())
            async with self._prefill:
                await asyncio.sleep(words * self.prefill_s_per_word)
        return body

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        return await self._answer(request, body, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        return await self._answer(request, body, chat=True)

    async def _answer(self, request: web.Request, body: dict[str, Any], chat: bool) -> web.StreamResponse:
        if (asked := body.get("model", self.model)) != self.model and asked not in self.adapters:
            err = {"message": f"The model `{body['model']}` does not exist.", "type": "NotFoundError"}
            return web.json_response({"error": {**err, "param": "model", "code": 404}}, status=404)
        if self.abort_in_head:
            return await cut_head(request)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self.name}-{len(self.requests)}"
        kind = "chat.completion" if chat else "text_completion"
        pieces = [f"{self.name}:{i} " for i in range(self.chunks)]
        if not body.get("stream"):
            text = "".join(pieces)
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            usage = {"prompt_tokens": 1, "completion_tokens": self.chunks, "total_tokens": 1 + self.chunks}
            head = {"id": rid, "object": kind, "created": int(time.time()), "model": asked}
            body_out = json.dumps({**head, "choices": [choice], "usage": usage}).encode()
            if self.abort_body_after is not None:
                return await cut_answer(request, body_out, self.abort_body_after)
            self.responses.append(body_out)
            return web.Response(body=body_out, content_type="application/json")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        sent = bytearray()
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i, piece in enumerate(pieces):
            if i and self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
            elif not i and self.prefill_s:
                await asyncio.sleep(self.prefill_s)
            if i == self.abort_after_chunks and request.transport is not None:
                request.transport.abort()
                return out
            last = i == len(pieces) - 1
            delta: dict[str, Any] = {"content": piece} if chat else {}
            if chat and i == 0:
                delta["role"] = "assistant"
            c: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None, "logprobs": None}
            c.update({"delta": delta} if chat else {"text": piece})
            chunk = {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": asked,
                "choices": [c],
            }
            frame = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            if last:
                frame += b"data: [DONE]\n\n"
            sent += frame
            try:
                await out.write(frame)
            except ConnectionResetError:
                return out  # the router hung up (its client left): as vLLM, stop generating
        self.responses.append(bytes(sent))
        await out.write_eof()
        return out

    async def _models(self, request: web.Request) -> web.StreamResponse:
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "vllm", "root": self.model}
        if self.max_model_len is not None:
            model["max_model_len"] = self.max_model_len
        cards = [model] + [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "vllm",
                "root": path,
                "parent": self.model,
            }
            for name, path in self.adapters.items()
        ]
        if self.max_model_len is not None:
            for card in cards[1:]:
                card["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": cards})

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.metrics_requests += 1
        if not self.gauges:  # like vLLM started with --disable-log-stats
            return web.Response(text="# TYPE process_cpu_seconds_total counter\n", content_type="text/plain")
        labels = f'{{engine="0",model_name="{self.model}"}}'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{labels} {self.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{labels} {self.waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{labels} {self.kv_usage}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{labels} 123.0",
        ]
        return web.Response(text="\n".join(lines) + "\n" + self.extra_metrics, content_type="text/plain")

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.tokenize_delay_s:
            await asyncio.sleep(self.tokenize_delay_s)
        text = body.get("prompt") or json.dumps(body.get("messages"))
        tokens = [b for b in str(text).encode()]  # bytes as ids: enough to test the plumbing
        count = {"count": len(tokens), "max_model_len": self.max_model_len or 4096}
        return web.json_response({**count, "tokens": tokens})


def main() -> None:
    p = argparse.ArgumentParser(description="a fake vLLM OpenAI server (for router tests and benchmarks)")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--name", default="fake")
    p.add_argument("--model", default="tiny")
    p.add_argument("--chunks", type=int, default=3, help="SSE chunks per streamed answer")
    p.add_argument("--chunk-delay-s", type=float, default=0.0, help="between a stream's chunks")
    p.add_argument("--prefill-s", type=float, default=0.0, help="a stream's headers to its first chunk")
    p.add_argument("--delay-s", type=float, default=0.0, help="before answering at all")
    args = p.parse_args()
    fake = FakeVLLM(args.name, args.model, args.port)
    fake.chunks, fake.chunk_delay_s, fake.prefill_s = args.chunks, args.chunk_delay_s, args.prefill_s
    fake.delay_s = args.delay_s
    web.run_app(fake.app(), host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
