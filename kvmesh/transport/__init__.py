"""Direct KV transfer between vLLM replicas (prefill/decode disaggregation).

A producer (``kv_role: kv_producer`` or ``kv_both``) runs a :class:`TransferServer` in its
vLLM worker process, next to its :class:`~kvmesh.CacheEngine`; a consumer's worker pulls a
request's chunks from it with :func:`pull` straight into its own pool slots, verifying each
like any chunk read from a tier (key, layout, tokens, checksums), then confirms so the
producer drops the pins (:class:`PinLedger`) that kept the chunks between the two halves.
Wire format: :mod:`kvmesh.transport.wire` (framed msgpack control messages and kvmesh's
chunk format, no pickle). With a fleet key both ends prove it (:mod:`kvmesh.transport.auth`)
and every chunk carries a MAC; the server runs on the bounded
:class:`~kvmesh.transport.listener.Listener` (connection caps, frame caps, deadlines).

Its public names are imported lazily: the wire format (``kvmesh.transport.wire``) is used by
processes that must not pay for torch (the disk tier's reader process, the router).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.transport.client import PullResult, confirm, pull
    from kvmesh.transport.pins import PinLedger
    from kvmesh.transport.server import TransferServer

_LAZY = {
    "PullResult": "kvmesh.transport.client",
    "confirm": "kvmesh.transport.client",
    "pull": "kvmesh.transport.client",
    "PinLedger": "kvmesh.transport.pins",
    "TransferServer": "kvmesh.transport.server",
}
__all__ = ["PinLedger", "PullResult", "TransferServer", "confirm", "pull"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmesh.transport' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
