"""What ``kvmesh bench ttft`` runs, as data: the setups, their fairness settings, the
prompts, the per-setup worker spec and the scoring of the results (all pure, unit-tested;
the orchestration is :mod:`kvmesh.bench.ttft`, the vLLM process :mod:`kvmesh.bench.ttft_worker`).
"""

from __future__ import annotations

import os
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.bench.stats import percentile
from kvmesh.harness.connector import KVMESH_CONNECTOR, KVMESH_MODULE, TRANSFER_ARGS, extra_config

SETUPS = ("recompute", "example_connector", "lmcache_mp", "kvmesh_cpu", "kvmesh_disk", "kvmesh_redis")
KVMESH_SETUPS = ("kvmesh_cpu", "kvmesh_disk", "kvmesh_redis")
DEFAULT_LENGTHS = (500, 1000, 2000)
TARGET_TOKENS = 2000
LOGPROB_TOL = 1e-4
MAX_MODEL_LEN = 4096
# LMCache runs with 256-token chunks too (kvmesh.harness.connector.CHUNK_SIZE). Note a
# 2,000-token prompt then loads 1,792 tokens (7 chunks) where ExampleConnector, keyed by
# 128-token blocks, loads 1,920.

# Identical for every setup (PEERS.md "Fairness settings").
FAIR_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "LMCACHE_DISABLE_BANNER": "1",
}
FAIR_LLM_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "dtype": "float32",
    "disable_hybrid_kv_cache_manager": True,
    "enable_prefix_caching": True,
    "max_model_len": MAX_MODEL_LEN,
    "seed": 0,
}


def make_prompt(length: int, trial: int | str, vocab: int, seed: int = 0) -> list[int]:
    """``length`` token ids: BOS (1) then random ids from ``[6, vocab)`` (no special tokens).

    Deterministic in ``(seed, length, trial)`` whatever ``PYTHONHASHSEED`` is (a str seed is
    hashed with sha512), so every setup times the same prompts; different trials or lengths
    differ from the second token on, so no prompt shares a block with another.
    """
    if length < 2:
        raise ValueError(f"prompt length must be at least 2 tokens, got {length}")
    if vocab <= 7:
        raise ValueError(f"vocab must be larger than 7 (ids 0..5 are special), got {vocab}")
    rng = random.Random(f"kvmesh-ttft:{seed}:{length}:{trial}")
    return [1] + [rng.randrange(6, vocab) for _ in range(length - 1)]


def logprob_diff(a: Sequence[Mapping[int, float]], b: Sequence[Mapping[int, float]]) -> tuple[float, int]:
    """Max |difference| of the logprobs two runs gave the same tokens, and how many steps
    had different top-k token sets (a mismatch means different KV, whatever the numbers)."""
    if len(a) != len(b):
        raise ValueError(f"runs have {len(a)} and {len(b)} generated steps; compare runs of one prompt")
    worst, mismatches = 0.0, 0
    for sa, sb in zip(a, b, strict=True):
        if set(sa) != set(sb):
            mismatches += 1
        for tok in set(sa) & set(sb):
            worst = max(worst, abs(sa[tok] - sb[tok]))
    return worst, mismatches


def summarize(setup: str, row: Mapping[str, Any]) -> dict[str, Any]:
    """One result row from a worker's per-length measurements (seconds)."""
    runs = [float(x) for x in row["reload_s"]]
    cold = [float(x) for x in row["cold_s"]]
    diff = row.get("max_logprob_diff")
    mismatches = int(row.get("top5_mismatches", 0))
    return {
        "setup": setup,
        "prompt_tokens": int(row["prompt_tokens"]),
        "ttft_s_median": round(statistics.median(runs), 4) if runs else None,
        "ttft_s_p90": round(percentile(runs, 90), 4) if runs else None,
        "runs": [round(x, 4) for x in runs],  # every timed reload, in trial order
        "trials": len(runs),
        "cold_s_median": round(statistics.median(cold), 4) if cold else None,
        "cached_tokens": list(row.get("cached_tokens", [])),
        "max_logprob_diff": diff,
        "top5_mismatches": mismatches,
        "logprobs_ok": diff is not None and mismatches == 0 and float(diff) <= LOGPROB_TOL,
        "page_cache_dropped": row.get("page_cache_dropped"),
    }


def unavailable(setup: str, lengths: Sequence[int], error: str) -> list[dict[str, Any]]:
    """Rows that say why a setup has no numbers (one per length, so tables stay aligned)."""
    return [
        {
            "setup": setup,
            "prompt_tokens": n,
            "ttft_s_median": None,
            "ttft_s_p90": None,
            "runs": [],
            "max_logprob_diff": None,
            "error": error,
        }
        for n in lengths
    ]


