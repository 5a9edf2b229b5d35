"""vLLM's own offloading events (its CPU tier and its tiering's secondary tiers) indexed and
scored: a fleet that offloads with vLLM's connector gets tier-aware routing from kvmesh.

The events are made by vLLM 0.32's ``OffloadingEventsTracker`` (the offloading connector's
self-describing KV events) from ``OffloadingEvent``\\ s as its managers emit them, with block
hashes from vLLM's own ``hash_block_tokens``, then encoded by msgspec as vLLM's publisher
does. The request is a stand-in with the three fields the tracker reads (a real vLLM
``Request`` needs a running engine's sampling and hashing set-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest

from kvmesh.events import decode_batch
from kvmesh.index import BlockIndex, Medium
from kvmesh.routing.config import MediumWeights
from kvmesh.routing.scorers import PrefixScorer, RoutingRequest, medium_columns, medium_tokens
from kvmesh.routing.table import ReplicaTable

pytestmark = [pytest.mark.vllm]

BLOCK = 16  # vLLM's GPU block size here
CHUNK = 64  # the offloading connector's chunk: 4 blocks


@dataclass
class _Request:
    block_hashes: list[bytes]
    all_token_ids: list[int]
    lora_request: None = None


@pytest.fixture(scope="module")
def vllm_events() -> Any:
    from vllm.distributed import kv_events
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import events, scheduler
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1 import kv_offload
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    return kv_events, events, scheduler, kv_offload, kv_cache_utils, hash_fn


def _offload(
    vllm_events: Any, tokens: list[int], tiers: list[tuple[str, str | None, str | None, int]]
) -> bytes:
    """A published payload: the first ``chunks`` chunks of ``tokens`` stored by each tier
    ``(medium, locality, ownership, chunks)``, as vLLM's offloading connector publishes it."""
    kv_events, events, scheduler, kv_offload, kv_cache_utils, hash_fn = vllm_events
    hashes: list[bytes] = []
    for i in range(len(tokens) // BLOCK):
        parent = hashes[-1] if hashes else None
        hashes.append(kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[i * BLOCK : (i + 1) * BLOCK]))
    req = _Request(hashes, tokens)
    group = scheduler.GroupOffloadConfig(
        group_idx=0,
        tokens_per_block=BLOCK,
        tokens_per_chunk=CHUNK,
        hashes_per_chunk=CHUNK // BLOCK,
        kv_event_group_spec=events.OffloadingEventGroupSpec("full_attention", None),
        sliding_window_size_in_chunks=None,
        kv_cache_spec=None,
        manager_cls=None,
    )
    tracker = events.OffloadingEventsTracker(kv_offload.base.OffloadingKVEventsConfig(True, True))
    keys = []
    for c in range(len(tokens) // CHUNK):
        key = kv_offload.base.make_offload_key(hashes[(c + 1) * (CHUNK // BLOCK) - 1], 0)
        tracker.record_store(req, group, c, key)
        keys.append(key)
    raw = []
    for medium, locality, ownership, chunks in tiers:
        raw.append(
            kv_offload.base.OffloadingEvent(
                keys=keys[:chunks],
                medium=kv_offload.base.Medium(medium),
                removed=False,
                locality=None if locality is None else kv_offload.base.Locality(locality),
                ownership=ownership,
            )
        )
    out = list(tracker.take_events(raw))
    assert out and all(isinstance(e, kv_events.BlockStored) and e.block_size == BLOCK for e in out)
    return msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=1.0, events=out))


def test_vllm_cpu_offload_events_are_indexed_as_cpu_and_scored(vllm_events: Any) -> None:
    tokens = np.random.default_rng(3).integers(1, 30_000, 4 * CHUNK).tolist()
    index = BlockIndex(default_block_size=BLOCK)
    index.apply("r0", decode_batch(_offload(vllm_events, tokens, [("CPU", "LOCAL", None, 3)])))
    assert index.stats()["stored_blocks"] == 12 and index.stats()["unknown_medium"] == 0
    match = index.match(tokens)
    assert dict(match)["r0"].ranges == ((0, 3 * CHUNK, Medium.CPU),)
    table = ReplicaTable(["r0", "r1"])
    req = RoutingRequest(np.asarray(tokens, np.uint32), matches=match)
    score = PrefixScorer(index, MediumWeights().by_name()).score_array(req, table)
    assert score.tolist() == pytest.approx([0.8 * 3 / 4, 0.0])  # CPU's weight on 3 of 4 chunks


def test_vllm_tiering_secondary_tiers_are_kept_under_their_own_names(vllm_events: Any) -> None:
    """A secondary tier (ownership) and a remote one (locality) are media of their own: indexed,
    matched by name, scored at their configured weight (OTHER's when not configured)."""
    tokens = np.random.default_rng(4).integers(1, 30_000, 4 * CHUNK).tolist()
    tiers = [("CPU", "LOCAL", None, 1), ("STORAGE", "LOCAL", "fs", 2), ("STORAGE", "REMOTE", "obj", 4)]
    index = BlockIndex(default_block_size=BLOCK)
    index.apply("r0", decode_batch(_offload(vllm_events, tokens, tiers)))
    assert index.stats()["unknown_medium"] == 0 and set(index.media.named) == {
        "STORAGE/fs",
        "STORAGE:REMOTE/obj",
    }
    match = index.match(tokens)
    got = [(a, b, str(getattr(m, "name", m))) for a, b, m in dict(match)["r0"].ranges]
    # the best medium of each chunk: CPU, then the local fs tier, then the remote object tier
    assert got == [(0, 64, "CPU"), (64, 128, "STORAGE/fs"), (128, 256, "STORAGE:REMOTE/obj")]
    table = ReplicaTable(["r0"])
    req = RoutingRequest(np.asarray(tokens, np.uint32), matches=match)
    cols = dict(zip(medium_columns(req), medium_tokens(req, table)[0].tolist(), strict=True))  # type: ignore[index]
    assert (cols["CPU"], cols["STORAGE/fs"], cols["STORAGE:REMOTE/obj"]) == (64, 64, 128)
    weights = MediumWeights.model_validate({"STORAGE/fs": 0.6, "OTHER": 0.1}).by_name()
    score = PrefixScorer(index, weights).score_array(req, table)
    assert score.tolist() == pytest.approx([(64 * 0.8 + 64 * 0.6 + 128 * 0.1) / 256])
