"""Requests for the fleet simulator: the shared traces, a generator, the ``bench router`` workload.

A request is known by its prompt's full blocks, named by *prefix-chained* ids (equal ids at
the same position mean a reusable prefix, as in the Mooncake traces), its length in tokens
and its output length. Open-loop requests carry an arrival time; closed-loop ones belong to
sessions whose next turn is sent when the previous one finishes (``bench router``'s shape).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

TRACE_BLOCK_TOKENS = 512  # the Mooncake traces' hash_ids are one per 512 prompt tokens


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival_s: float
    blocks: tuple[int, ...]  # ids of the prompt's full blocks, prefix-chained
    tokens: int  # prompt tokens (the last, partial block is never cached)
    output: int  # generated tokens
    session: str | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    block_tokens: int
    requests: tuple[SimRequest, ...] = ()  # open loop, by arrival time
    sessions: tuple[tuple[SimRequest, ...], ...] = ()  # closed loop: turns of each session
    concurrency: int = 0  # closed loop: sessions active at a time

    @property
    def num_requests(self) -> int:
        return len(self.requests) + sum(len(s) for s in self.sessions)


def load_trace(path: str | Path, limit: int | None = None, time_scale: float = 1.0) -> Workload:
    """A Mooncake trace (JSONL: timestamp ms, input_length, output_length, hash_ids).

    ``time_scale`` < 1 compresses arrivals (more load on the same fleet).
    """
    reqs: list[SimRequest] = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(reqs) >= limit:
                break
            d = json.loads(line)
            n = int(d["input_length"])
            full = n // TRACE_BLOCK_TOKENS
            ids = tuple(int(h) for h in d["hash_ids"][:full])
            reqs.append(
                SimRequest(float(d["timestamp"]) / 1000 * time_scale, ids, n, int(d["output_length"]))
            )
    reqs.sort(key=lambda r: r.arrival_s)
    return Workload(Path(path).stem, TRACE_BLOCK_TOKENS, requests=tuple(reqs))


def _chain(parent: int, salt: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{parent}|{salt}".encode())


def generate(
    tenants: int = 50,
    users_per_tenant: int = 20,
    turns: int = 4,
    system_tokens: int = 4096,
    turn_tokens: int = 256,
    output_tokens: int = 128,
    rate_per_s: float = 20.0,
    block_tokens: int = 512,
    seed: int = 0,
) -> Workload:
    """Many tenants sharing long system prompts, each user in a multi-turn chat (open loop).

    Users start as a Poisson process at ``rate_per_s`` / ``turns``; a user's next turn comes
    an exponential think time (mean 10 s) after the previous one. Each turn resends the whole
    conversation, so its prefix grows (llm-d's "many tenants sharing long prefixes" shape).
    """
    rng = random.Random(seed)
    reqs: list[SimRequest] = []
    t = 0.0
    sys_blocks = system_tokens // block_tokens
    for u in range(tenants * users_per_tenant):
        tenant = rng.randrange(tenants)
        t += rng.expovariate(rate_per_s / turns)
        ids = [0]
        for b in range(sys_blocks):
            ids.append(_chain(ids[-1], f"sys{tenant}.{b}"))
        tokens = system_tokens
        at = t
        for _ in range(turns):
            tokens += turn_tokens
            full = tokens // block_tokens
            while len(ids) - 1 < full:
                ids.append(_chain(ids[-1], f"u{u}.{len(ids)}"))
            reqs.append(SimRequest(at, tuple(ids[1 : full + 1]), tokens, output_tokens, f"u{u}"))
            tokens += output_tokens
            at += rng.expovariate(0.1)
    reqs.sort(key=lambda r: r.arrival_s)
    return Workload(f"generated-{tenants}t", block_tokens, requests=tuple(reqs))


def blocks_of(tokens: Sequence[int], block_tokens: int) -> tuple[int, ...]:
    """Prefix-chained ids of a token sequence's full blocks."""
    ids: list[int] = []
    prev = 0
    for i in range(len(tokens) // block_tokens):
        data = b"".join(
            int(t).to_bytes(4, "little") for t in tokens[i * block_tokens : (i + 1) * block_tokens]
        )
        prev = xxhash.xxh3_64_intdigest(prev.to_bytes(8, "little") + data)
        ids.append(prev)
    return tuple(ids)


def bench_router(model_dir: str, quick: bool = False, block_tokens: int = 128) -> Workload:
    """``kvmesh bench router``'s workload, tokenized as the router tokenizes it (closed loop).

    Same tenants, texts, turns and concurrency; the replicas' answers (8 tokens of random
    text) are stood in for by a fixed 8-word answer, so follow-ups keep their shape.
    """
    from kvmesh.bench.common.workload import Workload as ChatWorkload
    from kvmesh.bench.router.bench import params
    from kvmesh.routing.tokenize import PromptTokenizer

    p = params(quick)
    chats = ChatWorkload.multi_tenant(p.tenants, p.users, p.turns, prefix_words=p.prefix_words, seed=0)
    tok = PromptTokenizer.from_dir(model_dir)
    sessions: list[tuple[SimRequest, ...]] = []
    for conv in chats.conversations:
        messages = [{"role": "system", "content": conv.system}]
        turns: list[SimRequest] = []
        for q in conv.questions:
            messages.append({"role": "user", "content": q})
            ids = tok.chat({"messages": messages}).tolist()
            turns.append(
                SimRequest(0.0, blocks_of(ids, block_tokens), len(ids), chats.max_tokens, conv.session_id)
            )
            messages.append({"role": "assistant", "content": "ka lo mi ren tas vo qui ber"})
        sessions.append(tuple(turns))
    return Workload("bench-router", block_tokens, sessions=tuple(sessions), concurrency=p.concurrency)


def tile(work: Workload, copies: int, time_scale: float = 1.0) -> Workload:
    """``copies`` of an open-loop trace played at once (each with its own block ids: more
    users with the same sharing structure), arrivals stretched by ``time_scale``."""
    out: list[SimRequest] = []
    for k in range(max(1, copies)):
        off = k << 44
        out += [
            SimRequest(
                r.arrival_s * time_scale, tuple(b + off for b in r.blocks), r.tokens, r.output, r.session
            )
            for r in work.requests
        ]
    out.sort(key=lambda r: r.arrival_s)
    return Workload(
        f"{work.name}x{copies}" if copies > 1 else work.name, work.block_tokens, requests=tuple(out)
    )


def time_scale_for(work: Workload, replicas: float, load: float, seconds_per_token: float) -> float:
    """The arrival stretch at which recomputing every prompt would keep ``replicas`` busy
    ``load`` of the time (the offered load before any cache hit)."""
    reqs = work.requests
    if len(reqs) < 2:
        return 1.0
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    work_s = sum(r.tokens for r in reqs) * seconds_per_token
    return work_s / (load * replicas * span)
