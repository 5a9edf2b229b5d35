"""What ``kvmesh bench ttft`` runs, as data: the setups and their variants, their fairness
settings, the prompts and the per-setup worker spec (all pure, unit-tested; the schedule and
the paired statistics are :mod:`kvmesh.bench.ttft.pairs`, the orchestration
:mod:`kvmesh.bench.ttft.bench`, the vLLM process :mod:`kvmesh.bench.ttft.worker`).
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.bench.common.peers import PEER_CHUNK_SIZE
from kvmesh.harness.connector import CPU_GB, KVMESH_CONNECTOR, KVMESH_MODULE, TRANSFER_ARGS

BASES = (
    "recompute",
    "example_connector",
    "lmcache_mp",
    "lmcache_redis",
    "kvmesh_cpu",
    "kvmesh_disk",
    "kvmesh_redis",
)
SETUPS = BASES  # (the old name: the plot's colours and the CLI's help list these)
KVMESH_SETUPS = ("kvmesh_cpu", "kvmesh_disk", "kvmesh_redis")
LMCACHE_SETUPS = ("lmcache_mp", "lmcache_redis")
DEFAULT_LENGTHS = (500, 1000, 2000)
TARGET_TOKENS = 2000
LOGPROB_TOL = 1e-4
MAX_MODEL_LEN = 4096
# vLLM-CPU's KV block is 128 tokens: ExampleConnector reloads whole blocks (1,920 of a
# 2,000-token prompt). LMCache gets 128-token chunks too (its server's --chunk-size), so a
# headline row of each peer reloads the same 1,920 tokens as kvmesh at 128 without tail chunks.
PEER_CHUNK = PEER_CHUNK_SIZE
# The run's rows, in two phases (a phase's workers are all up at once, ~2 GiB each: all of
# them at once do not fit this machine's memory beside the other work on it); each headline
# pair is within one phase. kvmesh's rows are its config defaults (out of the box: 128-token
# chunks, no tail chunk, so 1,920 tokens reloaded at 2,000, like the peers: equal work),
# plus the tail-chunk feature row (``save_unfull_chunk``: 1,999 reloaded).
# The third phase is the hybrid model (``:swa``, ``make-tiny --preset swa``: sliding-window and
# full-attention layers, vLLM's hybrid KV cache manager on): the same reload-vs-recompute
# measurement at equal prompt lengths, and its stored bytes per token against a dense model's.
DEFAULT_PHASES: tuple[tuple[str, ...], ...] = (
    ("recompute", "lmcache_mp", "kvmesh_cpu", "kvmesh_cpu+tail"),
    ("example_connector", "kvmesh_disk", "lmcache_redis", "kvmesh_redis"),
    ("recompute:swa", "kvmesh_cpu:swa"),
)
# A setup name's ``:MODEL`` suffix -> the make-tiny preset it runs on (default: the bench model).
MODEL_PRESETS = {"swa": "swa"}
DEFAULT_SETUPS = tuple(s for phase in DEFAULT_PHASES for s in phase)
_SETUP_NAME = re.compile(r"(?P<base>[a-z_]+)(?:@(?P<chunk>\d+))?(?P<tail>[+-]tail)?(?::(?P<model>[a-z]+))?")


@dataclass(frozen=True)
class Variant:
    """A setup name parsed: ``kvmesh_disk@128-tail`` is the disk setup at 128-token chunks
    without tail chunks; ``kvmesh_cpu+tail`` the cpu one with ``save_unfull_chunk``; a bare
    name keeps kvmesh's config defaults (LMCache: :data:`PEER_CHUNK`)."""

    base: str
    chunk: int | None = None
    tail: bool | None = None
    model: str | None = None  # ``:swa``: a MODEL_PRESETS model instead of the bench model


