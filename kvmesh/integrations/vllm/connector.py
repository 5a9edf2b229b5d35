"""``KVMeshConnector``: kvmesh as a vLLM v1 KV connector.

vLLM creates one instance per role: in the scheduler process (role SCHEDULER:
:class:`~kvmesh.integrations.vllm.scheduler.SchedulerSide`) and in each worker process (role
WORKER: :class:`~kvmesh.integrations.vllm.worker.WorkerSide`, owner of the CacheEngine).
They talk through the per-step metadata (scheduler -> worker), ``KVConnectorOutput``
(worker -> scheduler: load errors, events) and an RPC for lookups (rpc.py: a unix socket, or
authenticated TCP to a rank on another node, found through vLLM's handshake metadata).

Enable it with::

    --kv-transfer-config '{"kv_connector": "KVMeshConnector",
      "kv_connector_module_path": "kvmesh.integrations.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"config_file": "kvmesh.yaml"}}'

It implements vLLM's ``SupportsHMA``, so vLLM's hybrid KV cache manager stays on: a dense
model is one KV cache group, cached as before; a hybrid model's groups each get their own
key space (groups.py, hybrid.py): full-attention groups store every chunk, sliding-window
groups only the window before a load point. Groups kvmesh cannot cache (Mamba /
linear-attention state, ...) are refused by name, and kvmesh then stays out of the way:
no lookups, no saves, vLLM runs the model without it.

The page layout is chosen at ``register_kv_caches`` from what vLLM reports: the attention
backends of the layers, the resolved ``KVCacheLayout``, MLA or not, ``kv_cache_dtype``
(layouts.py); anything kvmesh does not know stops the worker with an error naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvmesh.core.engine import CacheEngine
from kvmesh.core.keys import KVLayout
from kvmesh.integrations.vllm.cpus import spawning_background_threads
from kvmesh.integrations.vllm.groups import Group, UnsupportedGroups, classify, main_group
from kvmesh.integrations.vllm.hybrid import GroupStore
from kvmesh.integrations.vllm.identity import replica_identity
from kvmesh.integrations.vllm.layouts import Choice, CpuPackedPages, PageLayout, choose_page_layout
from kvmesh.integrations.vllm.metadata import KVMeshConnectorMetadata, KVMeshKVEvents
from kvmesh.integrations.vllm.options import ConnectorOptions, check_chunk_size
from kvmesh.integrations.vllm.paged import VERIFIED_ISAS, ordered_names
from kvmesh.integrations.vllm.pd import SAVER_WAIT_S, PdWorker, pd_mode
from kvmesh.integrations.vllm.prom import KVMeshPromMetrics, KVMeshStats
from kvmesh.integrations.vllm.ranks import connect_ranks, rpc_tcp_host
from kvmesh.integrations.vllm.rpc import RpcClient, RpcServer, socket_path
from kvmesh.integrations.vllm.scheduler import SchedulerSide
from kvmesh.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


def _cpu_attention_isa(vllm_config: VllmConfig, head_size: int) -> str | None:
    """The ISA vLLM-CPU's attention picks for this model (its page layout), or ``None``
    when vLLM no longer exposes the choice."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    dtype = vllm_config.model_config.dtype
    if not isinstance(dtype, torch.dtype):
        return None
    return str(
        _get_attn_isa(
            dtype,
            vllm_config.cache_config.block_size,
            head_size,
            vllm_config.cache_config.cache_dtype,
        )
    )


def _plain_view(t: torch.Tensor, cache_dtype: str) -> torch.Tensor:
    """fp8 KV that vLLM allocated as uint8, viewed as its fp8 type (the layout's dtype
    names the format, so e4m3 and e5m2 chunks never share keys)."""
    if t.dtype == torch.uint8 and cache_dtype.startswith("fp8"):
        return t.view(torch.float8_e5m2 if cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn)
    return t


@dataclass
class KVMeshHandshake(KVConnectorHandshakeMetadata):
    """A worker rank's :class:`~kvmesh.integrations.vllm.rpc.RpcAddress`, as vLLM carries it."""

    node: str
    path: str
    tcp_host: str | None = None
    tcp_port: int = 0


class KVMeshConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST
    # vLLM's KV cache groups (groups.py); a dense model's one group until told otherwise.
    groups: tuple[Group, ...] = ()
    main_group = 0
    refused: str | None = None  # why kvmesh stays off for this model (a group kind, by name)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = self._kv_transfer_config
        # vLLM's KV cache groups (one for a dense model). A kind kvmesh cannot cache turns
        # the connector off (refused by name): vLLM serves the model without kvmesh.
        try:
            self.groups = tuple(classify(kv_cache_config)) if kv_cache_config is not None else ()
        except UnsupportedGroups as e:
            self.refused = str(e)
            log.error("kvmesh: %s; kvmesh stays off for this model (no lookups, no saves)", e)
        self.main_group = main_group(self.groups)
        self.options = ConnectorOptions.from_extra_config(tc.kv_connector_extra_config)
        self.options.cache.check_kv_role(tc.kv_role)  # LMCache's pd_role, if one was given
        self.block_size = int(vllm_config.cache_config.block_size)
        check_chunk_size(self.options.cache.chunk_size, self.block_size)
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size > 1:
            raise ValueError("kvmesh's vLLM connector does not support pipeline parallelism yet")
        self.engine_id = str(tc.engine_id)
        self.dp_rank = int(getattr(par, "data_parallel_rank", 0) or 0)
        self._sched: SchedulerSide | None = None
        self._clients: list[RpcClient] = []
        self._events: list[KVCacheEvent] = []
        self._worker: WorkerSide | None = None
        self._pd: PdWorker | None = None
        self._server: RpcServer | None = None
        self.pd_mode = pd_mode(self.options, str(tc.kv_role))  # a PD role without a key: ConfigError
        if len(self.groups) > 1 and self.refused is None:
            self.refused = self._hybrid_refusal(vllm_config)
            if self.refused is not None:
                log.error("kvmesh: %s is not supported; kvmesh stays off for this model", self.refused)
        if role == KVConnectorRole.SCHEDULER and self.refused is None:
            if tc.kv_load_failure_policy != "recompute":
                # A cache must never fail a request: a chunk that cannot be loaded is a miss.
                # vLLM reads the policy right after creating this connector, so this applies.
                log.warning(
                    "kvmesh: kv_load_failure_policy=%r would fail requests whose cached KV cannot "
                    "be loaded; using 'recompute'. Set it explicitly in --kv-transfer-config.",
                    tc.kv_load_failure_policy,
                )
                tc.kv_load_failure_policy = "recompute"
            key = self.options.fleet_key
            self._clients = [
                RpcClient(
                    socket_path(self.engine_id, rank, self.dp_rank, self.options.socket_dir),
                    timeout_s=self.options.rpc_timeout_s,
                    key=key,
                    label=f"kvmesh worker TP rank {rank}",
                )
                for rank in range(par.tensor_parallel_size)
            ]
            lookups = list(self._clients)
            # KV off the CPU takes the host-device path, whose saves read the blocks after
            # the step: vLLM must hold a request's blocks until its saves are done.
            delay_free = str(getattr(vllm_config.device_config, "device_type", "cpu")) != "cpu"
            # Prefill/decode calls (pd.py) on their own clients: a pull may take up to
            # pd_fetch_timeout_s and an export waits for the saver, beyond a lookup's timeout.
            pd_timeout = self.options.pd_fetch_timeout_s + SAVER_WAIT_S + 1.0
            pd_clients = [
                RpcClient(c.address, timeout_s=pd_timeout, retry_after_s=0.0, key=key, label=c.label)
                for c in lookups
            ]
            self._clients += pd_clients
            self._sched = SchedulerSide(
                self.options.cache.chunk_size,
                self.block_size,
                lookups,
                convert_hash=maybe_convert_block_hash,
                load=tc.is_kv_consumer,
                save=tc.is_kv_producer,
                tail=self.options.cache.save_unfull_chunk,
                delay_free=delay_free,
                pd_ranks=pd_clients if self.pd_mode != "off" else [],
                engine_id=self.engine_id,
                pd_async=self.options.pd_async_pull,
                pd_wait_s=self.options.pd_fetch_timeout_s + 1.0,
                pd_key=key,
                pd_ttl_s=self.options.pd_pin_timeout_s,
                async_loads=self.options.async_loads if tc.is_kv_consumer else "off",
                groups=max(1, len(self.groups)),
                main_group=self.main_group,
            )

    def _hybrid_refusal(self, vllm_config: VllmConfig) -> str | None:
        """Why this hybrid model (several KV cache groups) cannot be cached, or ``None``."""
        tags = "; ".join(g.tag for g in self.groups)
        if self.pd_mode != "off":
            return f"prefill/decode hand-over of a hybrid model ({tags})"
        if any(g.block_size != self.block_size for g in self.groups):
            return f"KV cache groups of block sizes other than vLLM's {self.block_size} ({tags})"
        device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu") or "cpu")
        if device != "cpu":
            return f"a hybrid model ({tags}) with KV on {device} (vLLM-CPU's pages only, as yet)"
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer-wise loads need wait_for_layer_load to run between the graph's pieces; the
        # default (whole-chunk loads the forward waits for) keeps vLLM's full CUDA graphs.
        return (extra_config or {}).get("layerwise_load", False) is True

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best-effort cache: a dropped save is only a later miss

    # ==== worker side ===================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.refused is not None:
            return  # refused by name at construction: vLLM runs without kvmesh
        cfg = self._vllm_config
        mc, par = cfg.model_config, cfg.parallel_config
        if len(self.groups) > 1:
            self._register_hybrid(kv_caches)
            return
        names = ordered_names(kv_caches)
        layers = [kv_caches[n] for n in names]
        num_layers = mc.get_num_layers(par)
        if len(layers) != num_layers:
            raise ValueError(
                f"vLLM registered {len(layers)} KV cache layers but the model config says "
                f"{num_layers}; kvmesh supports one KV tensor per attention layer "
                "(no cross-layer KV sharing)"
            )
        page = choose_page_layout(self._choice(names, layers), self.block_size)
        layers = [_plain_view(t, str(cfg.cache_config.cache_dtype)) for t in layers]
        dtype = layers[0].dtype
        if mc.use_mla:
            latent = int(layers[0].shape[-1])
            page.check(layers, 1, latent)
            layout = KVLayout(num_layers, 1, latent, dtype, kv_planes=1)
        else:
            layout = KVLayout(num_layers, mc.get_num_kv_heads(par), mc.get_head_size(), dtype)
            page.check(layers, layout.num_kv_heads, layout.head_size)
        if isinstance(page, CpuPackedPages):
            self._check_cpu_isa(layout)
        rank = self._tp_rank()
        with spawning_background_threads():  # kvmesh's threads stay off vLLM-CPU's compute cores
            self._start_worker(cfg, layers, names, page, layout, rank)
        path = socket_path(self.engine_id, rank, self.dp_rank, self.options.socket_dir)
        assert self._worker is not None
        log.info(
            "kvmesh: worker rank %d serving %s; layout %s; pages %s on %s; shard %d; chunk %d",
            rank,
            path,
            layout,
            page.name,
            layers[0].device,
            self._worker.engine.keys.shard,
            self._worker.engine.config.chunk_size,
        )

    def _group_layout(
        self, kv_caches: dict[str, torch.Tensor], group: Group
    ) -> tuple[list[str], list[torch.Tensor], PageLayout, KVLayout]:
        """One KV cache group's layers (model order), page layout and KV layout."""
        cfg = self._vllm_config
        mc, par = cfg.model_config, cfg.parallel_config
        names = ordered_names({n: kv_caches[n] for n in group.layers})
        raw = [kv_caches[n] for n in names]
        page = choose_page_layout(self._choice(names, raw), group.block_size)
        layers = [_plain_view(t, str(cfg.cache_config.cache_dtype)) for t in raw]
        if mc.use_mla:
            latent = int(layers[0].shape[-1])
            page.check(layers, 1, latent)
            return names, layers, page, KVLayout(len(layers), 1, latent, layers[0].dtype, kv_planes=1)
        layout = KVLayout(len(layers), mc.get_num_kv_heads(par), mc.get_head_size(), layers[0].dtype)
        page.check(layers, layout.num_kv_heads, layout.head_size)
        return names, layers, page, layout

    def _register_hybrid(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """A hybrid model: the main group through the worker's own engine, every other
        group through a :class:`GroupStore` with its own key space (hybrid.py)."""
        cfg = self._vllm_config
        rank = self._tp_rank()
        identity = replica_identity(cfg, self.options.model_fingerprint)
        shard = self._shard(rank, bool(cfg.model_config.use_mla))
        by_index = {g.index: g for g in self.groups}
        main = by_index[self.main_group]
        names, layers, page, layout = self._group_layout(kv_caches, main)
        if not isinstance(page, CpuPackedPages) or layers[0].device.type != "cpu":
            raise NotImplementedError(
                "kvmesh caches hybrid models (several KV cache groups) on vLLM-CPU's pages only; "
                f"this one has {page.name} pages on {layers[0].device}"
            )
        self._check_cpu_isa(layout)
        stores: list[GroupStore] = []
        with spawning_background_threads():
            for g in self.groups:
                if g.index == main.index:
                    continue
                _, g_layers, g_page, g_layout = self._group_layout(kv_caches, g)
                engine = CacheEngine(
                    self.options.cache, layout=g_layout, model_id=f"{identity}|{g.tag}", shard=shard
                )
                stores.append(GroupStore(g, engine, g_layers, g_page))
            self._start_worker(
                cfg, layers, names, page, layout, rank, identity=f"{identity}|{main.tag}", groups=stores
            )
        log.info(
            "kvmesh: worker rank %d caches a hybrid model: main group %s; other groups %s",
            rank,
            main.tag,
            "; ".join(st.group.tag for st in stores),
        )

    def _start_worker(
        self,
        cfg: VllmConfig,
        layers: list[torch.Tensor],
        names: list[str],
        page: PageLayout,
        layout: KVLayout,
        rank: int,
        identity: str | None = None,
        groups: list[GroupStore] | None = None,
    ) -> None:
        engine = CacheEngine(
            self.options.cache,
            layout=layout,
            model_id=identity or replica_identity(cfg, self.options.model_fingerprint),
            shard=self._shard(rank, bool(cfg.model_config.use_mla)),
        )
        if layers[0].is_cuda:
            engine.cpu.pool.pin()  # once, before any slot is used: async D2H/H2D
        ev = cfg.kv_events_config
        tc = self._kv_transfer_config
        self._worker = WorkerSide(
            engine,
            layers,
            self.block_size,
            events=bool(ev and ev.enable_kv_cache_events),
            page=page,
            layer_names=names,
            layerwise=self.options.layerwise_load,
            async_loads="all" if groups else self.options.async_loads,
            pd_budget_s=self.options.pd_fetch_timeout_s,
            groups=groups or (),
            main_group=self.main_group,
        )
        self._pd = PdWorker(
            engine,
            self.options,
            produce=bool(tc.is_kv_producer),
            port=int(tc.kv_port),
            rank=rank,
            drain_saves=self._worker.drain_saves,
            enabled=self.pd_mode != "off",
        )
        self._worker.loads.pd_pull = self._pd.pull  # a decode half's load pulls first
        self._worker.stats_hooks.append(self._pd.stats)
        path = socket_path(self.engine_id, rank, self.dp_rank, self.options.socket_dir)
        self._server = RpcServer(
            path,
            {**self._worker.handlers(), **self._pd.handlers()},
            key=self.options.fleet_key,
            tcp_host=rpc_tcp_host(self.options, int(cfg.parallel_config.tensor_parallel_size)),
            tcp_port=self.options.rpc_port,
        ).start()

    def get_handshake_metadata(self) -> KVMeshHandshake | None:
        # Where this rank's lookup RPC listens; vLLM hands every rank's to the scheduler.
        return KVMeshHandshake(**asdict(self._server.address())) if self._server is not None else None

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self._sched is not None:
            tp = len(self._sched.ranks)
            connect_ranks(self._clients[:tp], self._clients[tp:], metadata, self.options.fleet_key)

    def _choice(self, names: list[str], layers: list[torch.Tensor]) -> Choice:
        """What vLLM says about these layers, as names (see layouts.choose_page_layout)."""
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        cfg = self._vllm_config
        backends = frozenset(b.get_name() for b in get_current_attn_backends(cfg, names))
        layout = getattr(cfg.cache_config, "kv_cache_layout", None)
        return Choice(
            backends=backends,
            layout=str(layout) if layout is not None else None,
            mla=bool(cfg.model_config.use_mla),
            cache_dtype=str(cfg.cache_config.cache_dtype),
            device=layers[0].device.type if layers else "cpu",
        )

    def _check_cpu_isa(self, layout: KVLayout) -> None:
        isa = _cpu_attention_isa(self._vllm_config, layout.head_size)
        if isa is not None and isa not in VERIFIED_ISAS:
            raise NotImplementedError(
                f"vLLM-CPU uses the {isa!r} attention kernel for this model, whose KV page layout "
                f"kvmesh has not verified (verified: {', '.join(sorted(VERIFIED_ISAS))}); "
                "use dtype float32 on x86"
            )

    def _shard(self, rank: int, mla: bool) -> int:
        """The key's shard: the KV-head slice this rank holds. MLA's latent is the same on
        every rank, so all ranks share shard 0 (one stored copy per chunk); ranks that
        replicate KV heads (TP > KV heads) share their group's shard."""
        if mla:
            return 0
        replicas = int(getattr(self._kv_cache_config, "kv_tp_replicas", 1) or 1)
        return rank // max(1, replicas)

    @staticmethod
    def _tp_rank() -> int:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except (ImportError, AssertionError, RuntimeError):
            return 0

    def _meta(self) -> KVMeshConnectorMetadata | None:
        if self._worker is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVMeshConnectorMetadata) else None

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        meta = self._meta()
        if meta is not None and self._worker is not None:
            self._worker.bound(meta)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None and self._worker is not None:
            self._worker.start_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # On the host-device path the compute stream waits for this layer's copies only;
        # on vLLM-CPU loads completed in start_load_kv.
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # A preempted request's blocks are freed now; its saves must read them first.
        meta = kv_connector_metadata
        if self._worker is not None and isinstance(meta, KVMeshConnectorMetadata) and meta.preempted:
            self._worker.wait_for_preempted(meta.preempted)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saved once per step in wait_for_save, when every layer is written

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta is not None and self._worker is not None:
            self._worker.end_step(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Sending: requests whose blocks vLLM held for a save still in flight (host-device
        # path). Receiving: asynchronous loads whose blocks are filled (or reported invalid).
        if self._worker is None:
            return None, None
        recving = self._worker.finished_loading(finished_req_ids)
        done = self._worker.finished(finished_req_ids)
        return (done or None), (recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # A hybrid model's short loads are failed receives (vLLM recomputes the request):
        # its block ids are per group, so vLLM refuses block-level errors for it.
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_loads() if self._worker is not None else set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    # -- measured costs on vLLM's /metrics (prom.py) -------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.cost_stats.take() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVMeshStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVMeshPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_kv_cache_events(self) -> KVMeshKVEvents | None:
        if self._worker is None:
            return None
        events = self._worker.events.take()
        if not events:
            return None
        container = KVMeshKVEvents(num_workers=1)
        container.add_events(events)
        return container

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._pd is not None:
            self._pd.close()
            self._pd = None
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        for client in self._clients:
            client.close()

    # ==== scheduler side ================================================================
    def _scheduler(self) -> SchedulerSide:
        if self._sched is None:
            raise RuntimeError("scheduler-side method called on the worker-side connector")
        return self._sched

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.refused is not None:
            return 0, False
        try:
            sched = self._scheduler()
            n = sched.lookup(request, num_computed_tokens)
            # (n, True): vLLM parks the request in WAITING_FOR_REMOTE_KVS while the worker
            # reads (a lower tier, a PD pull); get_finished names it when its blocks are filled.
            return n, bool(n) and sched.load_async(request.request_id)
        except Exception:  # a cache problem must never stop scheduling
            log.exception("kvmesh: lookup failed; treating it as a miss")
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.refused is not None:
            return
        groups = blocks.get_block_ids() if num_external_tokens > 0 else ()
        block_ids = groups[self.main_group] if groups else []
        hybrid = groups if len(self.groups) > 1 else ()
        self._scheduler().after_alloc(request, block_ids, num_external_tokens, hybrid)

    def build_connector_meta(self, scheduler_output: Any) -> KVMeshConnectorMetadata:
        if self.refused is not None:
            return KVMeshConnectorMetadata()
        return self._scheduler().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.refused is not None:
            return
        if connector_output.invalid_block_ids:
            self._scheduler().on_invalid_blocks(set(connector_output.invalid_block_ids))
        events = connector_output.kv_cache_events
        if isinstance(events, KVConnectorKVEvents):
            self._events.extend(events.aggregate().get_all_events())

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM's SupportsHMA: the blocks of every KV cache group; the scheduler side keeps
        # the groups it planned with, so the main group's stand for the request.
        main = block_ids[self.main_group] if len(block_ids) > self.main_group else []
        return self.request_finished(request, list(main))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.refused is not None:
            return False, None
        # vLLM-CPU: saves snapshot their blocks within the step, so vLLM may free them now.
        # Host-device path: a request that had saves keeps its blocks until the worker
        # reports them done in get_finished. A prefill half (do_remote_decode) returns where
        # the decode replica fetches its KV: vLLM sends it back as the response's
        # kv_transfer_params (pd.py); its chunks are pinned until the consumer confirms.
        sched = self._scheduler()
        try:
            params = sched.export(request)
        except Exception:  # a cache problem must never fail the request: no hand-over
            log.exception("kvmesh: PD export failed; the decode replica computes the prompt")
            params = None
        return sched.finished(request), params

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._events = self._events, []
        return events