def _median_at(results: Sequence[Mapping[str, Any]], setup: str, tokens: int) -> float | None:
    for r in results:
        if r["setup"] == setup and r["prompt_tokens"] == tokens and r.get("ttft_s_median") is not None:
            return float(r["ttft_s_median"])
    return None


def compute_targets(results: Sequence[Mapping[str, Any]], tokens: int = TARGET_TOKENS) -> dict[str, Any]:
    """The three headline ratios at ``tokens`` (lower is better), each with its target."""
    med = {s: _median_at(results, s, tokens) for s in SETUPS}

    def ratio(num: str, dens: Sequence[str], limit: float) -> dict[str, Any]:
        have = [v for v in (med[d] for d in dens) if v is not None]
        missing = [s for s in (num, *dens) if med[s] is None]
        top = med[num]
        # min over the denominators that ran: the strongest peer present.
        value = round(top / min(have), 3) if top is not None and have else None
        out: dict[str, Any] = {"value": value, "target": f"<= {limit}"}
        out["met"] = None if value is None else value <= limit
        if missing:
            out["missing"] = missing
        return out

    return {
        "prompt_tokens": tokens,
        "kvmesh_cpu/recompute": ratio("kvmesh_cpu", ["recompute"], 0.5),
        "kvmesh_cpu/min(example_connector,lmcache_mp)": ratio(
            "kvmesh_cpu", ["example_connector", "lmcache_mp"], 0.9
        ),
        "kvmesh_disk/example_connector": ratio("kvmesh_disk", ["example_connector"], 1.0),
    }


@dataclass
class SetupSpec:
    """What the worker needs to run one setup (written to it as JSON)."""

    setup: str
    model_dir: str
    lengths: list[int]
    trials: int
    seed: int = 0
    kv_connector: str | None = None
    kv_connector_module_path: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kvmesh_clear_cpu: bool = False  # clear kvmesh's cpu tier before timing (load from below)
    kvmesh_wait_writes: bool = False  # wait for kvmesh's write-behind before timing
    settle_s: float = 0.3  # pause after the cold run, every setup alike
    drop_page_cache: bool = True
    llm_args: dict[str, Any] = field(default_factory=lambda: dict(FAIR_LLM_ARGS))
    kv_transfer_args: dict[str, Any] = field(default_factory=dict)  # more KVTransferConfig fields


def build_spec(
    setup: str,
    model_dir: str,
    lengths: Sequence[int],
    trials: int,
    workdir: str,
    *,
    lmcache_port: int | None = None,
    redis_url: str | None = None,
    kvmesh_overrides: Mapping[str, Any] | None = None,
) -> SetupSpec:
    """The connector configuration of ``setup``; storage lives under ``workdir``.
    ``kvmesh_overrides`` (kvmesh config keys) are applied last to every kvmesh setup."""
    spec = SetupSpec(setup=setup, model_dir=model_dir, lengths=list(lengths), trials=trials)
    if setup == "recompute":
        pass
    elif setup == "example_connector":
        spec.kv_connector = "ExampleConnector"
        spec.kv_connector_extra_config = {"shared_storage_path": os.path.join(workdir, "example")}
    elif setup == "lmcache_mp":
        if lmcache_port is None:
            raise ValueError("lmcache_mp needs the port of a running lmcache server")
        spec.kv_connector = "LMCacheMPConnector"
        spec.kv_connector_extra_config = {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": lmcache_port,
        }
    elif setup in KVMESH_SETUPS:
        spec.kv_connector = KVMESH_CONNECTOR
        spec.kv_connector_module_path = KVMESH_MODULE
        spec.kvmesh_wait_writes = True
        # as the connector asks; the worker sets kv_role itself
        spec.kv_transfer_args = {k: v for k, v in TRANSFER_ARGS.items() if k != "kv_role"}
        cfg = extra_config()
        if setup == "kvmesh_disk":
            cfg.update(local_disk=os.path.join(workdir, "kvmesh-disk"), write_mode="through")
            spec.kvmesh_clear_cpu = True
        elif setup == "kvmesh_redis":
            if redis_url is None:
                raise ValueError("kvmesh_redis needs the URL of a running Redis")
            cfg.update(remote_url=redis_url)
            spec.kvmesh_clear_cpu = True
        spec.kv_connector_extra_config = {**cfg, **(kvmesh_overrides or {})}
    else:
        raise ValueError(f"unknown setup {setup!r}; valid: {', '.join(SETUPS)}")
    return spec
