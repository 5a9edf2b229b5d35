"""What no policy on any fleet can beat on a workload: the ceiling of the hit ratio and the
floor of each TTFT percentile, computed from the workload and the cost profile alone.

**Hit ratio.** However requests are placed, ordered or cached, every distinct block is
computed at least once before anyone can reuse it (a compulsory miss), and a request never
reuses a block of its own prefill. So at most ``sum(len(blocks)) - distinct blocks`` block
hits happen, and the hit ratio is at most that many tokens over all prompt tokens. The
bound is reached: an infinite cache shared by every replica with prefills that take no time
(each request then reuses every block an earlier one had).

**TTFT.** A request's first token takes at least the cost model's prefill of what it cannot
reuse: ``overhead_s + (tokens - reusable * block_tokens) / prefill_tps``, where ``reusable``
is the longest prefix of its blocks that some *other* request also has (the most any
schedule could have computed for it), loaded at no cost, with no queue, no decode running
beside it and no jitter. Each request's time is at least its floor, so every percentile of
the times is at least the same percentile of the floors. With a profile whose ``jitter`` is
not 0 the floor is of the service time before its noise (a lognormal factor can be below 1,
so no floor holds for every draw): ``strict`` says which.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from kvmesh.sim.cost import CostProfile
from kvmesh.sim.workload import SimRequest, Workload


def _requests(work: Workload) -> list[SimRequest]:
    return list(work.requests) + [r for session in work.sessions for r in session]


def unique_blocks(work: Workload) -> int:
    """Distinct blocks of a workload's prompts: its working set."""
    return len({b for r in _requests(work) for b in r.blocks})


def bound(work: Workload, cost: CostProfile) -> dict[str, Any]:
    """The ceiling of the hit ratio and the floors of TTFT p50/p90/p99 on ``work`` (see the
    module docstring), with the counts they come from."""
    reqs = _requests(work)
    bt = work.block_tokens
    holders: Counter[int] = Counter()
    for r in reqs:
        holders.update(set(r.blocks))
    occurrences = sum(len(r.blocks) for r in reqs)
    tokens = sum(r.tokens for r in reqs)
    floors = []
    for r in reqs:
        reusable = 0
        for b in r.blocks:
            if holders[b] < 2:
                break
            reusable += 1
        computed = max(0, r.tokens - reusable * bt)
        floors.append(cost.overhead_s + computed / cost.prefill_tps)
    ttft = np.array(floors) if floors else np.zeros(1)
    return {
        "requests": len(reqs),
        "prompt_tokens": tokens,
        "block_occurrences": occurrences,
        "unique_blocks": len(holders),
        "hit_ratio_max": round((occurrences - len(holders)) * bt / tokens, 4) if tokens else 0.0,
        "ttft_p50_s_min": round(float(np.percentile(ttft, 50)), 4),
        "ttft_p90_s_min": round(float(np.percentile(ttft, 90)), 4),
        "ttft_p99_s_min": round(float(np.percentile(ttft, 99)), 4),
        "strict": cost.jitter == 0,
    }


def violations(results: list[dict[str, Any]], b: dict[str, Any]) -> list[str]:
    """The results that beat the bound ``b`` (none can: a non-empty list is a bug in the
    simulator or the bound). Hit ratios and TTFTs are rounded to 4 digits, hence the slack."""
    out = []
    for r in results:
        who = f"{r['policy']} on {r.get('fleet', '?')}"
        if r["hit_ratio"] > b["hit_ratio_max"] + 1e-4:
            out.append(f"{who}: hit {r['hit_ratio']} > {b['hit_ratio_max']}")
        if b["strict"]:
            for q in ("p50", "p90", "p99"):
                if r[f"ttft_{q}_s"] < b[f"ttft_{q}_s_min"] - 1e-4:
                    out.append(f"{who}: TTFT {q} {r[f'ttft_{q}_s']} < {b[f'ttft_{q}_s_min']}")
    return out
