"""A multi-tenant chat workload and an OpenAI-API replayer that measures it.

Many tenants, each with a long shared system prompt (a document); a few users per tenant
in multi-turn conversations (each turn resends the whole conversation, so its prefix
grows); several requests in flight. Requests stream, so TTFT is the time to the first
streamed token, and the final usage chunk gives ``prompt_tokens_details.cached_tokens``
(vLLM's own prefix-cache hit plus what a KV connector loaded): the prefix hit rate is
cached tokens over prompt tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from kvmesh.bench.runner import percentile
from kvmesh.errors import ProcessError

_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ren",
    "tas",
    "vo",
    "qui",
    "ber",
    "nal",
    "sor",
    "te",
    "um",
    "dra",
    "pel",
    "xi",
]


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n))


@dataclass
class Conversation:
    tenant: int
    user: int
    system: str
    questions: list[str]

    @property
    def session_id(self) -> str:
        return f"t{self.tenant}-u{self.user}"


@dataclass
class Workload:
    conversations: list[Conversation]
    max_tokens: int = 8

    @classmethod
    def multi_tenant(
        cls,
        tenants: int = 12,
        users: int = 2,
        turns: int = 3,
        prefix_words: int = 600,
        question_words: int = 40,
        max_tokens: int = 8,
        seed: int = 0,
        prefix_words_max: int = 0,
        text: Callable[[random.Random, int], str] | None = None,
    ) -> Workload:
        """``tenants`` x ``users`` conversations of ``turns`` turns. Every tenant's system
        prompt has ``prefix_words`` words, or a number drawn from ``prefix_words`` ..
        ``prefix_words_max`` when that is larger; ``text`` makes the words (default:
        :func:`words`, a 15-syllable vocabulary)."""
        rng = random.Random(seed)
        make = text or words
        convs = []
        for t in range(tenants):
            n = (
                rng.randint(prefix_words, prefix_words_max)
                if prefix_words_max > prefix_words
                else prefix_words
            )
            system = f"Tenant {t} handbook. " + make(rng, n)
            for u in range(users):
                qs = [f"User {u} asks: " + make(rng, question_words) for _ in range(turns)]
                convs.append(Conversation(t, u, system, qs))
        # Interleave tenants so consecutive arrivals do not share a prefix by construction.
        convs.sort(key=lambda c: (c.user, c.tenant))
        return cls(convs, max_tokens)

    @property
    def num_requests(self) -> int:
        return sum(len(c.questions) for c in self.conversations)


@dataclass
class Sample:
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    ok: bool
    error: str = ""
    session: str = ""  # which conversation and turn, for per-request analysis
    turn: int = 0


@dataclass
class RunResult:
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        ok = [s for s in self.samples if s.ok]
        ttfts = sorted(s.ttft_s for s in ok)
        prompt = sum(s.prompt_tokens for s in ok)
        return {
            "requests": len(self.samples),
            "errors": len(self.samples) - len(ok),
            "hit_rate": round(sum(s.cached_tokens for s in ok) / prompt, 4) if prompt else 0.0,
            "ttft_p50_s": round(statistics.median(ttfts), 4) if ttfts else None,
            "ttft_p90_s": round(percentile(ttfts, 90), 4) if ttfts else None,
            "requests_per_s": round(len(ok) / self.wall_s, 3) if self.wall_s else 0.0,
            "prompt_tokens_mean": round(prompt / len(ok), 1) if ok else None,
        }


METRICS = ("hit_rate", "ttft_p50_s", "ttft_p90_s", "requests_per_s")


def median_summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The median of each of :data:`METRICS` over repeated runs' ``RunResult.summary()``s
    (runs where no request succeeded are left out; ``{}`` when none is left)."""
    good = [r for r in runs if r.get("ttft_p50_s") is not None]
    if not good:
        return {}
    row: dict[str, Any] = {}
    for key in METRICS:
        values = [float(r[key]) for r in good if r.get(key) is not None]
        row[key] = round(statistics.median(values), 4) if values else None
    return row


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    messages: list[dict[str, str]],
    session: str,
    max_tokens: int,
) -> tuple[Sample, str]:
    """One streamed chat completion: its :class:`Sample` (TTFT, latency, prompt and cached
    tokens) and the answer's text; a failed request is a Sample with ``ok`` False."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, headers={"x-session-id": session}
        ) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:200]
                return Sample(
                    0, time.perf_counter() - t0, 0, 0, False, f"HTTP {resp.status_code}: {detail}"
                ), ""
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        text.append(delta)
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as exc:
        return Sample(0, time.perf_counter() - t0, 0, 0, False, f"{type(exc).__name__}: {exc}"), ""
    latency = time.perf_counter() - t0
    details = usage.get("prompt_tokens_details") or {}
    sample = Sample(
        ttft if ttft is not None else latency,
        latency,
        int(usage.get("prompt_tokens", 0)),
        int(details.get("cached_tokens") or 0),
        True,
    )
    return sample, "".join(text)


Arrival = Literal["sessions", "turns"]


async def _replay(
    workload: Workload,
    url: str,
    model: str,
    concurrency: int,
    on_done: Callable[[], None] | None,
    arrival: Arrival,
) -> RunResult:
    result = RunResult()
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:

        async def turns(conv: Conversation, per_turn: bool) -> None:
            messages = [{"role": "system", "content": conv.system}]
            for turn, q in enumerate(conv.questions):
                messages.append({"role": "user", "content": q})
                async with sem if per_turn else contextlib.nullcontext():
                    sample, answer = await stream_chat(
                        client, url, model, messages, conv.session_id, workload.max_tokens
                    )
                sample.session, sample.turn = conv.session_id, turn
                result.samples.append(sample)
                if on_done:
                    on_done()
                messages.append({"role": "assistant", "content": answer or "ok"})

        async def session(conv: Conversation) -> None:
            async with sem:
                await turns(conv, per_turn=False)

        await warm_up(client, url, concurrency)
        t0 = time.perf_counter()
        if arrival == "sessions":
            await asyncio.gather(*(session(c) for c in workload.conversations))
        else:
            await asyncio.gather(*(turns(c, per_turn=True) for c in workload.conversations))
        result.wall_s = time.perf_counter() - t0
    return result


async def warm_up(client: httpx.AsyncClient, url: str, n: int) -> None:
    """Open the client's connections before the clock starts: httpx's first request on a
    new client carries its own set-up (tens of ms, more on a busy machine), which would
    otherwise land on the first requests' TTFT for every setup alike. ``GET /v1/models``
    touches no engine; whatever it answers, the connection is open."""
    with contextlib.suppress(httpx.HTTPError):
        await asyncio.gather(*(client.get(url + "/v1/models") for _ in range(n)))


def replay(
    workload: Workload,
    url: str,
    model: str,
    concurrency: int = 4,
    on_done: Callable[[], None] | None = None,
    arrival: Arrival = "sessions",
) -> RunResult:
    """Run ``workload`` against an OpenAI-compatible server at ``url``, ``concurrency``
    requests in flight.

    ``arrival="sessions"``: ``concurrency`` conversations are active at a time, each sending
    its turns back to back (a user reads the answer, asks the next question), and the next
    conversation starts when one ends — so new tenants keep arriving among follow-ups, as in
    production. ``"turns"``: every conversation starts at once and a semaphore admits
    requests, so all first turns come before any second turn.
    """
    return asyncio.run(_replay(workload, url, model, concurrency, on_done, arrival))


async def _idle_ttfts(workload: Workload, url: str, model: str, settle_s: float) -> list[float]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        await warm_up(client, url, 1)
        out = []
        for i, conv in enumerate(workload.conversations):
            if i:
                await asyncio.sleep(settle_s)  # the last one's background saves and writes
            messages = [
                {"role": "system", "content": conv.system},
                {"role": "user", "content": conv.questions[0]},
            ]
            sample, _ = await stream_chat(client, url, model, messages, conv.session_id, workload.max_tokens)
            if not sample.ok:
                raise ProcessError(f"a lone first turn failed: {sample.error}")
            out.append(sample.ttft_s)
    return out


def idle_ttfts(workload: Workload, url: str, model: str, settle_s: float = 0.5) -> list[float]:
    """TTFTs of the first turns of ``workload``'s conversations, sent one at a time,
    ``settle_s`` apart (what a cache does in the background after a response, such as
    writing it to a shared tier, is over by the next): with one conversation per tenant,
    each is a full miss on a server doing nothing else (the floor of a replay's TTFT; see
    :func:`kvmesh.bench.common.groups.measure_idle_miss`). Give it a workload of its own (its own
    seed), so no cache already holds its prompts."""
    return asyncio.run(_idle_ttfts(workload, url, model, settle_s))
