"""The ``--kv-transfer-config`` that puts kvmesh's connector into a local vLLM replica.

One copy for the demo, ``kvmesh bench router`` and ``kvmesh bench ttft``: 256-token chunks
(LMCache's size too), half a GiB of cpu tier, and ``kv_load_failure_policy=recompute`` (a
load that fails is recomputed, as the connector asks; vLLM's default fails the request).
"""

from __future__ import annotations

from typing import Any

from kvmesh.errors import ConfigError

KVMESH_CONNECTOR = "KVMeshConnector"
KVMESH_MODULE = "kvmesh.integrations.vllm"
CHUNK_SIZE = 256
CPU_GB = 0.5
TRANSFER_ARGS: dict[str, Any] = {"kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def extra_config(chunk_size: int = CHUNK_SIZE, cpu_gb: float = CPU_GB, **keys: Any) -> dict[str, Any]:
    """kvmesh config keys (``kv_connector_extra_config``): the defaults above plus ``keys``
    (e.g. ``remote_url``, ``local_disk``)."""
    return {"chunk_size": chunk_size, "max_local_cpu_size": cpu_gb, **keys}


def connector_config(remote_url: str | None = None, **keys: Any) -> dict[str, Any]:
    """A replica's ``--kv-transfer-config``: :func:`extra_config` (with ``remote_url``, the
    shared tier, when given) behind kvmesh's connector class."""
    extra = extra_config(**keys) if remote_url is None else extra_config(remote_url=remote_url, **keys)
    return {
        "kv_connector": KVMESH_CONNECTOR,
        "kv_connector_module_path": KVMESH_MODULE,
        **TRANSFER_ARGS,
        "kv_connector_extra_config": extra,
    }


def pd_config(role: str, remote_url: str | None = None, kv_port: int = 0, **keys: Any) -> dict[str, Any]:
    """A prefill/decode replica's ``--kv-transfer-config``: :func:`connector_config` with
    ``kv_role`` ``role`` (``kv_producer``, ``kv_consumer`` or ``kv_both``) and the producer's
    transfer server on ``kv_port`` (vLLM's field; 0 = a free port, which consumers learn from
    ``kv_transfer_params``). ``kv_ip`` (the host it binds and advertises, default 127.0.0.1),
    ``pd_pin_timeout_s`` and ``pd_fetch_timeout_s`` go in ``keys``: vLLM 0.32's
    ``KVTransferConfig`` has no ``kv_ip`` field, so it lives in ``kv_connector_extra_config``."""
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ConfigError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {role!r}")
    cfg = connector_config(remote_url, **keys)
    cfg["kv_role"] = role
    cfg["kv_port"] = kv_port
    return cfg


def producer_config(remote_url: str | None = None, kv_port: int = 0, **keys: Any) -> dict[str, Any]:
    """A prefill replica's ``--kv-transfer-config`` (see :func:`pd_config`)."""
    return pd_config("kv_producer", remote_url, kv_port, **keys)


def consumer_config(remote_url: str | None = None, **keys: Any) -> dict[str, Any]:
    """A decode replica's ``--kv-transfer-config`` (see :func:`pd_config`)."""
    return pd_config("kv_consumer", remote_url, 0, **keys)
