"""The workload and client of ``kvmesh bench pd``: long prompts, long streamed outputs.

Each request is a text completion of a unique prompt of ``prompt_tokens`` tokens (counted
with the model's own tokenizer) asking for exactly ``max_tokens`` tokens (``min_tokens`` and
``ignore_eos``: random-weight models stop at random places otherwise), arriving on a Poisson
schedule. The client streams each answer and keeps the arrival time of every token event:
TTFT is the first event after the request was sent, the inter-token latencies are the gaps
between consecutive events, pooled over a trial's requests (a decode stalled by someone
else's prefill shows as one long gap, which is what PD is meant to remove).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvmesh.bench.runner import percentile
from kvmesh.errors import ConfigError
from kvmesh.router.testing import WORDS  # the words the tiny models' tokenizer was trained on


@dataclass(frozen=True)
class PDRequest:
    prompt: str
    prompt_tokens: int
    max_tokens: int
    at_s: float  # arrival, seconds after the trial's start


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text).ids)


def make_workload(
    model_dir: str | Path,
    n: int,
    seed: int,
    rate_per_s: float,
    prompt_tokens: tuple[int, int] = (1500, 2500),
    output_tokens: tuple[int, int] = (128, 256),
) -> list[PDRequest]:
    """``n`` requests with unique prompts (their first words carry ``seed`` and their index,
    so no two share a cached block), lengths uniform in the ranges (within a token or two:
    the count recorded is the tokenizer's), Poisson arrivals."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a missing or bad file
        raise ConfigError(f"{path}: the workload's prompts are tokenized with it ({exc})") from None
    rng = random.Random(seed)
    out: list[PDRequest] = []
    at = 0.0
    for i in range(n):
        target = rng.randint(*prompt_tokens)
        head = f"request {seed} {i}:"
        # At least a token per word: enough words, encoded once, cut at the target token's end.
        text = head + " " + " ".join(rng.choice(WORDS) for _ in range(target))
        enc = tok.encode(text)
        if len(enc.ids) > target:
            text = text[: enc.offsets[target - 1][1]]
        got = _count(tok, text)
        out.append(PDRequest(text, got, rng.randint(*output_tokens), at))
        at += rng.expovariate(rate_per_s)
    return out


@dataclass
class Outcome:
    ok: bool
    sent: float
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    end: float = 0.0
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, model: str, req: PDRequest, t0: float) -> Outcome:
    delay = t0 + req.at_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "min_tokens": req.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    sent = time.perf_counter()
    times: list[float] = []
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                return Outcome(False, sent, end=time.perf_counter(), error=f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Outcome(False, sent, end=time.perf_counter(), error=str(event["error"])[:300])
                if event.get("choices"):  # one event per generated token (usage events have none)
                    times.append(time.perf_counter())
    except (httpx.HTTPError, OSError, ValueError) as exc:
        return Outcome(False, sent, end=time.perf_counter(), error=repr(exc)[:300])
    if not times:
        return Outcome(False, sent, end=time.perf_counter(), error="no token came back")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return Outcome(True, sent, times[0] - sent, gaps, len(times), times[-1])


async def _replay(url: str, model: str, reqs: Sequence[PDRequest], timeout_s: float) -> list[Outcome]:
    limits = httpx.Limits(max_connections=len(reqs) + 4, max_keepalive_connections=len(reqs) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(_one(client, url, model, r, t0) for r in reqs)))


def replay(url: str, model: str, reqs: Sequence[PDRequest], timeout_s: float = 300.0) -> dict[str, Any]:
    """Send ``reqs`` on their schedule to ``url``; the trial's summary (see :func:`summarize`)."""
    load_before = os.getloadavg()[0]
    outcomes = asyncio.run(_replay(url, model, reqs, timeout_s))
    row = summarize(outcomes)
    row["load_avg_before"] = round(load_before, 2)
    row["load_avg_after"] = round(os.getloadavg()[0], 2)
    return row


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """TTFT and ITL p50/p90/p99 (seconds), requests/s (finished requests over the span from
    the first send to the last token), output tokens/s, the failures and the first error."""
    ok = [o for o in outcomes if o.ok]
    errors = [o.error for o in outcomes if not o.ok]
    row: dict[str, Any] = {"requests": len(outcomes), "ok": len(ok), "errors": len(errors)}
    if errors:
        row["first_error"] = errors[0]
    if not ok:
        return row
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    gaps = [g for o in ok for g in o.gaps_s]
    for q in (50, 90, 99):
        row[f"ttft_p{q}_s"] = round(percentile(ttfts, q), 4)
        if gaps:
            row[f"itl_p{q}_s"] = round(percentile(gaps, q), 5)
    span = max(o.end for o in ok) - min(o.sent for o in outcomes)
    row["requests_per_s"] = round(len(ok) / span, 4) if span > 0 else None
    row["output_tokens_per_s"] = round(sum(o.tokens for o in ok) / span, 2) if span > 0 else None
    return row
