"""What the scheduler side tells the worker side each step, and the event container the
worker side hands back (both cross a process boundary, pickled by vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents, KVEventAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

BlockHash = int | bytes  # vLLM's external block hash (maybe_convert_block_hash)


@dataclass
class LoadSpec:
    """Copy kvmesh's KV of ``token_ids[skip:]`` into the request's blocks, then release
    the pins the scheduler's lookup ``seq`` took."""

    req_id: str
    seq: int
    token_ids: list[int]  # the prompt up to the end of the last chunk read (a chunk boundary or its end)
    block_ids: list[int]  # the request's blocks covering the tokens to load
    skip: int  # vLLM's own prefix-cache hit (block aligned): those blocks are shared, never written
    upto: int | None = None  # load tokens [skip, upto); None = all of token_ids. A prompt's
    # partial tail chunk is keyed by all its tokens but its last token is never loaded.
    load_async: bool = False  # vLLM parked the request (WAITING_FOR_REMOTE_KVS): read beside the
    # steps, report it in get_finished (asyncload.py); else done before this step's forward
    pd: dict[str, Any] | None = None  # a decode half's kv_transfer_params: pull from the producer first
    adapter: str | None = None  # the LoRA adapter's weights fingerprint (its chunks' namespace)
    group_blocks: list[list[int]] = field(default_factory=list)  # hybrid models (groups.py): every
    # KV cache group's block ids, by vLLM's group index; empty with one group (block_ids)

    @property
    def end(self) -> int:
        return len(self.token_ids) if self.upto is None else self.upto


@dataclass
class SaveSpec:
    """Store the chunks of ``token_ids`` (all computed by the end of this step)."""

    req_id: str
    token_ids: list[int]  # the prompt up to a chunk boundary (or its end, for a tail chunk)
    block_ids: list[int]  # the request's blocks covering token_ids
    skip: int  # chunks ending at or before this were handed over in an earlier step
    block_hashes: list[BlockHash] = field(default_factory=list)  # vLLM's, for events; may be empty
    adapter: str | None = None  # the LoRA adapter's weights fingerprint (its chunks' namespace)
    lora: tuple[str, int] | None = None  # (lora_name, lora_int_id) as vLLM's own events carry them
    group_blocks: list[list[int]] = field(default_factory=list)  # hybrid models: as LoadSpec's


@dataclass
class KVMeshConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    releases: list[tuple[str, int]] = field(default_factory=list)  # (req_id, lookup seq): unpin
    preempted: list[str] = field(default_factory=list)  # their saves must finish before the forward
    scheduled_tokens: int = 0  # this step's tokens and requests: the worker times the forward
    scheduled_requests: int = 0  # (stepclock.py) to learn the prefill rate


class KVMeshKVEvents(KVConnectorKVEvents):
    """Worker events for one step. With tensor parallelism the executor merges the ranks'
    containers; :meth:`aggregate` keeps what every rank reported (a chunk is only usable
    when all shards hold it), as vLLM's LMCache container does."""

    def __init__(self, num_workers: int = 1) -> None:
        self._agg = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._agg.add_events(list(events))

    def aggregate(self) -> KVMeshKVEvents:
        common = self._agg.get_common_events()
        self._agg.clear_events()
        self._agg.add_events(common)
        self._agg.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._agg.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._agg.get_all_events())

    def get_number_of_workers(self) -> int:
        return int(self._agg.get_number_of_workers())

    def clear_events(self) -> None:
        self._agg.clear_events()
        self._agg.reset_workers()

    def __repr__(self) -> str:
        return f"<KVMeshKVEvents {len(self.get_all_events())} events>"
