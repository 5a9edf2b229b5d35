"""The soak's load: streaming chats, each classified, and the timeline.

Every request ends in exactly one outcome:

- ``correct``: the stream ended with ``[DONE]`` and the text equals the fault-free reference
  for that prompt; ``wrong``: it ended and the text differs (must never happen);
- ``retryable``: the router answered 503, 429 or 408 with ``Retry-After``;
- ``router_down``: the router refused the connection, or closed it before any answer began
  (it is restarting: a rolling restart closes idle keep-alive connections, and a request
  already on its way over one gets no response at all); nothing was processed, so a load
  balancer or client retries these like a 503 — while the router restarts: the verdict
  counts one outside the restart window as an ``error`` (:mod:`kvmesh.bench.soak.verdict`);
- ``broken_stream``: a stream that had started ended with the router's in-stream error event
  (its replica died mid-answer; the headers were already sent, so this is how a stream says
  "retry", as vLLM and OpenAI do) — an ``error`` too outside a replica's death or the
  router's restart;
- ``interrupted``: a stream that had started was cut with no word (must never happen);
- ``error``: any other status or failure (must never happen);
- ``hang``: no end within the request's deadline (must never happen).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from kvmesh.bench.common.workload import words

Outcome = Literal[
    "correct", "wrong", "retryable", "router_down", "broken_stream", "interrupted", "error", "hang"
]
OUTCOMES: tuple[Outcome, ...] = (
    "correct",
    "wrong",
    "retryable",
    "router_down",
    "broken_stream",
    "interrupted",
    "error",
    "hang",
)


@dataclass(frozen=True)
class Prompt:
    key: str
    system: str
    question: str

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.question}]


def prompt_pool(tenants: int, questions: int, prefix_words: int, seed: int = 7) -> list[Prompt]:
    """Tenants with long shared system prompts, a few questions each: the cacheable shape."""
    rng = random.Random(seed)
    pool: list[Prompt] = []
    for t in range(tenants):
        system = f"tenant {t}. " + words(rng, prefix_words)
        pool.extend(Prompt(f"t{t}q{q}", system, words(rng, 20)) for q in range(questions))
    return pool


@dataclass
class Record:
    prompt: str
    start: float  # seconds since the soak began
    end: float
    outcome: Outcome
    prompt_tokens: int = 0
    cached_tokens: int = 0
    detail: str = ""


@dataclass
class Client:
    url: str
    model: str
    max_tokens: int
    deadline_s: float
    t0: float = field(default_factory=time.monotonic)

    async def one(self, http: httpx.AsyncClient, prompt: Prompt) -> tuple[Record, str]:
        start = time.monotonic() - self.t0
        try:
            record, text = await asyncio.wait_for(self._send(http, prompt, start), self.deadline_s)
        except TimeoutError:
            return Record(prompt.key, start, time.monotonic() - self.t0, "hang", detail="deadline"), ""
        return record, text

    async def _send(self, http: httpx.AsyncClient, prompt: Prompt, start: float) -> tuple[Record, str]:
        body = {
            "model": self.model,
            "messages": prompt.messages(),
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

        def done(outcome: Outcome, detail: str = "", usage: dict[str, Any] | None = None) -> Record:
            usage = usage or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            end = time.monotonic() - self.t0
            return Record(
                prompt.key, start, end, outcome, int(usage.get("prompt_tokens", 0)), int(cached), detail
            )

        text: list[str] = []
        usage: dict[str, Any] = {}
        finished = False
        broke = ""
        answered = False  # a status line came back: from here a failure is a broken answer
        try:
            async with http.stream("POST", self.url + "/v1/chat/completions", json=body) as resp:
                answered = True
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:200]
                    retry = resp.status_code in (408, 429, 503) and "retry-after" in resp.headers
                    return done("retryable" if retry else "error", f"HTTP {resp.status_code}: {detail}"), ""
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        finished = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if isinstance(chunk.get("error"), dict):
                            broke = str(chunk["error"].get("message", ""))[:200]
                        for choice in chunk.get("choices") or []:
                            text.append(choice.get("delta", {}).get("content") or "")
                        usage = chunk.get("usage") or usage
        except httpx.ConnectError as exc:
            return done("router_down", str(exc)), ""
        except (httpx.HTTPError, ValueError) as exc:
            kind: Outcome = "interrupted" if answered else "router_down"
            return done(kind, f"{type(exc).__name__}: {exc}"), ""
        if broke:
            return done("broken_stream", broke), ""
        if not finished:
            return done("interrupted", "stream ended without [DONE]"), ""
        return done("correct", usage=usage), "".join(text)


async def chat_load(
    client: Client,
    pool: Sequence[Prompt],
    reference: dict[str, str],
    concurrency: int,
    should_stop: Callable[[float], bool],
    on_record: Callable[[Record], None],
) -> None:
    """``concurrency`` users, each sending one chat after another until ``should_stop(t)``
    (``t``: seconds since ``client.t0``); a failed request waits a little, like a real client."""
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(client.deadline_s, connect=2.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:

        async def user(i: int) -> None:
            rng = random.Random(i)
            while not should_stop(time.monotonic() - client.t0):
                prompt = rng.choice(pool)
                record, text = await client.one(http, prompt)
                if record.outcome == "correct" and text != reference[prompt.key]:
                    record.outcome, record.detail = "wrong", f"got {text[:60]!r}"
                on_record(record)
                if record.outcome not in ("correct", "wrong"):
                    await asyncio.sleep(0.5)

        await asyncio.gather(*(user(i) for i in range(concurrency)))


async def references(client: Client, pool: Sequence[Prompt]) -> dict[str, str]:
    """Each prompt once, one at a time, before any fault: the text every later answer must equal."""
    out: dict[str, str] = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(client.deadline_s)) as http:
        for prompt in pool:
            record, text = await client.one(http, prompt)
            if record.outcome != "correct":
                raise ConnectionError(
                    f"reference run for {prompt.key} failed: {record.outcome} {record.detail}"
                )
            out[prompt.key] = text
    return out


@dataclass
class FaultEvent:
    name: str
    start: float
    end: float
    note: str = ""
    injected: bool = True  # False: it was skipped or failed to inject (the verdict fails)


# -- the verdict -------------------------------------------------------------------------------------
def hit_rate(records: Sequence[Record]) -> float | None:
    prompt = sum(r.prompt_tokens for r in records if r.outcome == "correct")
    return sum(r.cached_tokens for r in records if r.outcome == "correct") / prompt if prompt else None


def timeline(records: Sequence[Record], duration: float, bin_s: float) -> list[dict[str, Any]]:
    """Per bin (by end time): completed requests/s, failures and hit rate."""
    bins = []
    for b in range(int(duration // bin_s) + 1):
        lo, hi = b * bin_s, (b + 1) * bin_s
        inside = [r for r in records if lo <= r.end < hi]
        ok = [r for r in inside if r.outcome == "correct"]
        bins.append(
            {
                "t": lo,
                "completed_per_s": len(ok) / bin_s,
                "failed": len(inside) - len(ok),
                "hit_rate": hit_rate(ok),
            }
        )
    return bins


def summarize(records: Sequence[Record]) -> dict[str, Any]:
    counts: dict[str, int] = {o: sum(1 for r in records if r.outcome == o) for o in OUTCOMES}
    latencies = sorted(r.end - r.start for r in records if r.outcome == "correct")
    return {
        "requests": len(records),
        **counts,
        # Everything a client can retry: what must never happen is wrong, hang, interrupted, error.
        "retryable_total": counts["retryable"] + counts["router_down"] + counts["broken_stream"],
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "latency_max_s": latencies[-1] if latencies else None,
        "hit_rate": hit_rate(records),
        "examples": [asdict(r) for r in records if r.outcome not in ("correct", "router_down")][:20],
    }
