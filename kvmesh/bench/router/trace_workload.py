"""The shared conversation trace (Mooncake's FAST'25 release, ``shared/traces``) as a
held-out router workload, replayed open-loop at a rate the replicas can take.

The trace holds no text: each request is a list of prefix-chained block ids, one per 512
tokens. :func:`load_conversations` picks the first ``conversations`` conversations with at
least two requests (a conversation: the requests sharing ``hash_ids[1]``; ``hash_ids[0]``
is one system prompt shared by all), keeps their requests in trace order, and
:func:`expand` turns every block id into ``words_per_block`` words of realistic text
(:mod:`kvmesh.bench.common.corpus`) seeded by the id and the run's seed, so equal ids give equal
text within a run and no run shares text with another (the kvmesh replicas' shared tier
outlives a run). The tiny test model cannot take 20k-token prompts, so a 512-token block
becomes ~64 tokens and prompts are cut at ``max_blocks`` blocks; the prefix structure is
kept exactly. Requests are sent at the trace's own relative arrival times, compressed to a
mean of ``rate`` requests per second (open loop: a slow setup gets a queue, as in
production).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvmesh.bench.common.corpus import zipf_words
from kvmesh.bench.common.workload import RunResult, stream_chat, warm_up
from kvmesh.errors import ConfigError
from kvmesh.paths import traces_dir

TRACE_FILE = "conversation_trace.jsonl"


@dataclass(frozen=True)
class TraceRequest:
    at_s: float  # arrival, seconds from the start of the replay
    hash_ids: tuple[int, ...]
    session: str


def load_conversations(
    conversations: int = 16, max_blocks: int = 20, path: str | None = None, scan: int = 4000
) -> list[tuple[int, tuple[int, ...], str]]:
    """``(timestamp_ms, hash_ids[:max_blocks], session)`` of the first ``conversations``
    multi-request conversations among the trace's first ``scan`` requests, in trace order."""
    file = Path(path or Path(traces_dir()) / TRACE_FILE)
    if not file.is_file():
        raise ConfigError(
            f"trace file {file} not found: set KVMESH_TRACES to the folder holding {TRACE_FILE}"
        )
    rows = []
    with file.open() as fh:
        for i, line in enumerate(fh):
            if i >= scan:
                break
            r = json.loads(line)
            ids = tuple(int(x) for x in r["hash_ids"])
            if len(ids) > 1:
                rows.append((int(r["timestamp"]), ids))
    counts: dict[int, int] = {}
    for _, ids in rows:
        counts[ids[1]] = counts.get(ids[1], 0) + 1
    chosen: list[int] = []
    for _, ids in rows:
        if counts[ids[1]] >= 2 and ids[1] not in chosen and len(chosen) < conversations:
            chosen.append(ids[1])
    keep = set(chosen)
    return [(ts, ids[:max_blocks], f"trace-{ids[1]}") for ts, ids in rows if ids[1] in keep]


def schedule(rows: Sequence[tuple[int, tuple[int, ...], str]], rate: float) -> list[TraceRequest]:
    """The rows' relative arrival times scaled to a mean of ``rate`` requests per second
    (gaps keep their proportions; the first request is at 0)."""
    if rate <= 0:
        raise ConfigError(f"trace replay rate must be > 0 requests/s, got {rate}")
    if not rows:
        return []
    t0 = rows[0][0]
    span_ms = rows[-1][0] - t0
    target_s = (len(rows) - 1) / rate
    scale = target_s / (span_ms / 1000) if span_ms > 0 else 0.0
    return [TraceRequest((ts - t0) / 1000 * scale if scale else i / rate, ids, s)
            for i, (ts, ids, s) in enumerate(rows)]  # fmt: skip


def expand(hash_ids: Sequence[int], seed: int, words_per_block: int = 28) -> str:
    """Deterministic text for a chain of block ids (see the module docstring)."""
    return " ".join(zipf_words(random.Random(seed * 1_000_003 + h), words_per_block) for h in hash_ids)


async def _replay_timed(
    requests: Sequence[TraceRequest],
    url: str,
    model: str,
    seed: int,
    max_tokens: int,
    on_done: Callable[[], None] | None,
) -> RunResult:
    result = RunResult()
    texts = {r.hash_ids: expand(r.hash_ids, seed) for r in requests}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        await warm_up(client, url, 4)

        async def send(req: TraceRequest, t0: float) -> None:
            delay = t0 + req.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            messages = [{"role": "user", "content": texts[req.hash_ids]}]
            sample, _ = await stream_chat(client, url, model, messages, req.session, max_tokens)
            sample.session = req.session
            result.samples.append(sample)
            if on_done:
                on_done()

        t0 = time.perf_counter()
        await asyncio.gather(*(send(r, t0) for r in requests))
        result.wall_s = time.perf_counter() - t0
    return result


def replay_timed(
    requests: Sequence[TraceRequest],
    url: str,
    model: str,
    seed: int,
    max_tokens: int = 8,
    on_done: Callable[[], None] | None = None,
) -> RunResult:
    """Send each request at its ``at_s`` (open loop), its text from :func:`expand` with
    ``seed``; streaming, as :func:`kvmesh.bench.common.workload.replay`."""
    return asyncio.run(_replay_timed(requests, url, model, seed, max_tokens, on_done))
