"""The ``--kv-transfer-config`` that puts kvmesh's connector into a local vLLM replica.

One copy for the demo, ``kvmesh bench router``, ``bench pd``, the soak and the e2e tests.
kvmesh's shipped defaults throughout (``chunk_size`` is left to :class:`kvmesh.config.CacheConfig`,
128 tokens, so every run measures what a user gets), except two settings stated here:
half a GiB of CPU tier (the shipped 2 GB is allocated up front, and up to six replicas share
the 2-core, 23 GiB machine the benchmarks run on; no harness workload needs more), and
``kv_load_failure_policy=recompute`` (a load that fails is recomputed, as the connector asks;
vLLM's default fails the request). PD replicas share a fleet key (:func:`fleet_key_file`).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from typing import Any

from kvmesh.core.fleetkey import FleetKey
from kvmesh.errors import ConfigError

KVMESH_CONNECTOR = "KVMeshConnector"
KVMESH_MODULE = "kvmesh.integrations.vllm"
CPU_GB = 0.5
TRANSFER_ARGS: dict[str, Any] = {"kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


_KEY_LOCK = threading.Lock()
_KEY_FILE: str | None = None


def fleet_key_file() -> str:
    """A fleet key file for the replicas this process starts (PD needs one): made once per
    process in a private temp directory (mode 0600), removed at exit. Every replica given
    this path shares the key, as a fleet does."""
    global _KEY_FILE
    with _KEY_LOCK:
        if _KEY_FILE is None or not os.path.exists(_KEY_FILE):
            folder = tempfile.mkdtemp(prefix="kvmesh-fleet-key-")
            path = os.path.join(folder, "fleet.key")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(FleetKey.generate() + "\n")
            atexit.register(shutil.rmtree, folder, True)
            _KEY_FILE = path
        return _KEY_FILE


def shipped_chunk_size() -> int:
    """``chunk_size``'s default in :class:`kvmesh.config.CacheConfig` (imported when asked:
    the ``kvmesh`` command's parsers import this module)."""
    from kvmesh.config import CacheConfig

    return int(CacheConfig.model_fields["chunk_size"].default)


def extra_config(cpu_gb: float = CPU_GB, **keys: Any) -> dict[str, Any]:
    """kvmesh config keys (``kv_connector_extra_config``): the CPU tier size above plus
    ``keys`` (e.g. ``remote_url``, ``local_disk``; a ``chunk_size`` here is a benchmark's
    stated departure from the shipped default)."""
    return {"max_local_cpu_size": cpu_gb, **keys}


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
    ``KVTransferConfig`` has no ``kv_ip`` field, so it lives in ``kv_connector_extra_config``.
    Transfers are authenticated with ``fleet_key_file`` (default: this process's
    :func:`fleet_key_file`, shared by every replica it starts)."""
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ConfigError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {role!r}")
    keys.setdefault("fleet_key_file", fleet_key_file())
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
