"""Connector settings: kvmesh's :class:`~kvmesh.CacheConfig` plus a few connector keys.

Sources, later ones winning: the YAML file named by ``config_file`` in
``kv_connector_extra_config``, the inline kvmesh keys beside it, then ``KVMESH_*``
environment variables (``KVMESH_CONFIG_FILE`` included), exactly as
:meth:`CacheConfig.from_env` layers them over a base.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.config import CacheConfig
from kvmesh.core.fleetkey import FleetKey
from kvmesh.errors import ConfigError

# Keys of kv_connector_extra_config that belong to the connector, not to CacheConfig.
CONNECTOR_KEYS = {
    "config_file": "YAML file with kvmesh cache settings",
    "model_fingerprint": "identity chunks are keyed by (default: a fingerprint of the weights' "
    "config, safetensors headers and byte samples, plus dtype / kv-cache dtype / quantization); "
    "replicas share chunks only when it is equal. Set it to a value that changes whenever the "
    "weights do, or to 'full' to hash every weight byte at start",
    "model_id": "deprecated alias of model_fingerprint (it used to name chunks by the model's name, "
    "which served a replaced checkpoint's old KV)",
    "socket_dir": "directory of the scheduler->worker unix socket (default: the temp dir; the socket's "
    "path, 36 characters more, must fit a unix socket's 107 bytes)",
    "rpc_timeout_s": "how long the scheduler waits for the worker's lookup answer (default 2)",
    "rpc_host": "address a worker's lookup RPC listens on over TCP, for a scheduler on another node "
    "(default: vLLM's host IP, VLLM_HOST_IP, when tensor_parallel_size > 1 and a fleet key is set; "
    "without a key there is no TCP listener and ranks on another node cannot answer)",
    "rpc_port": "port of that TCP listener (default 0: a free one; vLLM hands it to the scheduler)",
    "layerwise_load": "GPU: let layer i's attention start once layer i's KV is loaded (default false: "
    "a load is one H2D and one scatter per chunk and the forward waits for them, which keeps vLLM's "
    "full CUDA graphs; true needs PIECEWISE graphs, which the connector then requests, and costs "
    "a copy and two scatters per layer and chunk from the forward thread)",
    "async_loads": "which loads go through vLLM's asynchronous path (the request waits in "
    "WAITING_FOR_REMOTE_KVS while the batch keeps stepping): lower (default: chunks below the cpu "
    "tier and PD pulls, while another request is in flight; cpu hits, and loads of an otherwise "
    "idle engine, run within their step, which is faster; lookups run beside the steps and read "
    "what only the remote holds), all, off (every load within its step, and lookups wait for "
    "slow tiers: the behaviour before)",
    "kv_ip": "prefill/decode: the host a producer's KV transfer server binds and advertises to "
    "consumers (default 127.0.0.1; the port is vLLM's kv_port, 0 = a free one)",
    "pd_advertise_host": "prefill/decode: the host consumers connect to when kv_ip is a wildcard "
    "(0.0.0.0 / ::); default: this machine's hostname",
    "pd_pin_timeout_s": "prefill/decode: how long a producer keeps a prefill's chunks pinned for "
    "a decode that has not confirmed (default 60)",
    "pd_fetch_timeout_s": "prefill/decode: a consumer's budget for pulling one request's chunks "
    "from the producer (default 5); past it the rest comes from a shared tier or is recomputed. A "
    "stream that delivers nothing for a third of it (at least pd_connect_timeout_s) resumes on a "
    "fresh connection, at most twice",
    "pd_connect_timeout_s": "prefill/decode: a consumer's budget for connecting to the producer and "
    "completing the fleet-key handshake, within pd_fetch_timeout_s (default 1): what a producer that "
    "accepts and stays silent costs",
    "pd_allow_insecure": "prefill/decode without a fleet key (default false: a kv_producer / kv_consumer "
    "without fleet_key_file refuses to start, a kv_both replica runs with PD off). true: transfers are "
    "unauthenticated and kv_transfer_params unsigned; any host that reaches the transfer port can read "
    "held KV. For a trusted test network only",
    "pd_pin_max_fraction": "prefill/decode: share of the CPU pool a producer's transfer pins may hold "
    "(default 0.5); past it the oldest holds end first",
    "pd_pin_max_requests": "prefill/decode: transfers a producer holds at once (default 1024; the oldest "
    "end first)",
    "pd_async_pull": "prefill/decode: pull on a worker thread while vLLM schedules other requests "
    "(default false: the scheduler waits for the pull, bounded by pd_fetch_timeout_s). On vLLM-CPU "
    "the busy worker loop starves that thread of the GIL: a pull of 1,100 tokens took over 3 s",
}


ASYNC_LOADS = ("lower", "all", "off")


@dataclass(frozen=True)
class ConnectorOptions:
    cache: CacheConfig
    model_fingerprint: str | None = None
    socket_dir: str | None = None
    rpc_timeout_s: float = 2.0
    layerwise_load: bool = False
    async_loads: str = "lower"
    kv_ip: str = "127.0.0.1"
    pd_advertise_host: str | None = None
    pd_pin_timeout_s: float = 60.0
    pd_fetch_timeout_s: float = 5.0
    pd_connect_timeout_s: float = 1.0
    pd_async_pull: bool = False
    pd_allow_insecure: bool = False
    pd_pin_max_fraction: float = 0.5
    pd_pin_max_requests: int = 1024
    rpc_host: str | None = None
    rpc_port: int = 0
    fleet_key: FleetKey | None = None  # loaded from cache.fleet_key_file / KVMESH_FLEET_KEY_FILE

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> ConnectorOptions:
        extra = dict(extra or {})
        own = {k: extra.pop(k) for k in list(extra) if k in CONNECTOR_KEYS}
        base: dict[str, Any] = {}
        if own.get("config_file"):
            base.update(CacheConfig.from_file(str(own["config_file"])).model_dump(exclude_unset=True))
        unknown = sorted(k for k in extra if not CacheConfig.accepts(k))  # LMCache's keys too
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {', '.join(map(repr, unknown))}; "
                f"connector keys: {', '.join(sorted(CONNECTOR_KEYS))}; "
                f"kvmesh keys: {', '.join(sorted(CacheConfig.model_fields))}"
            )
        base.update(extra)
        cache = CacheConfig.from_env(environ, base=base)
        fraction = own.get("pd_pin_max_fraction", 0.5)
        if not isinstance(fraction, int | float) or isinstance(fraction, bool) or not 0 < fraction <= 1:
            raise ConfigError(f"pd_pin_max_fraction is a share of the CPU pool in (0, 1], got {fraction!r}")
        timeout = _positive(own, "rpc_timeout_s", 2.0)
        layerwise = _flag(own, "layerwise_load", False)
        async_loads = str(own.get("async_loads", "lower"))
        if async_loads not in ASYNC_LOADS:
            raise ConfigError(f"async_loads must be one of {', '.join(ASYNC_LOADS)}, got {async_loads!r}")
        return cls(
            cache=cache,
            model_fingerprint=_fingerprint_option(own),
            layerwise_load=layerwise,
            async_loads=async_loads,
            socket_dir=str(own["socket_dir"]) if own.get("socket_dir") else None,
            rpc_timeout_s=timeout,
            kv_ip=str(own.get("kv_ip") or "127.0.0.1"),
            pd_advertise_host=str(own["pd_advertise_host"]) if own.get("pd_advertise_host") else None,
            pd_pin_timeout_s=_positive(own, "pd_pin_timeout_s", 60.0),
            pd_fetch_timeout_s=_positive(own, "pd_fetch_timeout_s", 5.0),
            pd_connect_timeout_s=_positive(own, "pd_connect_timeout_s", 1.0),
            pd_async_pull=_flag(own, "pd_async_pull", False),
            pd_allow_insecure=_flag(own, "pd_allow_insecure", False),
            pd_pin_max_fraction=float(fraction),
            pd_pin_max_requests=_count(own, "pd_pin_max_requests", 1024),
            rpc_host=str(own["rpc_host"]) if own.get("rpc_host") else None,
            rpc_port=_port(own, "rpc_port"),
            fleet_key=FleetKey.from_config(cache.fleet_key_file, environ),
        )


def _flag(own: Mapping[str, Any], key: str, default: bool) -> bool:
    value = own.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _positive(own: Mapping[str, Any], key: str, default: float) -> float:
    try:
        value = float(own.get(key, default))
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a number of seconds, got {own[key]!r}") from None
    if value <= 0:
        raise ConfigError(f"{key} must be positive, got {value}")
    return value


def _count(own: Mapping[str, Any], key: str, default: int) -> int:
    value = own.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key} must be a positive whole number, got {value!r}")
    return value


def _port(own: Mapping[str, Any], key: str) -> int:
    value = own.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 65536:
        raise ConfigError(f"{key} must be a port number (0 = a free one), got {value!r}")
    return value


def _fingerprint_option(own: Mapping[str, Any]) -> str | None:
    value = own.get("model_fingerprint") or own.get("model_id")
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"model_fingerprint must be a string, got {value!r}")
    return value


def check_chunk_size(chunk_size: int, block_size: int) -> None:
    """kvmesh chunks must tile vLLM blocks exactly: a chunk is loaded and saved as whole
    blocks, and a hit must end on a block boundary."""
    if chunk_size % block_size:
        nearest = max(1, round(chunk_size / block_size)) * block_size
        raise ValueError(
            f"kvmesh chunk_size={chunk_size} is not a multiple of vLLM's block_size={block_size}; "
            f"set chunk_size to a multiple of {block_size} (e.g. {nearest})"
        )
