"""Which address the scheduler uses for each tensor-parallel rank's lookup RPC (rpc.py).

Every worker rank reports an :class:`~kvmesh.integrations.vllm.rpc.RpcAddress` through vLLM's
connector handshake metadata (collected from all ranks once the KV caches are registered):
the scheduler takes the unix socket of a rank on its own node and authenticated TCP for a
rank elsewhere, pings each, and logs an error for every rank it cannot reach, so a rank on
another node is never silently a miss.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvmesh.core.fleetkey import FleetKey
from kvmesh.integrations.vllm.rpc import Address, RpcAddress, RpcClient, node_id

log = logging.getLogger(__name__)


def choose_address(rank: int, addr: RpcAddress, here: str | None = None) -> tuple[Address | None, str]:
    """The address the scheduler on node ``here`` uses for ``rank``, and a sentence saying
    which (or, with ``None``, why the rank cannot be reached)."""
    if addr.node == (node_id() if here is None else here):
        return addr.path, f"rank {rank}: unix socket {addr.path}"
    if addr.tcp_host:
        return (addr.tcp_host, addr.tcp_port), f"rank {rank}: tcp {addr.tcp_host}:{addr.tcp_port} (fleet key)"
    return None, (
        f"tensor-parallel rank {rank} runs on another node ({addr.node.split('/')[0]}) and its lookup RPC "
        "has no TCP listener: set fleet_key_file (and rpc_host if vLLM's host IP is not reachable) so it "
        "answers over authenticated TCP. Until then every lookup is a miss"
    )


def rpc_tcp_host(options: Any, tp_size: int) -> str | None:
    """Where a worker's RPC listens on TCP: ``rpc_host``, else (tensor parallelism with a
    fleet key: ranks may sit on other nodes) vLLM's host IP; ``None``: unix socket only."""
    if options.rpc_host:
        return str(options.rpc_host)
    if tp_size <= 1:
        return None
    if options.fleet_key is None:
        log.info(
            "kvmesh: no fleet key, so the lookup RPC serves the local unix socket only: a scheduler "
            "on another node cannot reach this rank (set fleet_key_file for multi-node tensor parallelism)"
        )
        return None
    from vllm.utils.network_utils import get_ip

    return str(get_ip())


def connect_ranks(
    lookups: list[RpcClient],
    others: list[RpcClient],
    metadata: Mapping[int, Any],
    key: FleetKey | None,
    probe_timeout_s: float = 5.0,
) -> list[int]:
    """Point each rank's clients (``lookups[r]`` and ``others[r]``) at the address rank ``r``
    reported (vLLM's handshake metadata), then ping every rank; every rank that cannot be
    reached or does not answer is logged as an error. Returns the ranks that answer."""
    here = node_id()
    for rank, client in enumerate(lookups):
        meta = metadata.get(rank)
        if meta is None:
            log.error(
                "kvmesh: vLLM's handshake carried no address of TP rank %d; using the local unix socket %s",
                rank,
                client.path,
            )
            continue
        addr = RpcAddress(meta.node, meta.path, meta.tcp_host, meta.tcp_port)
        target, how = choose_address(rank, addr, here)
        if target is None:
            log.error("kvmesh: %s", how)
            continue
        log.info("kvmesh: lookups to %s", how)
        for c in (client, *others[rank : rank + 1]):
            c.retarget(target, key)
    alive = []
    for rank, client in enumerate(lookups):
        saved, client.timeout_s = client.timeout_s, probe_timeout_s
        try:
            if client.call("ping") == "pong":
                alive.append(rank)
        finally:
            client.timeout_s = saved
    return alive