def parse_setup(name: str) -> Variant:
    """The :class:`Variant` a setup name stands for; ValueError naming the valid forms."""
    m = _SETUP_NAME.fullmatch(name)
    if m is None or m["base"] not in BASES:
        raise ValueError(
            f"unknown setup {name!r}; valid: {', '.join(BASES)}, a kvmesh one optionally with "
            "@CHUNK and +tail/-tail (e.g. kvmesh_cpu@128-tail), an lmcache one with @CHUNK; "
            "recompute and kvmesh ones optionally on another model: "
            + ", ".join(":" + m for m in MODEL_PRESETS)
        )
    base, chunk = m["base"], int(m["chunk"]) if m["chunk"] else None
    tail = None if not m["tail"] else m["tail"] == "+tail"
    if base not in KVMESH_SETUPS + LMCACHE_SETUPS and (chunk or tail is not None):
        raise ValueError(f"setup {base!r} takes no @CHUNK or tail option (got {name!r})")
    if base in LMCACHE_SETUPS and tail is not None:
        # LMCache 0.5.6's MP server has no save_unfull_chunk: lmcache/v1/multiprocess/config.py
        # takes no such argument, and its token hasher keys full chunks only.
        raise ValueError(f"{name!r}: LMCache 0.5.6's MP server has no tail-chunk option")
    if chunk is not None and (chunk <= 0 or chunk % PEER_CHUNK):
        raise ValueError(f"{name!r}: the chunk size must be a multiple of vLLM's block size {PEER_CHUNK}")
    model = m["model"]
    if model is not None and model not in MODEL_PRESETS:
        raise ValueError(f"{name!r}: unknown model {model!r}; valid: {', '.join(MODEL_PRESETS)}")
    if model is not None and base not in ("recompute", *KVMESH_SETUPS):
        # The peers' connectors lack SupportsHMA: vLLM would run the hybrid model without its
        # hybrid manager, which is not the measurement.
        raise ValueError(f"{name!r}: only recompute and kvmesh setups run on another model")
    return Variant(base, chunk, tail, model)


# Identical for every setup (PEERS.md "Fairness settings"). vLLM's hybrid KV cache manager
# stays on (kvmesh implements SupportsHMA); a dense model has one KV cache group, so it
# runs alike on or off. Peer connectors without SupportsHMA get it off (PEER_NO_HMA).
FAIR_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "LMCACHE_DISABLE_BANNER": "1",
}
FAIR_LLM_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "dtype": "float32",
    "enable_prefix_caching": True,
    "max_model_len": MAX_MODEL_LEN,
    "seed": 0,
    # 256 MiB of vLLM KV space each (a 4,096-token prompt takes 24 MiB of this model's KV):
    # with every setup of a phase up at once, 1 GiB each (VLLM_CPU_KVCACHE_SPACE=1, which would
    # override this) made a worker ~3 GiB and nine of them more than this machine has.
    "kv_cache_memory_bytes": 256 * 2**20,
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


@dataclass
class SetupSpec:
    """What the worker needs to run one setup (written to it as JSON)."""

    setup: str
    model_dir: str
    seed: int = 0
    kv_connector: str | None = None
    kv_connector_module_path: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kvmesh_clear_cpu: bool = False  # clear kvmesh's cpu tier before timing (load from below)
    kvmesh_wait_writes: bool = False  # wait for kvmesh's write-behind before timing
    lmcache_clear_url: str | None = None  # POST {"tier": "l1"} here before timing (load from L2)
    settle_s: float = 0.3  # pause after the cold run, every setup alike
    # LMCache's L2 store is write-behind with no "flushed" call to wait on (kvmesh's is
    # wait_for_writes): the L2 setup waits this much longer before its L1 is cleared.
    extra_settle_s: float = 0.0
    drop_page_cache: bool = True
    llm_args: dict[str, Any] = field(default_factory=lambda: dict(FAIR_LLM_ARGS))
    kv_transfer_args: dict[str, Any] = field(default_factory=dict)  # more KVTransferConfig fields


# Peer setups whose connector does not implement vLLM's SupportsHMA: vLLM requires the hybrid
# KV cache manager off for them (it would turn it off itself; said explicitly here).
PEER_NO_HMA = {"disable_hybrid_kv_cache_manager": True}


