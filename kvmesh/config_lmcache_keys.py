"""LMCache's configuration keys that kvmesh has no equivalent for, with LMCache's default
of each (a value equal to it asks for nothing) and what kvmesh does instead; and LMCache's
own key aliases. Written down from LMCache 0.5.6's ``LMCacheEngineConfig`` and its v0
releases (the interface, not their code)."""

from __future__ import annotations

from typing import Any

# --- keys kvmesh has no equivalent for, grouped by what kvmesh does instead -------------
# key -> LMCache's default: a value equal to it (or None / False / 0) asks for nothing.
_GROUPS: list[tuple[str, dict[str, Any]]] = [
    (
        "CacheBlend (non-prefix reuse) is not in kvmesh: it reuses exact prefixes only "
        "and recomputes the rest",
        {
            "enable_blending": False,
            "blend_recompute_ratios": None,
            "blend_thresholds": None,
            "blend_check_layers": None,
            "blend_min_tokens": 256,
            "blend_special_str": " # # ",
            # v0 names
            "blend_recompute_ratio": 0.15,
            "blend_separator": "[BLEND_SEP]",
            "blend_add_special_in_precomp": False,
        },
    ),
    (
        "no P2P sharing in kvmesh: replicas share KV through the remote tier and `kvmesh router` "
        "sends a request to the replica holding its prefix (LMCache's PD keys are read by "
        "kvmesh.config_lmcache_pd)",
        {
            "enable_p2p": False,
            "p2p_host": None,
            "p2p_init_ports": None,
            "p2p_lookup_ports": None,
        },
    ),
    (
        "LMCache's controller is replaced by kvmesh's admin API and router "
        "(admin_enabled, controller_url = the router's http URL)",
        {
            "enable_controller": False,
            "controller_pull_url": None,
            "controller_reply_url": None,
            "lmcache_worker_ports": None,
            "lmcache_worker_ids": None,
            "lmcache_worker_heartbeat_delay_time": 10,
            "lmcache_worker_heartbeat_time": None,
            "lookup_server_worker_ids": None,
            "enable_scheduler_bypass_lookup": False,
            "external_lookup_client": None,
            "lookup_timeout_ms": 3000,
            "script_allowed_imports": None,
            "run_script_api_enabled": False,
            "internal_api_server_include_index_list": None,
            "internal_api_server_socket_path_prefix": None,
            "remote_config_url": None,
            "app_id": None,
        },
    ),
    (
        "GPU-direct / CXL / GDS storage paths do not exist in kvmesh (CPU, disk and remote tiers only)",
        {
            "gds_path": None,
            "gds_path_sharding": "by_gpu",
            "gds_buffer_size": None,
            "use_gds": True,
            "gds_backend": "cufile",
            "maru_path": None,
            "maru_pool_size": 4.0,
            "numa_mode": None,
            "use_gpu_connector_v3": False,
        },
    ),
    (
        "kvmesh allocates its CPU pool of max_local_cpu_size once at start, in ordinary pages",
        {
            "local_cpu_use_hugepages": False,
            "reserve_local_cpu_size": 0.0,
            "enable_lazy_memory_allocator": False,
            "lazy_memory_initial_ratio": 0.2,
            "lazy_memory_expand_trigger_ratio": 0.5,
            "lazy_memory_step_ratio": 0.1,
            "lazy_memory_safe_size": 0.0,
            "pin_timeout_sec": 300,
            "pin_check_interval_sec": 30,
            "py_enable_gc": True,
        },
    ),
    (
        "kvmesh loads a request's chunks before its forward pass (prefetched in the background); "
        "no layer-by-layer pipelining",
        {
            "use_layerwise": False,
            "enable_async_loading": False,
            "pipelined_backend": False,  # v0
            "min_retrieve_tokens": 0,
            "hit_miss_ratio": None,
            "priority_limit": None,
        },
    ),
    (
        "kvmesh caches prompt chunks; generated tokens are cached when a later prompt contains them",
        {"save_decode_cache": False},
    ),
    (
        "kvmesh stores every chunk in every configured tier, read cpu -> disk -> remote",
        {
            "retrieve_locations": None,
            "store_location": None,
            "local_disk_path_sharding": "by_gpu",
        },
    ),
    (
        "kvmesh keys chunks by xxh3 of the model, layout, salt and tokens",
        {"pre_caching_hash_algorithm": "builtin"},
    ),
    (
        "plugins and extra backends are not loaded by kvmesh; tiers come from remote_url's scheme",
        {
            "runtime_plugin_locations": None,
            "storage_plugins": None,
            "remote_storage_plugins": None,
            "audit_actual_remote_url": None,
        },
    ),
    (
        "statistics are kvmesh's Prometheus metrics and admin API; KV events come from vLLM's "
        "--kv-events-config",
        {
            "enable_chunk_statistics": False,
            "chunk_statistics_auto_start_statistics": False,
            "chunk_statistics_auto_exit_timeout_hours": 0.0,
            "chunk_statistics_auto_exit_target_unique_chunks": 0,
            "chunk_statistics_strategy": "memory_bloom_filter",
            "enable_kv_events": False,
        },
    ),
    (
        "hidden-state caching (vLLM-Omni) is not in kvmesh",
        {
            "enable_hidden_state_cache": False,
            "max_hidden_state_cpu_size": 2.0,
            "hidden_state_layers": None,
            "hidden_states_retrieve_mode": "prefix_strict",
        },
    ),
    (
        "LMCache's multiprocess-server settings: kvmesh runs inside vLLM's process",
        {"mp_host": None, "mp_port": 5555},
    ),
]
NO_EQUIVALENT: dict[str, tuple[Any, str]] = {k: (d, why) for why, keys in _GROUPS for k, d in keys.items()}

