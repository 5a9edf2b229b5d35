"""The admin operations on one :class:`~kvmesh.CacheEngine`, as plain functions.

Each returns a JSON-ready dict. A client mistake (a tier this engine does not have, tokens
missing) raises :class:`~kvmesh.admin.schema.BodyError`; a lower tier that fails gives a
per-tier ``{"error": ...}`` entry, never an exception.

``compress`` re-encodes stored chunks in place through the shared
:func:`kvmesh.tiers.base.recode`, in every tier that declares ``Feature.RECODE`` (disk, fs,
redis). The cpu tier holds raw KV that attention reads directly, so there is
nothing to re-encode there: ``compress`` answers it with equal before/after bytes and a note.
Later writes keep using the tier's configured codec (``disk_serde`` / ``remote_serde``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvmesh.core.keys import ChunkKey, as_token_array
from kvmesh.errors import BodyError, TierError
from kvmesh.tiers.base import as_recodable, recode

if TYPE_CHECKING:
    from kvmesh.core.engine import CacheEngine


def _tokens(tokens: Sequence[int] | None) -> np.ndarray:
    if tokens is None:
        raise BodyError("tokens", "required: the prompt's token ids")
    return as_token_array(np.asarray(tokens, dtype=np.int64))


def _check_tier(engine: CacheEngine, tier: str | None) -> None:
    if tier is not None and tier != "cpu" and tier not in engine.lower:
        have = ", ".join(["cpu", *engine.lower])
        raise BodyError("tier", f"this engine has no {tier} tier (it has: {have})")


def _leading(flags: Sequence[bool], bounds: Sequence[tuple[int, int]]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return bounds[n - 1][1] if n else 0


def lookup(engine: CacheEngine, tokens: Sequence[int] | None) -> dict[str, Any]:
    """Per tier, how many leading tokens it holds; ``hit_tokens``: what a request would load."""
    arr = _tokens(tokens)
    keys = engine.keys.keys_for_array(arr)
    bounds = engine.keys.chunk_bounds(len(arr))
    tiers: dict[str, Any] = {"cpu": {"tokens": _leading(engine.cpu.contains(keys), bounds)}}
    for name, tier in engine.lower.items():
        try:
            tiers[name] = {"tokens": _leading(tier.contains(keys), bounds)}
        except TierError as exc:
            tiers[name] = {"error": str(exc)}
    return {"tokens": len(arr), "hit_tokens": engine.lookup(arr), "tiers": tiers}


def clear(
    engine: CacheEngine, tier: str | None = None, tokens: Sequence[int] | None = None, force: bool = False
) -> dict[str, Any]:
    _check_tier(engine, tier)
    arr = _tokens(tokens) if tokens is not None else None
    return {"cleared": engine.clear(tier, arr, force)}


def _set_pins(engine: CacheEngine, tokens: Sequence[int] | None, tier: str | None, op: str) -> dict[str, Any]:
    """``op`` ("pin" or "unpin") the chunks of ``tokens`` in every tier that declares pins
    (only ``tier``, if given)."""
    _check_tier(engine, tier)
    keys = engine.keys.keys_for_array(_tokens(tokens))
    tiers = [tier] if tier else None
    done = engine.pin_keys(keys, tiers) if op == "pin" else engine.unpin_keys(keys, tiers)
    return {"chunks": len(keys), "tiers": done}


def pin(engine: CacheEngine, tokens: Sequence[int] | None, tier: str | None = None) -> dict[str, Any]:
    """Pin the chunks of ``tokens`` (counted: each pin needs its own unpin)."""
    return _set_pins(engine, tokens, tier, "pin")


def unpin(engine: CacheEngine, tokens: Sequence[int] | None, tier: str | None = None) -> dict[str, Any]:
    return _set_pins(engine, tokens, tier, "unpin")


def move(engine: CacheEngine, tokens: Sequence[int] | None, tier: str) -> dict[str, Any]:
    _check_tier(engine, tier)
    arr = _tokens(tokens)
    return {"tier": tier, "bytes_moved": engine.move(arr, tier)}


def compress(
    engine: CacheEngine, tokens: Sequence[int] | None, codec: str = "zstd", tier: str | None = None
) -> dict[str, Any]:
    """Re-encode the chunks of ``tokens`` with ``codec`` in ``tier`` (default: every lower
    tier). Returns stored bytes before and after, per tier and summed."""
    _check_tier(engine, tier)
    keys: list[ChunkKey] = engine.keys.keys_for_array(_tokens(tokens))
    names = [tier] if tier else list(engine.lower)
    out: dict[str, Any] = {}
    before = after = 0
    for name in names:
        if name == "cpu":
            held = sum(engine.cpu.contains(keys)) * engine.cpu.pool.slot_bytes
            out[name] = {
                "before": held,
                "after": held,
                "note": "cpu holds raw KV for attention to read; nothing to re-encode",
            }
        else:
            recodable = as_recodable(engine.lower[name])
            if recodable is None:
                out[name] = {"error": f"the {name} tier cannot re-encode stored chunks"}
                continue
            try:
                b, a = recode(recodable, keys, codec)
            except TierError as exc:
                engine.metrics[name].inc("errors")
                out[name] = {"error": str(exc)}
                continue
            out[name] = {"before": int(b), "after": int(a)}
        before += out[name]["before"]
        after += out[name]["after"]
    return {"codec": codec, "before": before, "after": after, "tiers": out}


def health(engine: CacheEngine) -> dict[str, Any]:
    tiers: dict[str, str] = {"cpu": "up"}
    for name, tier in engine.lower.items():
        try:
            tiers[name] = tier.health()
        except Exception as exc:  # a broken probe means the tier is down, not the call
            tiers[name] = f"down ({exc})"
    pool = engine.cpu.pool
    capacity = pool.num_slots * pool.slot_bytes
    used = pool.used_bytes
    return {
        "model_id": engine.model_id,
        "shard": engine.keys.shard,
        "chunk_size": engine.config.chunk_size,
        "tiers": tiers,
        "pool": {"used_bytes": used, "capacity_bytes": capacity, "used_fraction": used / capacity},
        "write_queue": {name: w.pending for name, w in engine.writers.items()},
        "warnings": engine.security_warnings(),
    }


def check_finish(engine: CacheEngine, wait: bool = False, timeout_s: float = 60.0) -> dict[str, Any]:
    """Whether every store handed over before this call is in the pool (``stored``) and every
    write queued before it has landed; with ``wait``, block (up to ``timeout_s`` overall) until
    both are."""
    t0 = time.monotonic()
    # Stores still on their way (the connector's saver, a store running now) queue their
    # writes later: they count as queued before this call.
    stored, done = engine.writes_landed(timeout_s if wait else 0.0)
    return {
        "finished": stored and all(done.values()),
        "stored": stored,
        "tiers": done,
        "pending": {name: w.pending for name, w in engine.writers.items()},
        "waited_s": round(time.monotonic() - t0, 4),
    }


def stats(engine: CacheEngine) -> dict[str, Any]:
    # costs: the measured load/compute figures a router's cost model reads (docs/cost-model.md)
    return {"tiers": engine.stats(), "costs": engine.cost_figures()}