def build_spec(
    setup: str,
    model_dir: str,
    workdir: str,
    *,
    lmcache_port: int | None = None,
    lmcache_http_url: str | None = None,
    redis_url: str | None = None,
    kvmesh_overrides: Mapping[str, Any] | None = None,
    model_dirs: Mapping[str, str] | None = None,
) -> SetupSpec:
    """The connector configuration of ``setup`` (a :func:`parse_setup` name); storage lives
    under ``workdir``. kvmesh setups get kvmesh's config defaults, then ``kvmesh_overrides``
    (kvmesh config keys), then the name's ``@CHUNK`` / ``+tail`` / ``-tail``."""
    v = parse_setup(setup)
    if v.model is not None:
        if not model_dirs or v.model not in model_dirs:
            raise ValueError(f"{setup} needs the directory of the {v.model!r} model")
        model_dir = model_dirs[v.model]
    spec = SetupSpec(setup=setup, model_dir=model_dir)
    if v.base == "recompute":
        pass
    elif v.base == "example_connector":
        spec.kv_connector = "ExampleConnector"
        spec.llm_args.update(PEER_NO_HMA)
        spec.kv_connector_extra_config = {"shared_storage_path": os.path.join(workdir, "example")}
    elif v.base in LMCACHE_SETUPS:
        if lmcache_port is None:
            raise ValueError(f"{setup} needs the port of a running lmcache server")
        spec.kv_connector = "LMCacheMPConnector"
        spec.llm_args.update(PEER_NO_HMA)
        spec.kv_connector_extra_config = {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": lmcache_port,
        }
        if v.base == "lmcache_redis":
            if lmcache_http_url is None:
                raise ValueError(f"{setup} needs the HTTP URL of its lmcache server (to clear its L1)")
            spec.lmcache_clear_url = lmcache_http_url.rstrip("/") + "/cache/clear"
            spec.extra_settle_s = 1.0
    elif v.base in KVMESH_SETUPS:
        spec.kv_connector = KVMESH_CONNECTOR
        spec.kv_connector_module_path = KVMESH_MODULE
        spec.kvmesh_wait_writes = True
        # as the connector asks; the worker sets kv_role itself
        spec.kv_transfer_args = {k: v for k, v in TRANSFER_ARGS.items() if k != "kv_role"}
        # kvmesh's own defaults (config.py) for chunk size and tail chunks: out of the box
        cfg: dict[str, Any] = {"max_local_cpu_size": CPU_GB}
        if v.base == "kvmesh_disk":
            cfg.update(local_disk=os.path.join(workdir, "kvmesh-disk"), write_mode="through")
            spec.kvmesh_clear_cpu = True
        elif v.base == "kvmesh_redis":
            if redis_url is None:
                raise ValueError(f"{setup} needs the URL of a running Redis")
            cfg.update(remote_url=redis_url)
            spec.kvmesh_clear_cpu = True
        cfg.update(kvmesh_overrides or {})
        if v.chunk is not None:
            cfg["chunk_size"] = v.chunk
        if v.tail is not None:
            cfg["save_unfull_chunk"] = v.tail
        spec.kv_connector_extra_config = cfg
    return spec


def dense_bytes_per_token(config: Mapping[str, Any], itemsize: int = 4) -> int:
    """KV bytes per token of a model (its ``config.json``) if every layer kept every token:
    a dense model's, the yardstick of a sliding-window model's stored bytes."""
    heads = int(config["num_attention_heads"])
    head = int(config.get("head_dim") or config["hidden_size"] // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return int(config["num_hidden_layers"]) * 2 * kv_heads * head * itemsize


def stored_bytes_per_token(stats: Mapping[str, Any] | None) -> float | None:
    """Bytes kvmesh stored in its cpu tier per prompt token saved, over every KV cache
    group's engine (a connector ``stats`` answer), or ``None`` without saves. Chunks the
    cpu tier took in as promotions of lower-tier hits (a reload from disk or Redis) are not
    stores: their share of its ``bytes_in`` is left out."""
    if not stats:
        return None
    tokens = int(stats.get("connector", {}).get("saved_tokens", 0))
    engines = [stats.get("engine", {}), *stats.get("groups", {}).values()]
    nbytes = 0.0
    for e in engines:
        cpu = e.get("cpu", {})
        puts = int(cpu.get("stores", 0))
        promoted = sum(int(t.get("hits", 0)) for name, t in e.items() if name not in ("cpu", "engine"))
        share = max(0, puts - promoted) / puts if puts and promoted else 1.0
        nbytes += int(cpu.get("bytes_in", 0)) * share
    return round(nbytes / tokens, 1) if tokens else None


def lmcache_chunk(setup: str) -> int:
    """The ``--chunk-size`` of an lmcache setup's server (:data:`PEER_CHUNK` unless named)."""
    return parse_setup(setup).chunk or PEER_CHUNK
