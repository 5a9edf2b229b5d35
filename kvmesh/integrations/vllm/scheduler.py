"""The scheduler half of the connector: decides what to load and save, in vLLM's
scheduler process. Plain Python over duck-typed vLLM objects, so it is unit-tested without
starting vLLM.

Life of a request:

1. ``lookup`` (vLLM's ``get_num_new_matched_tokens``): ask every worker rank how many
   leading prompt tokens kvmesh holds. The worker pins what it found, under this
   request's id and a lookup sequence number, so eviction cannot take back the promise.
2. ``after_alloc``: vLLM granted ``num_external`` tokens and allocated blocks: plan a
   load (the worker loads, then releases the pins) or, with nothing to load, a release.
3. ``build_meta`` (every step): the planned loads and releases, plus saves: every chunk of
   the prompt whose tokens are all computed by the end of this step (chunked prefill hands
   a long prompt over in several steps).
4. ``finished``: forget the request, and release its pins if a lookup never led to a load;
   on the host-device path, tell vLLM to hold its blocks if it had saves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmesh.core.fingerprint import adapter_fingerprint, local_model_dir
from kvmesh.core.fleetkey import FleetKey
from kvmesh.errors import ConfigError
from kvmesh.integrations.vllm.metadata import BlockHash, KVMeshConnectorMetadata, LoadSpec, SaveSpec
from kvmesh.integrations.vllm.pd_params import (
    Transfer,
    new_transfer_id,
    remote_prefill,
    response_params,
    verify_params,
    wants_export,
)

log = logging.getLogger(__name__)


class Lookup(Protocol):
    def call(self, op: str, **args: Any) -> Any: ...


def cacheable(request: Any) -> bool:
    """kvmesh keys chunks by token ids (and a LoRA request's adapter, see :func:`lora_of`).
    Multimodal inputs, prompt embeddings or a per-request cache salt change the KV of the same
    token ids, so such requests are neither looked up nor saved (vLLM's own prefix cache
    still serves them)."""
    return (
        getattr(request, "prompt_token_ids", None) is not None
        and not getattr(request, "mm_features", None)
        and getattr(request, "prompt_embeds", None) is None
        and not getattr(request, "cache_salt", None)
    )


def lora_of(request: Any) -> tuple[str, int, str] | None:
    """``(lora_name, lora_int_id, lora_path)`` of a request's LoRA adapter (vLLM's
    ``Request.lora_request``, a ``LoRARequest``), ``None`` for the base model."""
    lora = getattr(request, "lora_request", None)
    if not lora:
        return None
    return (str(lora.lora_name), int(lora.lora_int_id), str(getattr(lora, "lora_path", "") or ""))


def adapter_key(lora_path: str) -> str:
    """The fingerprint of the adapter at ``lora_path`` (a directory, or a Hub id already in
    the local cache, as vLLM resolves it); ``ConfigError`` when its weights cannot be read
    here: such a request is not cached (its name alone would let another adapter's KV in)."""
    found = local_model_dir(lora_path) if lora_path else None
    if found is None:
        raise ConfigError(f"LoRA adapter path {lora_path!r} is not a local directory nor in the Hub cache")
    return adapter_fingerprint(found)


@dataclass
class _Tracked:
    prompt: Sequence[int]
    hashes: list[BlockHash]
    save_limit: int  # the last chunk boundary inside the prompt
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0  # chunks below this were handed to the worker for saving
    adapter: str | None = None  # the LoRA adapter's fingerprint: its chunks' namespace
    lora: tuple[str, int] | None = None  # (lora_name, lora_int_id), for the worker's events
    group_blocks: list[list[int]] = field(default_factory=list)  # hybrid: every group's blocks


class SchedulerSide:
    def __init__(
        self,
        chunk_size: int,
        block_size: int,
        ranks: Sequence[Lookup],
        convert_hash: Callable[[Any], BlockHash] = lambda h: h,
        load: bool = True,
        save: bool = True,
        tail: bool = False,
        delay_free: bool = False,
        pd_ranks: Sequence[Lookup] = (),
        engine_id: str = "",
        pd_async: bool = False,
        pd_wait_s: float = 6.0,
        pd_key: FleetKey | None = None,
        pd_ttl_s: float = 60.0,
        async_loads: str = "off",
        groups: int = 1,
        main_group: int = 0,
    ) -> None:
        self.chunk_size = chunk_size
        # Hybrid models (groups.py): block ids come per KV cache group; ``block_ids`` are the
        # main (full-attention) group's, ``group_blocks`` all of them. vLLM cannot take back
        # block-level load errors with several groups, so their loads are all asynchronous
        # (a failed one is reported as a failed receive: vLLM recomputes the request).
        self.groups = groups
        self.main_group = main_group
        if groups > 1 and load:
            async_loads = "all"
        # save_unfull_chunk: the prompt's partial last chunk is cached too, so a repeated
        # prompt loads all but its last token instead of stopping at a chunk boundary.
        self.tail = tail
        self.block_size = block_size
        self.ranks = list(ranks)
        self.convert_hash = convert_hash
        self.load_enabled = load
        self.save_enabled = save
        # Host-device path: saves read blocks after their step, so a request that had any
        # keeps its blocks at finish until the worker reports them done (get_finished).
        self.delay_free = delay_free
        self._saved: set[str] = set()
        self._seq = 0
        self._lookups: dict[str, tuple[int, int, int]] = {}  # req_id -> (seq, hit, vLLM local hit)
        self._new: dict[str, _Tracked] = {}  # looked up, not yet in a scheduler output
        self._active: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        self._releases: list[tuple[str, int]] = []
        self.stats = {"lookups": 0, "lookup_hit_tokens": 0, "rpc_failures": 0, "loads_planned": 0}
        # Prefill/decode (pd.py): the worker ranks' pd_export / pd_pull, on clients whose
        # timeout covers a pull; decode halves already pulled (a re-lookup never pulls again).
        self.pd_ranks = list(pd_ranks)
        self.engine_id = engine_id
        self._pulled: set[str] = set()
        self._pulling: dict[str, float] = {}  # req -> when to stop waiting for its pull
        self.pd_async = pd_async
        self.pd_wait_s = pd_wait_s
        self.pd_key = pd_key  # signs exported kv_transfer_params (pd_params.py)
        self.pd_ttl_s = pd_ttl_s
        # Asynchronous loads: "lower" (chunks below the cpu tier and PD pulls), "all", "off".
        self.async_loads = async_loads
        self._pending: dict[str, int] = {}  # req -> seq of a lookup still running on a worker
        self._async: dict[str, dict[str, Any] | None] = {}  # req -> load async (PD params or None)
        # LoRA adapters: path -> weights fingerprint, or None when it cannot be fingerprinted
        # (read once per path: vLLM never reloads an adapter's files under the same path).
        self._adapters: dict[str, str | None] = {}
        self._req_adapter: dict[str, str] = {}  # LoRA requests looked up -> their adapter
        # Requests with a load planned and neither preempted nor finished since. vLLM looks a
        # request up again only when none of its load landed (a failed load resets it to 0
        # computed tokens) or after a preemption: looked up again without one, the load
        # failed, and the same lookup would find the same chunks and fail the same way, for
        # ever (a soak saw one request do that 5,865 times in 60 s). Such a request gets
        # nothing more from kvmesh: vLLM computes it.
        self._planned: set[str] = set()
        # Requests looked up and not finished: with no other, a lower-tier load runs in the
        # step (nobody waits for it there; the asynchronous path would cost it a step).
        self._inflight: set[str] = set()

    def _adapter(self, request: Any) -> tuple[bool, str | None]:
        """``(keyable, adapter fingerprint)`` of a request: ``(True, None)`` for the base
        model; ``(False, None)`` for an adapter whose weights cannot be read here."""
        lora = lora_of(request)
        if lora is None:
            return True, None
        if self.groups > 1:
            # A hybrid model's other groups have no per-adapter key spaces (hybrid.py): its
            # LoRA requests are left to vLLM rather than risk another adapter's window.
            if "lora_hybrid" not in self.stats:
                log.warning("kvmesh: LoRA requests of a hybrid model are not cached by kvmesh")
            self.stats["lora_hybrid"] = self.stats.get("lora_hybrid", 0) + 1
            return False, None
        path = lora[2]
        if path not in self._adapters:
            try:
                self._adapters[path] = adapter_key(path)
                log.info(
                    "kvmesh: LoRA adapter %s (%s) has fingerprint %s", lora[0], path, self._adapters[path]
                )
            except ConfigError as exc:
                log.warning("kvmesh: LoRA adapter %s is not cached by kvmesh: %s", lora[0], exc)
                self._adapters[path] = None
            self.stats["lora_adapters"] = len(self._adapters)
        fp = self._adapters[path]
        return fp is not None, fp

    # -- vLLM: get_num_new_matched_tokens ------------------------------------------------
    def lookup(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens kvmesh can supply beyond vLLM's own (block-aligned) hit; ``None`` while a
        decode half's pull is running (vLLM then skips the request this step). Never raises."""
        req_id = request.request_id
        self._inflight.add(req_id)
        keyable, adapter = self._adapter(request)
        ok = keyable and cacheable(request)
        if ok and self.save_enabled and req_id not in self._active:
            self._new[req_id] = self._track(request, adapter)
        prompt = request.prompt_token_ids if ok else None
        if not ok or not self.load_enabled or not self.ranks or prompt is None:
            return 0
        if req_id in self._planned:
            self._planned.discard(req_id)  # the next lookup of it (after a preemption) may load
            self._after_failed_load(req_id)
            return 0
        if adapter is not None:
            self._req_adapter[req_id] = adapter
        # Leave >= 1 prompt token to compute (vLLM needs a forward to sample from). A hit
        # ends on a chunk boundary, hence on a block boundary too — except a tail chunk,
        # keyed by the whole prompt, which loads up to the prompt's last token.
        last = len(prompt) - 1
        cap = len(prompt) if self.tail else last // self.chunk_size * self.chunk_size
        tokens = list(prompt[:cap])
        self._async.pop(req_id, None)
        # PD hand-offs (pd.py) move base-model chunks only: a LoRA request prefills here.
        pd = remote_prefill(request) if self.pd_ranks and req_id not in self._pulled and not adapter else None
        if pd is not None and self.async_loads != "off" and min(cap, last) > num_computed_tokens:
            transfer = verify_params(pd, self.pd_key)  # offer only what a verified producer exported
            if isinstance(transfer, Transfer):
                return self._pd_async(req_id, pd, transfer.num_tokens, cap, last, num_computed_tokens)
            # Refused: the worker's pull below refuses it too, and counts why.
        if pd is not None and not self._pd_ready(req_id, pd, tokens, min(cap, last) <= num_computed_tokens):
            return None  # the pull is still running: vLLM asks again at a later step
        if min(cap, last) <= num_computed_tokens:
            return 0
        pending = self._pending.pop(req_id, None)
        if pending is None:
            self._seq += 1
            self.stats["lookups"] += 1
        seq = self._seq if pending is None else pending
        hit, lower, waiting = cap, False, False
        extra: dict[str, Any] = {"detail": True} if self.async_loads != "off" else {}
        if adapter is not None:  # only then: a worker that predates adapters is never sent one
            extra["adapter"] = adapter
        for rank in self.ranks:
            got = rank.call("lookup", req=req_id, seq=seq, tokens=tokens, **extra)
            if isinstance(got, dict):  # {"tokens", "lower"} or {"pending"}
                if got.get("pending"):
                    waiting = True
                    continue
                lower = lower or bool(got.get("lower"))
                got = got.get("tokens")
            if not isinstance(got, int) or got < 0:
                self.stats["rpc_failures"] += got is None
                got = 0
            hit = min(hit, got)
        if waiting:  # a slow tier: this request waits, the others are scheduled meanwhile
            self._pending[req_id] = seq
            self.stats["lookups_pending"] = self.stats.get("lookups_pending", 0) + 1
            return None
        hit = last if hit > last else hit - hit % self.block_size
        # Beside the batch, unless nothing else is in flight: then nobody waits for a load
        # inside the step, and the asynchronous path costs the request a step more (it is
        # named at the end of the step its read ends in, computed at the next). Hybrid
        # models: never synchronous (see __init__).
        alone = self.async_loads == "lower" and self._inflight == {req_id}
        if ((lower and not alone) or self.groups > 1) and hit > num_computed_tokens:
            self._async[req_id] = None
        # Remember the lookup even on a miss: a rank may have pinned before the answer was
        # lost, and the release frees exactly what this seq pinned.
        self._lookups[req_id] = (seq, hit, num_computed_tokens)
        self.stats["lookup_hit_tokens"] += hit
        return max(0, hit - num_computed_tokens)

    def _after_failed_load(self, req_id: str) -> None:
        first = "loads_not_retried" not in self.stats
        self.stats["loads_not_retried"] = self.stats.get("loads_not_retried", 0) + 1
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "kvmesh: request %s is looked up again after its load failed: vLLM computes it "
            "(a failed load is never retried; later ones are logged at debug level, counted in "
            "loads_not_retried)",
            req_id,
        )

    def load_async(self, req_id: str) -> bool:
        """Whether the tokens :meth:`lookup` just offered should be loaded asynchronously."""
        return req_id in self._async

    def _pd_async(self, req_id: str, pd: Any, offered: int, cap: int, last: int, local: int) -> int:
        """A decode half, loaded through vLLM's asynchronous path: offer what the producer
        exported (``offered`` tokens, from verified parameters); the worker pulls it (then
        reads what the shared tier has) beside the steps, and whatever it cannot fill is
        reported invalid and recomputed."""
        hit = min(cap, offered)
        hit = last if hit > last else hit - hit % self.block_size
        if hit <= local:
            self._pulled.add(req_id)
            for rank in self.pd_ranks:  # nothing to pull: the producer unpins now
                rank.call("pd_confirm", params=dict(pd))
            return 0
        # No side effect yet: vLLM may ask again (no room this step); the pull is planned,
        # and counted, once vLLM has allocated the blocks (after_alloc).
        self._lookups[req_id] = (0, hit, local)  # no worker pins: the pull brings the chunks
        self._async[req_id] = dict(pd)
        return hit - local

    def _pd_ready(self, req_id: str, pd: Any, tokens: list[int], local: bool) -> bool:
        """A decode half's pull (pd.py): start it, or see whether it has ended. ``True``:
        look the prompt up now (pulled, failed, timed out, or nothing to pull)."""
        started = self._pulling.get(req_id)
        if started is None:
            if local:  # vLLM's own prefix cache has the prompt: only release the pins
                for rank in self.pd_ranks:
                    rank.call("pd_confirm", params=dict(pd))
                self._pulled.add(req_id)
                return True
            self.stats["pd_pulls"] = self.stats.get("pd_pulls", 0) + 1
            args = {"req": req_id, "tokens": tokens, "params": dict(pd)}
            if not self.pd_async:
                for rank in self.pd_ranks:
                    rank.call("pd_pull", **args)
                self._pulled.add(req_id)
                return True
            # A rank whose start failed (None) has nothing running: it counts as done.
            if not any(rank.call("pd_pull_start", **args) for rank in self.pd_ranks):
                self._pulled.add(req_id)
                return True
            self._pulling[req_id] = time.monotonic() + self.pd_wait_s
            return False
        done = all(rank.call("pd_pull_done", req=req_id) is not False for rank in self.pd_ranks)
        if not done and time.monotonic() < started:
            return False
        if not done:
            log.warning(
                "kvmesh: PD pull for %s still running after %.1f s; looking up", req_id, self.pd_wait_s
            )
        del self._pulling[req_id]
        self._pulled.add(req_id)
        return True

    def _track(self, request: Any, adapter: str | None = None) -> _Tracked:
        prompt = request.prompt_token_ids
        hashes = [self.convert_hash(h) for h in (getattr(request, "block_hashes", None) or [])]
        limit = len(prompt) if self.tail else len(prompt) // self.chunk_size * self.chunk_size
        lora = lora_of(request)
        return _Tracked(prompt, hashes, limit, adapter=adapter, lora=lora[:2] if lora else None)

    # -- vLLM: update_state_after_alloc --------------------------------------------------
    def after_alloc(
        self,
        request: Any,
        block_ids: Sequence[int],
        num_external: int,
        group_blocks: Sequence[Sequence[int]] = (),
    ) -> None:
        req_id = request.request_id
        found = self._lookups.pop(req_id, None)
        if found is None:
            return
        seq, hit, local = found
        end = local + num_external
        prompt = request.prompt_token_ids
        if num_external <= 0 or end > hit or end > len(block_ids) * self.block_size:
            if num_external > 0:
                log.warning(
                    "kvmesh: vLLM granted %d tokens beyond %d; kvmesh found %d", num_external, local, hit
                )
            self._releases.append((req_id, seq))
            pd = self._async.pop(req_id, None)
            for rank in self.pd_ranks if pd is not None else ():
                rank.call("pd_confirm", params=pd)  # no pull after all: the producer unpins now
            return
        tail = end % self.block_size != 0  # only a tail chunk ends off a block boundary
        is_async = req_id in self._async
        if self._async.get(req_id) is not None:  # a decode half: pulled once, by this load
            self._pulled.add(req_id)
            self.stats["pd_pulls"] = self.stats.get("pd_pulls", 0) + 1
        self._loads.append(
            LoadSpec(
                req_id,
                seq,
                list(prompt if tail else prompt[:end]),
                list(block_ids[: -(-end // self.block_size)]),
                local,
                end if tail else None,
                load_async=is_async,
                pd=self._async.pop(req_id, None),
                adapter=self._req_adapter.get(req_id),
                group_blocks=[list(g[: -(-end // self.block_size)]) for g in group_blocks],
            )
        )
        self._planned.add(req_id)
        self.stats["loads_async" if is_async else "loads_sync"] = (
            self.stats.get("loads_async" if is_async else "loads_sync", 0) + 1
        )
        self.stats["loads_planned"] += 1

    # -- vLLM: build_connector_meta ------------------------------------------------------
    def build_meta(self, out: Any) -> KVMeshConnectorMetadata:
        meta = KVMeshConnectorMetadata(loads=self._loads, releases=self._releases)
        meta.preempted = sorted(getattr(out, "preempted_req_ids", None) or ())
        self._planned.difference_update(meta.preempted)  # looked up again after this: may load
        self._loads, self._releases = [], []
        scheduled: dict[str, int] = out.num_scheduled_tokens
        meta.scheduled_tokens, meta.scheduled_requests = sum(scheduled.values()), len(scheduled)
        for new in out.scheduled_new_reqs:
            t = self._new.pop(new.req_id, None)
            if t is None:
                continue
            self._active[new.req_id] = t
            t.block_ids = list(new.block_ids[self.main_group]) if new.block_ids else []
            if self.groups > 1 and new.block_ids:
                t.group_blocks = [list(g) for g in new.block_ids]
            self._plan_save(meta, new.req_id, t, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._active.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted and back: a fresh block list
                t.block_ids = list(new_ids[self.main_group]) if new_ids else []
                t.group_blocks = [list(g) for g in new_ids] if new_ids and self.groups > 1 else []
            elif new_ids:
                t.block_ids.extend(new_ids[self.main_group])
                for have, more in zip(t.group_blocks, new_ids, strict=False):
                    have.extend(more)
            self._plan_save(meta, req_id, t, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan_save(self, meta: KVMeshConnectorMetadata, req_id: str, t: _Tracked, computed: int) -> None:
        end = min(computed, t.save_limit)
        if end < len(t.prompt):  # the tail chunk goes only once the whole prompt is computed
            end = end // self.chunk_size * self.chunk_size
        if end <= t.saved_upto:
            return
        blocks = -(-end // self.block_size)
        if len(t.block_ids) < blocks:  # cannot happen with vLLM's bookkeeping; never save blind
            log.warning(
                "kvmesh: request %s has %d blocks for %d tokens; not saving", req_id, len(t.block_ids), end
            )
            return
        full = end // self.block_size  # vLLM hashes full blocks only; events cover full chunks
        hashes = list(t.hashes[:full]) if len(t.hashes) >= full else []
        spec = SaveSpec(
            req_id,
            list(t.prompt[:end]),
            t.block_ids[:blocks],
            t.saved_upto,
            hashes,
            adapter=t.adapter,
            lora=t.lora,
        )
        spec.group_blocks = [g[:blocks] for g in t.group_blocks]
        meta.saves.append(spec)
        t.saved_upto = end
        self._saved.add(req_id)

    # -- vLLM: update_connector_output ---------------------------------------------------
    def on_invalid_blocks(self, invalid: set[int]) -> None:
        """vLLM recomputes from the first block that failed to load; the worker saved
        nothing from there on, so those chunks must be planned again once recomputed."""
        for t in self._active.values():
            for idx, block in enumerate(t.block_ids[: t.saved_upto // self.block_size]):
                if block in invalid:
                    t.saved_upto = idx * self.block_size // self.chunk_size * self.chunk_size
                    break

    # -- vLLM: request_finished ----------------------------------------------------------
    def export(self, request: Any) -> dict[str, Any] | None:
        """A prefill half's ``kv_transfer_params`` for the decode replica (pd.py), or
        ``None`` (not a prefill half, or this replica cannot serve its KV)."""
        if not (self.save_enabled and self.pd_ranks and wants_export(request) and cacheable(request)):
            return None
        if lora_of(request) is not None:  # PD hand-offs move base-model chunks only (see lookup)
            return None
        prompt = request.prompt_token_ids
        limit = len(prompt) if self.tail else len(prompt) // self.chunk_size * self.chunk_size
        tokens = list(prompt[:limit])
        tid = new_transfer_id()  # one for every rank; unguessable, unlike vLLM's request id
        req = request.request_id
        answers = [rank.call("pd_export", req=req, tokens=tokens, transfer_id=tid) for rank in self.pd_ranks]
        if not all(isinstance(a, dict) for a in answers):
            log.warning(
                "kvmesh: PD export of %s failed on a worker rank; no KV handed over", request.request_id
            )
            self.stats["pd_export_failures"] = self.stats.get("pd_export_failures", 0) + 1
            return None
        self.stats["pd_exports"] = self.stats.get("pd_exports", 0) + 1
        return response_params(self.engine_id, answers, key=self.pd_key, ttl_s=self.pd_ttl_s)

    def finished(self, request: Any) -> bool:
        """Forget the request. ``True``: vLLM must keep its blocks until the worker reports
        its saves done (host-device path, and the request had saves)."""
        req_id = request.request_id
        self._planned.discard(req_id)
        self._new.pop(req_id, None)
        self._active.pop(req_id, None)
        self._inflight.discard(req_id)
        self._async.pop(req_id, None)
        self._req_adapter.pop(req_id, None)
        pending = self._pending.pop(req_id, None)
        if pending is not None:  # its lookup still runs on the workers: they unpin when done
            self._releases.append((req_id, pending))
        if req_id in self._pulled or self._pulling.pop(req_id, None) is not None:
            self._pulled.discard(req_id)  # a running pull confirms by itself
        elif self.pd_ranks and self.load_enabled and (pd := remote_prefill(request)) is not None:
            # A decode half that ended before its lookup (rejected, aborted while waiting):
            # the producer unpins now rather than after pd_pin_timeout_s.
            for rank in self.pd_ranks:
                rank.call("pd_confirm", params=dict(pd))
        found = self._lookups.pop(req_id, None)
        if found is not None:
            self._releases.append((req_id, found[0]))
        had_saves = req_id in self._saved
        self._saved.discard(req_id)
        return self.delay_free and had_saves
