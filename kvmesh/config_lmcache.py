"""Reading LMCache configurations: every key of LMCache's ``LMCacheEngineConfig`` (v1, as of
LMCache 0.5.6) and of its v0 releases, translated into kvmesh keys.

Each key a user wrote gets one :class:`KeyReading`:

* ``taken`` — a kvmesh key (LMCache's ``chunk_size``, ``local_cpu``, ... have kvmesh's name
  and meaning), used as it is;
* ``mapped`` — an LMCache key (or alias, or ``extra_config`` entry) turned into kvmesh keys;
* ``ignored`` — an LMCache key kvmesh has no use for, left at a value that asks for nothing
  (LMCache's own default, or a switch that is off);
* ``unsupported`` — an LMCache key set to ask for a feature kvmesh does not have: a warning
  at start saying what kvmesh does instead, an error with ``strict: true``.

A key neither kvmesh nor LMCache knows stays an error (a typo must not pass). The key list
is LMCache's interface, written down here; none of LMCache's code is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvmesh.errors import ConfigError

Action = Literal["taken", "mapped", "ignored", "unsupported"]
LMCACHE_PREFIX = "lmcache."


@dataclass(frozen=True)
class KeyReading:
    """How one key of the user's configuration was read."""

    key: str  # as written: "local_device", "lmcache.chunk_size", "extra_config.use_odirect"
    source: str  # "file lmcache.yaml", "env LMCACHE_CHUNK_SIZE", "dict", ...
    action: Action
    target: str  # kvmesh key(s) it set, "" when none
    note: str = ""

    def line(self) -> str:
        to = f" -> {self.target}" if self.target else ""
        note = f"  ({self.note})" if self.note else ""
        return f"{self.action:<11} {self.key}{to}{note}   [{self.source}]"


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
        "no P2P / disaggregated-prefill transfer in kvmesh: replicas share KV through the remote "
        "tier and `kvmesh route` sends a request to the replica holding its prefix",
        {
            "enable_p2p": False,
            "p2p_host": None,
            "p2p_init_ports": None,
            "p2p_lookup_ports": None,
            "enable_pd": False,
            "pd_role": None,
            "pd_buffer_size": None,
            "pd_buffer_device": None,
            "pd_peer_host": None,
            "pd_peer_init_port": None,
            "pd_peer_alloc_port": None,
            "pd_peer_query_port": None,
            "pd_proxy_host": None,
            "pd_proxy_port": None,
            "pd_allocation_timeout_sec": float("inf"),
            "pd_shutdown_timeout_sec": 5.0,
            "pd_condition_poll_interval_sec": 0.005,
            "pd_max_prefill_len": 0,
            "pd_backend_mode": "async",
            "pd_skip_proxy_notification": False,
            "pd_bidirectional": False,
            "transfer_channel": None,
            "nixl_backends": None,
            "nixl_buffer_size": None,
            "nixl_buffer_device": None,
            "nixl_peer_port": None,
        },
    ),
    (
        "LMCache's controller is replaced by kvmesh's admin API and router "
        "(admin_enabled, controller_url = the router's http URL)",
        {
            "enable_controller": False,
            "lmcache_instance_id": None,
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

# LMCache's own renames (v1 ``_CONFIG_ALIASES``; its ``controller_url`` alias is not here:
# ``controller_url`` is a kvmesh key, the router's URL).
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

_CACHE_POLICIES = {"lru": "lru", "fifo": "fifo"}
# remote_serde names: LMCache v1 (naive, cachegen, kivi), v0 (torch, safetensor).
SERDE_NAMES = {"naive": "raw", "torch": "raw", "kv": "raw", "safetensor": "safetensors"}

# extra_config keys kvmesh understands: name -> (kvmesh target, converter of the value).
# S3 settings go into remote_url's query string, which the s3 tier reads.
_S3_QUERY = {
    "s3_region": "region",
    "s3_endpoint": "endpoint_url",
    "s3_endpoint_url": "endpoint_url",
    "aws_access_key_id": "access_key_id",
    "aws_secret_access_key": "secret_access_key",
    "s3_num_io_threads": "max_concurrency",
    "disable_tls": "disable_tls",
}
# Mooncake settings, for mooncakestore:// URLs (read by the mooncake tier).
_MOONCAKE_QUERY = {
    "local_hostname": "local_hostname",
    "metadata_server": "metadata_server",
    "protocol": "protocol",
    "device_name": "device_name",
    "global_segment_size": "global_segment_size",
    "local_buffer_size": "local_buffer_size",
}
_EXTRA_IGNORED = {
    "master_server_address": "the master is the host:port of the mooncakestore:// URL",
    "transfer_timeout": "the mooncake tier uses the store's own timeouts",
    "disk_io_threads": "kvmesh's disk tier sizes its own I/O threads",
    "s3_prefer_http2": "the s3 tier speaks HTTP/1.1 through botocore",
    "s3_enable_s3express": "S3 Express One Zone buckets are not handled specially",
    "save_chunk_meta": "kvmesh always stores each chunk's header (key, tokens, checksum)",
}


def _asks_nothing(value: Any, default: Any) -> bool:
    return value is None or value is False or value == default or value == [] or value == 0


def _is_true(value: Any) -> bool:
    return value is True or str(value).strip().lower() in ("true", "1", "yes", "on")


class Translator:
    """Turns one layer of user keys (a file, a dict, env variables) into kvmesh keys."""

    def __init__(self, kvmesh_keys: Iterable[str], source: str) -> None:
        self.kvmesh_keys = set(kvmesh_keys)
        self.source = source
        self.readings: list[KeyReading] = []
        self.values: dict[str, Any] = {}  # from LMCache keys
        self.direct: dict[str, Any] = {}  # kvmesh keys: win over mapped ones in one layer
        self.unknown: list[str] = []
        self.query: dict[str, str] = {}  # s3 settings for remote_url's query
        self.cluster = False  # extra_config.valkey_mode = cluster
        self.mooncake: dict[str, str] = {}  # mooncake settings for remote_url's query

    def note(self, key: str, action: Action, target: str = "", note: str = "") -> None:
        self.readings.append(KeyReading(key, self.source, action, target, note))

    def feed(self, data: Mapping[str, Any]) -> None:
        v0_device = data.get("local_device", data.get(LMCACHE_PREFIX + "local_device"))
        for raw_key, value in data.items():
            key = str(raw_key)
            bare = key[len(LMCACHE_PREFIX) :] if key.startswith(LMCACHE_PREFIX) else key
            if bare.startswith("mp."):
                self.note(key, "ignored", "", "LMCache multiprocess-connector setting")
                continue
            self._one(key, bare, value, v0_device)

    def _one(self, key: str, bare: str, value: Any, v0_device: Any) -> None:
        if bare in self.kvmesh_keys:
            self._kvmesh_key(key, bare, value)
            return
        handler = _MAPPERS.get(bare)
        if handler is not None:
            handler(self, key, value, v0_device)
            return
        if bare in ALIASES:
            self.note(key, "mapped", "", f"LMCache alias of {ALIASES[bare]}")
            bare = ALIASES[bare]
        if bare in NO_EQUIVALENT:
            default, why = NO_EQUIVALENT[bare]
            if _asks_nothing(value, default):
                self.note(key, "ignored", "", f"{value!r} asks for nothing; {why}")
            else:
                self.note(key, "unsupported", "", f"{key}={value!r}: {why}")
            return
        self.unknown.append(key)

    def _kvmesh_key(self, key: str, bare: str, value: Any) -> None:
        if bare in ("remote_serde", "disk_serde") and isinstance(value, str) and value in SERDE_NAMES:
            self.direct[bare] = SERDE_NAMES[value]
            self.note(key, "mapped", bare, f"LMCache's {value!r} is kvmesh's {SERDE_NAMES[value]!r}")
        elif bare == "remote_serde" and value is None:
            self.note(key, "mapped", bare, "null = kvmesh's default codec 'raw'")
        elif bare in ("remote_url", "local_disk") and value is None:
            self.direct[bare] = None
            self.note(key, "taken", bare, "off")
        elif bare == "local_disk" and isinstance(value, str) and "," in value:
            first = value.split(",")[0].strip()
            self.direct[bare] = first
            self.note(key, "unsupported", bare, f"kvmesh's disk tier takes one directory; using {first!r}")
        else:
            self.direct[bare] = value
            self.note(key, "taken", bare)

    # --- the mapped LMCache keys ---------------------------------------------------------
    def _local_device(self, key: str, value: Any, _d: Any) -> None:
        # v0: "cpu" / "cuda" = a local in-memory cache, "file:///dir/" = a local disk cache,
        # null = no local cache (remote only).
        if value is None:
            self.values["local_cpu"] = False
            self.note(key, "mapped", "local_cpu=false", "v0: no local cache")
        elif value in ("cpu", "cuda"):
            self.values["local_cpu"] = True
            note = "v0" if value == "cpu" else "v0 'cuda': kvmesh keeps its local cache in CPU DRAM"
            self.note(key, "mapped", "local_cpu=true", note)
        elif isinstance(value, str) and (value.startswith("file://") or value.startswith("/")):
            self.values["local_disk"] = value
            self.note(key, "mapped", "local_disk", "v0 disk device")
        else:
            raise ConfigError(
                f"config key {key!r}: invalid local device {value!r}; valid: 'cpu', 'cuda', "
                "'file:///directory/' or null"
            )

    def _max_local_cache_size(self, key: str, value: Any, device: Any) -> None:
        is_disk = isinstance(device, str) and device not in ("cpu", "cuda")
        target = "max_local_disk_size" if is_disk else "max_local_cpu_size"
        self.values[target] = value
        self.note(key, "mapped", target, "v0 size in GB of the local device")

    def _cache_policy(self, key: str, value: Any, _d: Any) -> None:
        name = _CACHE_POLICIES.get(str(value).lower())
        if name is None:
            self.values["eviction_policy"] = "lru"
            self.note(key, "unsupported", "eviction_policy=lru", f"{value!r}: kvmesh has lru and fifo")
        else:
            self.values["eviction_policy"] = name
            self.note(key, "mapped", f"eviction_policy={name}")

    def _extra_config(self, key: str, value: Any, _d: Any) -> None:
        import json

        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else None
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"config key {key!r}: not valid JSON ({exc}); write a JSON object"
                ) from None
        if value is None:
            self.note(key, "ignored", "", "empty")
            return
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key {key!r}: must be a mapping (or JSON object), got {value!r}")
        for sub, v in value.items():
            name = f"{key}.{sub}"
            if sub == "use_odirect":
                self.values["disk_o_direct"] = _is_true(v)
                self.note(name, "mapped", "disk_o_direct")
            elif sub in _MOONCAKE_QUERY:
                self.mooncake[_MOONCAKE_QUERY[sub]] = str(v)
                self.note(name, "mapped", f"remote_url ?{_MOONCAKE_QUERY[sub]}=", "read by the mooncake tier")
            elif sub in _S3_QUERY:
                self.query[_S3_QUERY[sub]] = str(v)
                self.note(name, "mapped", f"remote_url ?{_S3_QUERY[sub]}=", "read by the s3 tier")
            elif sub == "valkey_mode":
                if str(v) == "cluster":
                    self.cluster = True
                    self.note(name, "mapped", "remote_url redis-cluster://", "valkey in cluster mode")
                else:
                    self.note(name, "ignored", "", "standalone is the default")
            elif sub in _EXTRA_IGNORED:
                self.note(name, "ignored", "", _EXTRA_IGNORED[sub])
            else:
                self.note(name, "unsupported", "", "LMCache backend option kvmesh has no setting for")


_Mapper = Callable[[Translator, str, Any, Any], None]


def _to(target: str) -> _Mapper:
    """A mapper that sets ``target`` to the value as it is."""

    def handle(t: Translator, key: str, value: Any, _d: Any) -> None:
        t.values[target] = value
        t.note(key, "mapped", target)

    return handle


_MAPPERS: dict[str, _Mapper] = {
    "local_device": Translator._local_device,
    "max_local_cache_size": Translator._max_local_cache_size,
    "cache_policy": Translator._cache_policy,
    "extra_config": Translator._extra_config,
    "blocking_timeout_secs": _to("remote_timeout_s"),
    "internal_api_server_enabled": _to("admin_enabled"),
    "internal_api_server_host": _to("admin_host"),
    "internal_api_server_port_start": _to("admin_port"),
}


def translate(
    layers: Iterable[tuple[str, Mapping[str, Any]]], kvmesh_keys: Iterable[str]
) -> tuple[dict[str, Any], list[KeyReading]]:
    """kvmesh keys from ``(source, data)`` layers, later layers winning, and how each key
    was read. Within one layer a kvmesh key wins over an LMCache key mapped onto it."""
    known = sorted(kvmesh_keys)
    values: dict[str, Any] = {}
    readings: list[KeyReading] = []
    query: dict[str, str] = {}
    mooncake: dict[str, str] = {}
    cluster = False
    for source, data in layers:
        if not isinstance(data, Mapping):
            raise ConfigError(f"config must be a mapping of keys to values, got {type(data).__name__}")
        t = Translator(known, source)
        t.feed(data)
        if t.unknown:
            raise ConfigError(
                f"unknown config key(s) {', '.join(map(repr, sorted(t.unknown)))} ({source}); "
                f"valid keys: {', '.join(known)}; LMCache's keys are accepted too "
                "(see `kvmesh config check`)"
            )
        values.update(t.values)
        values.update(t.direct)
        query.update(t.query)
        mooncake.update(t.mooncake)
        cluster = cluster or t.cluster
        readings.extend(t.readings)
    url = values.get("remote_url")
    if isinstance(url, str):
        scheme = urlsplit(url).scheme
        if cluster and scheme in ("valkey", "redis"):
            url = "redis-cluster://" + url.split("://", 1)[1]
        if query and scheme == "s3":
            url = with_query(url, query)
        if mooncake and scheme == "mooncakestore":
            url = with_query(url, mooncake)
        values["remote_url"] = url
    return values, readings


def is_lmcache_key(key: str) -> bool:
    return key in NO_EQUIVALENT or key in _MAPPERS or key in ALIASES


def with_query(url: str, query: Mapping[str, str]) -> str:
    """``url`` with ``query`` merged into its query string (keys already there win)."""
    parts = urlsplit(url)
    merged = dict(query)
    merged.update(dict(parse_qsl(parts.query)))
    return urlunsplit(parts._replace(query=urlencode(merged)))


_SECRET_PARAMS = ("secret_access_key", "access_key_id", "password")


def redact_url(url: str) -> str:
    """``url`` without credentials (for logs and ``config check``)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = [(k, "***" if k in _SECRET_PARAMS else v) for k, v in parse_qsl(parts.query)]
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query, safe="*")))