# LMCache's own renames (v1 ``_CONFIG_ALIASES``; its ``controller_url`` alias of
# ``controller_pull_url`` is read by kvmesh.config_lmcache: ``controller_url`` is also kvmesh's
# key, the router's http URL).
ALIASES = {
    "enable_xpyd": "enable_pd",
    "nixl_peer_host": "pd_peer_host",
    "nixl_peer_init_port": "pd_peer_init_port",
    "nixl_peer_alloc_port": "pd_peer_alloc_port",
    "nixl_proxy_host": "pd_proxy_host",
    "nixl_proxy_port": "pd_proxy_port",
    "nixl_buffer_size": "pd_buffer_size",
    "nixl_role": "pd_role",
    "lmcache_worker_port": "lmcache_worker_ports",
    "plugin_locations": "runtime_plugin_locations",
    "external_backends": "storage_plugins",
}

# --- keys of older LMCache releases that 0.5.6 no longer knows (0.5.6 warns "Unknown
# configuration key" and ignores them); PD/NIXL ones are in kvmesh.config_lmcache_pd.
_RETIRED_GROUPS: list[tuple[str, dict[str, Any]]] = [
    (
        "an older LMCache release's P2P key (lookup / distributed server); no P2P sharing in kvmesh: "
        "replicas share KV through the remote tier and `kvmesh router` routes by prefix",
        {"lookup_url": None, "distributed_url": None},
    ),
    (
        "an older LMCache release's error-handling switch; kvmesh always treats a failing tier as a miss",
        {"error_handling": False},
    ),
    (
        "an older LMCache release's WekaFS / cuFile (GPU-direct storage) key; kvmesh has no GDS path: "
        "mount the filesystem and use local_disk or remote_url fs:///path",
        {"weka_path": None, "cufile_buffer_size": None, "gds_io_threads": None},
    ),
]
RETIRED: dict[str, tuple[Any, str]] = {k: (d, why) for why, keys in _RETIRED_GROUPS for k, d in keys.items()}

# LMCACHE_* environment variables that are not configuration keys (runtime switches of
# LMCache's code, other LMCache config classes): read by nobody in kvmesh, never warned about.
RUNTIME_ENV = frozenset(
    {
        "track_usage", "usage_track_interval", "usage_track_url", "log_level", "use_experimental",
        "disable_banner", "server_url", "server_service_port", "mq_timeout", "offload_rpc_port",
        "request_telemetry_type", "request_telemetry_endpoint", "gpu_staging_buffer_bytes",
        "force_skip_save", "device_backend", "mp_transfer_mode", "controller_config_file",
        "runtime_plugin_config", "plugin_config", "plugin_role", "plugin_worker_id",
        "plugin_worker_count",
    }
)  # fmt: skip
RUNTIME_ENV_PREFIXES = ("ec_", "controller_", "coordinator_", "aerospike_", "runtime_plugin_", "musa_")

# Where kvmesh's defaults differ from LMCache 0.5.6's: (LMCache key, its default, kvmesh key,
# why). ``kvmesh config check`` lists the rows whose keys a configuration does not set.
DEFAULT_DIFFS: list[tuple[str, Any, str, str]] = [
    ("chunk_size", 256, "chunk_size", "vLLM's CPU block; a shorter tail to recompute (kvmesh bench ttft)"),
    ("max_local_cpu_size", 5.0, "max_local_cpu_size", "GB of CPU pool, allocated up front"),
    ("max_local_disk_size", 0.0, "max_local_disk_size", "GB; kvmesh's 0 means unbounded"),
    ("blocking_timeout_secs", 10, "remote_timeout_s", "one budget for a whole remote operation"),
    ("internal_api_server_enabled", False, "admin_enabled", "None = on inside the vLLM connector"),
    ("internal_api_server_port_start", 6999, "admin_port", "0 = a free port"),
]
