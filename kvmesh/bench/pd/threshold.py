"""What the PD hop costs, by prompt length: the measurement behind ``pd_threshold_tokens``.

On an idle producer/consumer pair, one request at a time, each prompt length is sent both
ways, alternating, with a new prompt every time: through ``kvmesh router --pd`` with the
threshold at 0 (always prefilled on the producer, then pulled by the consumer), and straight
to the consumer (which computes the prompt itself, the router's ``decode_only`` path). The
TTFT difference is the hop's cost at that length: an HTTP round trip and the producer's
one-token step, the handshake, the pull and the consumer's load, against a local prefill.
A prompt whose local prefill is cheaper than that is better computed where it is decoded:
the stall it puts on the decode replica's other requests is shorter than the hop.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kvmesh.bench.pd.workload import PDRequest, make_workload, replay

LENGTHS = (128, 256, 512, 1024, 2048)


def probe(
    router_url: str, consumer_url: str, model_dir: str, model: str, repeats: int = 3,
    lengths: Sequence[int] = LENGTHS,
) -> dict[str, Any]:  # fmt: skip
    """Median TTFT per length through the always-PD router and on the consumer alone, the
    hop's cost (their difference) and ``local_faster_up_to``: the longest length at which
    the local prefill's TTFT was still below the PD path's."""
    rows = []
    for n in lengths:
        reqs = make_workload(model_dir, 2 * repeats, 9000 + n, 1.0, (n, n), (2, 2))
        pd_t: list[float] = []
        local_t: list[float] = []
        for i in range(repeats):
            for url, out, req in ((router_url, pd_t, reqs[2 * i]), (consumer_url, local_t, reqs[2 * i + 1])):
                row = replay(url, model, [PDRequest(req.prompt, req.prompt_tokens, 2, 0.0)])
                if row.get("ttft_p50_s") is not None:
                    out.append(float(row["ttft_p50_s"]))
        if pd_t and local_t:
            pd_m, local_m = statistics.median(pd_t), statistics.median(local_t)
            rows.append({"tokens": n, "ttft_pd_s": round(pd_m, 4), "ttft_local_s": round(local_m, 4),
                         "hop_cost_s": round(pd_m - local_m, 4)})  # fmt: skip
    faster = [r["tokens"] for r in rows if r["ttft_local_s"] < r["ttft_pd_s"]]
    return {"repeats": repeats, "lengths": rows, "local_faster_up_to": max(faster) if faster else None}
