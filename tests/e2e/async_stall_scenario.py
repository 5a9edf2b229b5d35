"""A hung Redis costs the loading request its budget and nobody else anything (issue #25).

One vLLM instance (tiny model, ``remote_url`` on a real redis-server, ``remote_timeout_s``
``BUDGET``), driven step by step through ``llm_engine.step()`` so every output token gets a
timestamp. Four decodes run; once each has a few tokens, a fifth request arrives whose
prompt's chunks sit in Redis (its cpu copy and vLLM's prefix cache dropped):

1. ``cold``: the fifth prompt is new (nothing cached anywhere): the batch's inter-token
   latency with a plain prefill joining it;
2. ``stopped``: the fifth prompt is cached in Redis, and Redis is SIGSTOPped before it
   arrives: its lookup cannot answer within a step;
3. ``black_hole``: Redis replaced by a listener that accepts and never answers.

Reported per phase: the four decodes' inter-token gaps (max, p99), the fifth's TTFT and
its output compared with a cold run. Before loads and lookups went asynchronous, the
lookup held vLLM's scheduler for the whole budget: every decode's next token waited
``BUDGET`` seconds. Run by ``test_async_stall.py`` as a script; prints one JSON line.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e.remote_stall_scenario import BlackHole, _redis_server, drop_local
from tests.e2e.vllm_scenarios import Instance, compare, prompt, run_main

BUDGET = 1.5
DECODE_TOKENS = 160


def run_batch(inst: Instance, fifth: list[int], tag: str) -> dict[str, Any]:
    """Four decodes, then ``fifth`` once each decode has 4 tokens; timestamps per token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = inst.llm.llm_engine
    decode_sp = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    fifth_sp = SamplingParams(max_tokens=5, logprobs=5, temperature=0.0)
    stamps: dict[str, list[float]] = {}
    for i in range(4):
        rid = f"{tag}-d{i}"
        ids = prompt(500 + i + sum(map(ord, tag)), 120)
        eng.add_request(rid, TokensPrompt(prompt_token_ids=ids), decode_sp)
        stamps[rid] = []
    fifth_id, fifth_at, fifth_out = f"{tag}-fifth", None, None
    counts: dict[str, int] = {}
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n > counts.get(o.request_id, 0):
                stamps.setdefault(o.request_id, []).append(now)
                counts[o.request_id] = n
            if o.request_id == fifth_id and o.finished:
                fifth_out = o
        if fifth_at is None and all(counts.get(f"{tag}-d{i}", 0) >= 4 for i in range(4)):
            fifth_at = time.perf_counter()
            eng.add_request(fifth_id, TokensPrompt(prompt_token_ids=fifth), fifth_sp)
    assert fifth_at is not None and fifth_out is not None
    gaps = sorted(
        b - a
        for i in range(4)
        for a, b in zip(stamps[f"{tag}-d{i}"], stamps[f"{tag}-d{i}"][1:], strict=False)
        if b > fifth_at  # the gaps after the fifth request arrived
    )
    return {
        "itl_max_ms": round(1000 * gaps[-1], 1),
        "itl_p99_ms": round(1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 1),
        "gaps": len(gaps),
        "fifth_ttft_ms": round(1000 * (stamps[fifth_id][0] - fifth_at), 1),
        "fifth_cached_tokens": fifth_out.num_cached_tokens,
        "_fifth": fifth_out,
    }


def scenario(model: str, work: Path) -> dict[str, Any]:
    p = prompt(4242, 1025)
    res: dict[str, Any] = {"budget_s": BUDGET}
    redis = _redis_server().start()
    hole: BlackHole | None = None
    try:
        extra = {
            "chunk_size": 256,
            "max_local_cpu_size": 0.25,
            "socket_dir": str(work / "sock"),
            "remote_url": redis.url,
            "remote_timeout_s": BUDGET,
        }
        inst = Instance(model, "e2e-async-stall", extra, policy="recompute", events=None)
        inst.run(prompt(1, 201))  # warm-up: the first request carries seconds of lazy init
        cold_ref, _ = inst.run(p)  # the fifth prompt, computed; its chunks go to Redis
        res["writes_landed"] = inst.call("wait_for_writes", timeout=60)

        def phase(name: str, fifth: list[int]) -> None:
            got = run_batch(inst, fifth, name)
            out = got.pop("_fifth")
            if fifth == p:
                got["vs_cold"] = compare(cold_ref, out)
            res[name] = got

        phase("cold", prompt(77, 1025))  # a new prompt: plain prefill in the batch
        drop_local(inst)
        phase("loaded", p)  # Redis healthy: loads beside the batch
        drop_local(inst)
        os.kill(redis.proc.pid, signal.SIGSTOP)
        try:
            phase("stopped", p)
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
        drop_local(inst)
        port = redis.port
        redis.stop()
        hole = BlackHole(port)
        time.sleep(3.0)  # the breaker's probe finds the listener (open, never answering)
        phase("black_hole", p)
        res["stats"] = inst.call("stats")["connector"]
        inst.close()
    finally:
        if hole is not None:
            hole.close()
        redis.stop()
    return res


def main(argv: list[str]) -> int:
    return run_main(argv, {"async_stall_scenario": scenario})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
